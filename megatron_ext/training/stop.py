"""Stopping a run early without losing work: signals, a wall-clock budget, a step interval.

Clusters end jobs with signals: SLURM sends SIGTERM at a time limit, on preemption and on
``scancel`` (then SIGKILL after its ``KillWait``), and ``sbatch --signal=USR1@N`` sends SIGUSR1
``N`` seconds before the limit; a person at a terminal presses Ctrl-C (SIGINT). With
``training.exit_signal_handler`` (on by default) SIGTERM, SIGUSR1 and SIGINT only raise a flag:
the step in flight finishes, every rank agrees to stop after the same step (a MAX all-reduce of
the flag each step, so no rank waits for one that went on), the loop saves that step, waits until
the checkpoint is published, and the process exits with ``exit_codes.RESUMABLE_EXIT_CODE``. A second
signal while that save runs is recorded and otherwise ignored; publication is atomic anyway
(``checkpoint.writer``), so even SIGKILL loses only the save in flight.

Ctrl-C says so on the terminal: the first press one line (finishing the step, then saving), a
second that the save is under way, a third ends the process at once (exit 130,
``exit_codes.INTERRUPTED_EXIT_CODE``), saying that the save in flight is lost and the previous
checkpoint is where the same command resumes. SIGINTs less than :data:`SAME_PRESS_SECONDS` apart
count as one press: a terminal signals its whole foreground group, so a worker under torchrun gets
each Ctrl-C twice (once more from the agent).

The same path serves Megatron-LM's ``--exit-duration-in-mins`` (a wall-clock budget from the
process's start, checked after every step) and ``--exit-interval`` (stop after every step that is
a multiple of it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist

from megatron_ext import processes
from megatron_ext.fileio import write_atomic
from megatron_ext.exit_codes import EXIT_STATUS_ENV, INTERRUPTED_EXIT_CODE, STOP_HANDLERS_SUFFIX

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

SAME_PRESS_SECONDS = 1.0
"""SIGINTs closer together than this are one Ctrl-C (the terminal's and torchrun's forwarded copy)."""


def _rank_0_status_file() -> str | None:
    """``$MEGATRON_EXT_EXIT_STATUS_FILE`` on global rank 0; None on other ranks or when unset."""
    path = os.environ.get(EXIT_STATUS_ENV)
    return path if path and int(os.environ.get("RANK", "0")) == 0 else None


def write_exit_status(code: int, reason: str) -> None:
    """Record ``code`` at ``$MEGATRON_EXT_EXIT_STATUS_FILE`` (global rank 0 only; written whole,
    through a temporary file and a rename). Nothing happens when the variable is unset."""
    if path := _rank_0_status_file():
        write_atomic(path, f"{code} {reason}\n")


def write_stop_handlers_ready() -> None:
    """Say that the stop handlers are installed (``exit_codes.STOP_HANDLERS_SUFFIX``, beside the
    exit-status file; global rank 0 only; nothing when the variable is unset)."""
    if path := _rank_0_status_file():
        write_atomic(path + STOP_HANDLERS_SUFFIX, f"{os.getpid()}\n")


def _say(line: str) -> None:
    """``line`` on stderr from a signal handler (rank 0 only): ``os.write``, which a handler may call
    while the interrupted code is inside ``print`` (``print`` would raise a reentrant-call error)."""
    if int(os.environ.get("RANK", "0")) == 0:
        os.write(2, f"{line}\n".encode())

# Reasons, by priority in the all-reduce (MAX): a signal outranks the budget, the budget the interval.
_NONE, _INTERVAL, _DURATION, _SIGNAL = 0, 1, 2, 3


@dataclass(frozen=True, kw_only=True)
class StepAgreement:
    """What every rank decided alike after a step (``StopPolicy.agree``)."""

    stop: str | None
    """Why the run stops after the step; None: it goes on."""
    timed_save: bool
    """A wall-clock save is due (``checkpoint.save_interval_minutes``)."""


class StopPolicy:
    """When a run stops early (module docstring); one per run, on every rank.

    Args:
        handle_signals: Turn SIGTERM/SIGUSR1 into a stop after the current step
            (``training.exit_signal_handler``); handlers are installed by :meth:`signals_handled`.
        duration_minutes: Stop once this much wall-clock time has passed since the process started
            (``training.exit_duration_in_mins``); None: no budget.
        interval: Stop after a step that is a multiple of it (``training.exit_interval``); None: never.
        rank_nodes: Each rank's node (``process_group.rank_nodes``): a stop that a signal to another
            rank caused names that rank and its node. Empty: the rank alone.
    """

    def __init__(self, *, handle_signals: bool, duration_minutes: float | None, interval: int | None,
                 rank_nodes: tuple[str, ...] = ()):
        self.handle_signals = handle_signals
        self.rank_nodes = rank_nodes
        self.duration_minutes = duration_minutes
        self.interval = interval
        self.started = psutil.Process().create_time()
        self.received: list[str] = []
        """Names of the stop signals received, in order."""
        self.presses: list[float] = []
        """When each Ctrl-C (SIGINT, copies within ``SAME_PRESS_SECONDS`` merged) came."""

    def _on_signal(self, signum: int, frame) -> None:  # records: the loop acts between steps
        self.received.append(signal.Signals(signum).name)
        if signum == signal.SIGINT:
            self._on_ctrl_c()

    def _on_ctrl_c(self) -> None:
        """What a person at the terminal reads after each Ctrl-C (rank 0 only: one line per press)."""
        now = time.monotonic()
        if self.presses and now - self.presses[-1] < SAME_PRESS_SECONDS:
            return
        self.presses.append(now)
        press = len(self.presses)
        if press >= 3:
            _say("Ctrl-C a third time: stopped at once; the checkpoint being written (if any) is lost, the last "
                 "complete one is where the same command resumes")
            os._exit(INTERRUPTED_EXIT_CODE)  # publication is atomic: a partial save is never read
        _say("Ctrl-C: finishing the step in flight, then saving a checkpoint to resume from (Ctrl-C again: "
             "nothing changes, a third time: stop at once and lose that save)" if press == 1 else
             "Ctrl-C again: still finishing the step and its checkpoint; a third Ctrl-C stops at once and loses it")

    @contextlib.contextmanager
    def signals_handled(self) -> Iterator[None]:
        """The stop-signal handlers installed for the block (main thread only, as Python requires);
        the previous handlers come back after it, unless a stop signal came: then the stop signals
        are ignored from there on. The process is on its way to its resumable exit, and a repeated
        signal (a scheduler's SIGTERM after its warning, a second scancel, a Ctrl-C: the interpreter's
        shutdown puts back the default handlers of Python's own) in the last moments would turn that
        exit into a kill, which a launcher takes for a failure. The loop's closing save is inside the
        block, so past it nothing is left to lose."""
        if not self.handle_signals:
            yield
            return
        with processes.signal_handlers(STOP_SIGNALS, self._on_signal):
            if threading.current_thread() is threading.main_thread():  # elsewhere nothing was installed
                write_stop_handlers_ready()  # a launcher passes signals on from now (slurm.sbatch)
            yield
        if self.received:
            with contextlib.suppress(ValueError):  # not the main thread: nothing was installed either
                for sig in STOP_SIGNALS:
                    signal.signal(sig, signal.SIG_IGN)

    def _local_reason(self, step: int) -> int:
        if self.received:
            return _SIGNAL
        if self.duration_minutes is not None and (time.time() - self.started) / 60 >= self.duration_minutes:
            return _DURATION
        if self.interval and step % self.interval == 0:
            return _INTERVAL
        return _NONE

    def reason_to_stop(self, step: int, device: torch.device) -> str | None:
        """After ``step``: why every rank stops now (the same answer on every rank: a collective),
        or None to go on."""
        return self.agree(step, device).stop

    def agree(self, step: int, device: torch.device, *, timed_save_elapsed: bool = False) -> StepAgreement:
        """After ``step``, what every rank decides alike, in one collective (every rank, every
        step): whether to stop (:meth:`reason_to_stop`), and whether a wall-clock save is due
        (``timed_save_elapsed`` on any rank: ``recovery.TimedSaves``)."""
        # The reason, and which rank a stop signal reached, as one number: 2 * world - rank for a
        # SIGUSR1, world - rank for another signal, 0 for none. The maximum is then the lowest rank a
        # SIGUSR1 reached, else the lowest any signal reached: a launcher tells a warning (requeue)
        # from a plain SIGTERM (scancel: cancel) by it, whichever node it reached
        # (slurm_batch.stop_outcome), and a multi-node log says where the signal came.
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        usr1 = "SIGUSR1" in self.received
        reached = 2 * world - rank if usr1 else world - rank if self.received else 0
        code = torch.tensor([self._local_reason(step), reached, int(timed_save_elapsed)], dtype=torch.int32,
                            device=device)
        if world > 1:
            dist.all_reduce(code, op=dist.ReduceOp.MAX)
        code, reached, timed_save = (int(value) for value in code.tolist())
        return StepAgreement(stop=self._describe(code, reached, world=world, usr1=usr1),
                             timed_save=bool(timed_save))

    def _describe(self, code: int, reached: int, *, world: int, usr1: bool) -> str | None:
        """The stop line's reason for the all-reduced ``code`` and ``reached`` (:meth:`agree`)."""
        if code == _SIGNAL:
            warned = reached > world
            other = (2 * world if warned else world) - reached
            node = f" ({self.rank_nodes[other]})" if other < len(self.rank_nodes) else ""
            elsewhere = "" if (usr1 if warned else self.received) else f" on rank {other}{node}"
            if warned:
                return "signal SIGUSR1" + elsewhere
            return (f"signal {self.received[0]}" if self.received else "a signal") + elsewhere
        if code == _DURATION:
            return f"training.exit_duration_in_mins={self.duration_minutes:g} reached"
        if code == _INTERVAL:
            return f"training.exit_interval={self.interval}"
        return None
