"""A hung rank ends the job in bounded time, named, and resumably (``training.hang_timeout_minutes``).

A rank that hangs (a stuck collective, a node that stops answering, a process stopped) leaves the
others waiting in their next collective until ``parallel.distributed_timeout_minutes`` runs out, and
then they end with a transport's traceback that names nobody. Here every rank:

- **beats**: after each step the training loop records the step it finished; a heartbeat file per
  rank (``heartbeats/rank-N.json`` in ``checkpoint.save``, else ``logging.log_dir``: a directory every
  node sees) carries it with the rank's node and the time, written atomically at most every few
  seconds, and again by the watch thread while the rank waits (a rank that waits is alive: its file
  stays fresh, so the file that grows old is the stuck rank's, whatever the order of the last writes);
- **watches**: a daemon thread checks that the rank finished a step within the timeout. When it has
  not, the rank is waiting on someone, or is the one stuck: the heartbeat files say which rank is
  behind (the fewest steps, then the oldest beat). The lowest rank that is not that one says so in
  one line and writes the resumable exit status; every rank that notices exits 75
  (``RESUMABLE_EXIT_CODE``) at once (the rank behind, when on the same node, is killed: a stopped
  process would hold torchrun's shutdown), so the launcher (the local launcher, SLURM's requeue in
  ``examples/launch/slurm.sbatch``) starts the job again from the newest complete checkpoint. A
  hung node then costs the timeout plus the steps since the last save.

The check runs in a thread because the main thread is blocked inside the collective; the
collectives release the interpreter while they wait.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from megatron_ext.exit_codes import RESUMABLE_EXIT_CODE
from megatron_ext.fileio import write_atomic

HEARTBEATS = "heartbeats"
"""The folder of the heartbeat files, in ``checkpoint.save`` (else ``logging.log_dir``)."""


def heartbeat_dir(save: str | None, log_dir: str) -> Path:
    """Where the ranks' heartbeats go: the save directory every node writes checkpoints to, else the
    log directory."""
    return Path(save or log_dir) / HEARTBEATS


def behind(beats: list[dict]) -> dict | None:
    """The heartbeat of the rank that is behind: the fewest steps finished, then the oldest beat."""
    return min(beats, key=lambda beat: (beat["step"], beat["time"])) if beats else None


def read_beats(directory: Path) -> list[dict]:
    """Every rank's last heartbeat in ``directory`` (unreadable or half-written files skipped)."""
    beats = []
    for path in sorted(directory.glob("rank-*.json")):
        try:
            beats.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return beats


class HangWatchdog:
    """This rank's heartbeat and its watch (module docstring).

    Args:
        timeout_s: Seconds without a finished step after which the job ends.
        directory: The heartbeat folder (:func:`heartbeat_dir`).
        rank: Global rank; ``node``: its host name.
        on_hang: Called once, from the watch thread, with the line that names the rank behind and
            whether this rank is the one to say it; the default writes the exit status (when this
            rank says it) and ends the process with ``RESUMABLE_EXIT_CODE``.
    """

    def __init__(self, *, timeout_s: float, directory: Path, rank: int, node: str | None = None,
                 on_hang: Callable[[str, bool], None] | None = None):
        self.timeout_s, self.directory, self.rank = timeout_s, directory, rank
        self.node = node or socket.gethostname()
        self.on_hang = on_hang or _exit_resumable
        self.write_every_s = min(5.0, timeout_s / 4)
        self.step, self.last = 0, time.monotonic()
        self.written = float("-inf")
        self.writing = threading.Lock()  # the main thread's beats and the watch thread's refreshes
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)

    def start(self, step: int) -> None:
        """Begin watching from ``step`` (the run's first): a first beat, then the thread."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.beat(step, force=True)
        self.thread.start()

    def beat(self, step: int, *, force: bool = False) -> None:
        """``step`` finished on this rank (the main thread, after each step)."""
        self.step, self.last = step, time.monotonic()
        if force or self.last - self.written >= self.write_every_s:
            self._write()

    def _write(self) -> None:
        """This rank's heartbeat file: the last step it finished, and now."""
        with self.writing:
            record = {"rank": self.rank, "node": self.node, "pid": os.getpid(), "step": self.step, "time": time.time()}
            write_atomic(self.directory / f"rank-{self.rank}.json", json.dumps(record))
            self.written = time.monotonic()

    def stop(self) -> None:
        """No more watching (the run ends or stops normally)."""
        self.stopped.set()

    def _watch(self) -> None:
        while not self.stopped.wait(min(1.0, self.timeout_s / 4)):
            now = time.monotonic()
            waited = now - self.last
            if waited < self.timeout_s:
                if now - self.written >= self.write_every_s:
                    self._write()  # waiting, alive: at the timeout every live rank's file is fresh
                continue
            self._write()  # this rank is alive: its file says so now
            line, says, late = self.describe(waited)
            if says and late["rank"] != self.rank and late.get("node") == self.node and late.get("pid"):
                # On this node the rank behind is ended too: a stopped process holds torchrun's
                # shutdown for its termination grace (30 s) otherwise; a remote one the launcher ends.
                with contextlib.suppress(OSError):
                    os.kill(late["pid"], signal.SIGKILL)
            self.on_hang(line, says)
            return

    def describe(self, waited: float) -> tuple[str, bool, dict]:
        """The line naming the rank behind, whether this rank is the one to print it (the lowest
        rank that is not behind; the rank behind itself where it is alone), and that rank's
        heartbeat."""
        beats = read_beats(self.directory)
        late = behind(beats) or {"rank": self.rank, "node": self.node, "step": self.step, "time": time.time()}
        others = [beat for beat in beats if beat["rank"] != late["rank"]]
        reporter = min((beat["rank"] for beat in others), default=late["rank"])
        ahead = max((beat["step"] for beat in others), default=late["step"])
        # A heartbeat is written every few seconds: the rank behind may have finished some steps after
        # the one its last heartbeat names, so the line says what the file says.
        line = (f"hang: rank {late['rank']} on {late['node']} last reported step {late['step']} "
                f"({time.time() - late['time']:.0f} s since its last heartbeat"
                + (f"; the other ranks are at step {ahead}" if others else "")
                + f"); rank {self.rank} waited {waited:.0f} s (training.hang_timeout_minutes="
                f"{self.timeout_s / 60:g}); stopping resumably (exit code {RESUMABLE_EXIT_CODE}): the job "
                "restarts from the newest complete checkpoint")
        return line, reporter == self.rank, late


def _exit_resumable(line: str, says: bool) -> None:
    """End this process with the resumable exit code, having said ``line`` and written the exit
    status where this rank is the one to say it."""
    from megatron_ext.exit_codes import EXIT_STATUS_ENV

    if says:
        os.write(2, f"{line}\n".encode())
        if path := os.environ.get(EXIT_STATUS_ENV):  # whatever this rank's number: rank 0 may be the one hung
            write_atomic(path, f"{RESUMABLE_EXIT_CODE} {line}\n")
    os._exit(RESUMABLE_EXIT_CODE)
