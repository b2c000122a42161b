"""A trainer's child processes: none outlives it.

A trainer starts helper processes: Megatron's asynchronous checkpoint writers (a process forked
per save on CPU, one persistent spawned worker per rank on GPU), the manager process behind their
results queue, DataLoader workers, the W&B service. When the trainer ends normally it closes them
(``checkpoint.writer.CheckpointSaver.close``). When it is killed (``kill -9``, the OOM killer, a node
agent) nothing in it runs any more, so two mechanisms keep its children from living on:

1. They die with it (Linux): while :func:`trainer_session` is active, every process the trainer
   forks from its main thread, and the checkpoint results-queue manager it starts
   (``die_with_parent`` as the manager's initializer), asks the kernel for SIGKILL when its parent
   dies (``prctl(PR_SET_PDEATHSIG)``). The spawned ones ignore the stop signals a scheduler
   sends to every process of a job (:func:`helpers_ignore_stop_signals`): they must outlive the
   trainer's last save, not die before it.
2. The next run ends the rest: every child started with ``exec`` (spawned, subprocesses) carries
   ``TRAINER_ENV`` = ``<pid>:<start time>`` of its trainer in its environment (forked children
   without ``exec`` do not show it in ``/proc``: (1) covers them). :func:`end_orphans`, called as
   a run starts, ends the processes of this user whose tag names a trainer that is no longer
   running, with one warning line each. This catches what (1) cannot reach: spawned processes
   started inside Megatron-Core (the persistent GPU checkpoint writer).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator

import psutil

logger = logging.getLogger(__name__)

TRAINER_ENV = "MEGATRON_EXT_TRAINER"
"""Environment variable naming the trainer (``<pid>:<start time>``) a process was started by."""

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_forks_die_with_trainer = False
_forking_pid: int | None = None


# Looked up once, here: the at-fork hook must not dlopen in every forked child.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when ``parent_pid`` (its parent) dies; exits at
    once if the parent is already gone. No-op off Linux."""
    if _prctl is None:
        return
    if _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # the next run's end_orphans is the fallback for spawned children
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)



IGNORED_BY_HELPERS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
"""Signals a trainer's helper processes ignore for life. A scheduler signals every process of a
job step (SLURM: SIGTERM at a time limit, the ``--signal`` warning) and a terminal its whole
foreground group (Ctrl-C); the trainer answers by saving, which needs its helpers alive (the
checkpoint writers, their results queue). They end when the trainer closes them or dies."""


@contextlib.contextmanager
def signal_handlers(signals: tuple[int, ...], handler) -> Iterator[None]:
    """``handler`` (a function or ``signal.SIG_IGN``) for ``signals`` inside the block, the previous
    handlers after it. Main thread only, as Python requires (elsewhere: no change)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def helpers_ignore_stop_signals() -> contextlib.AbstractContextManager:
    """Processes spawned in the block ignore ``IGNORED_BY_HELPERS`` for life: an ignored
    disposition survives ``exec``, a Python handler does not. The trainer's own handlers are
    restored after the block."""
    return signal_handlers(IGNORED_BY_HELPERS, signal.SIG_IGN)


def _before_fork() -> None:
    global _forking_pid
    # PR_SET_PDEATHSIG fires when the forking *thread* exits: only forks from the main thread.
    _forking_pid = os.getpid() if threading.current_thread() is threading.main_thread() else None


def _after_fork_in_child() -> None:
    if _forks_die_with_trainer and _forking_pid is not None:
        die_with_parent(_forking_pid)


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def _tag(process: psutil.Process) -> str:
    return f"{process.pid}:{process.create_time():.2f}"


@contextlib.contextmanager
def trainer_session() -> Iterator[None]:
    """Mark this process as a trainer while the block runs: children it starts are tagged with it
    (``TRAINER_ENV``) and forked ones die with it. Restored on exit; sessions nest."""
    global _forks_die_with_trainer
    previous_env, previous_forks = os.environ.get(TRAINER_ENV), _forks_die_with_trainer
    os.environ[TRAINER_ENV] = _tag(psutil.Process())
    _forks_die_with_trainer = True
    try:
        yield
    finally:
        _forks_die_with_trainer = previous_forks
        if previous_env is None:
            os.environ.pop(TRAINER_ENV, None)
        else:
            os.environ[TRAINER_ENV] = previous_env


def _trainer_alive(tag: str) -> bool:
    pid = tag.partition(":")[0]
    try:
        return _tag(psutil.Process(int(pid))) == tag
    except (psutil.NoSuchProcess, ValueError):
        return False


def orphans() -> list[psutil.Process]:
    """Processes of this user whose trainer (``TRAINER_ENV``) is no longer running."""
    me = psutil.Process()
    exempt = {me.pid, *(p.pid for p in me.parents())}
    user = me.uids().real
    found = []
    for process in psutil.process_iter():
        if process.pid in exempt:
            continue
        try:
            if process.uids().real != user:
                continue
            tag = process.environ().get(TRAINER_ENV)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if tag and not _trainer_alive(tag):
            found.append(process)
    return found


def end_orphans() -> list[int]:
    """End (SIGKILL) the processes a killed trainer left behind, one warning each; returns their
    pids. Safe to call from every rank at once."""
    ended: list[psutil.Process] = []
    for process in orphans():
        try:
            command = " ".join(process.cmdline())[:160]
            trainer = process.environ().get(TRAINER_ENV, "?").partition(":")[0]
            process.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        logger.warning("ended process %d (%s), left behind by trainer %s, which is no longer running",
                       process.pid, command, trainer)
        ended.append(process)
    psutil.wait_procs(ended, timeout=5)
    return [process.pid for process in ended]


def node_name() -> str:
    """The machine this process runs on, as the scheduler names it (SLURM's node name), else its
    short host name: what a multi-node job's log and status files say."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
