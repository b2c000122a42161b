"""Claims: which of N workers sharing one output directory does a piece of work (a fine-tuning
unit of the grid, a model's export), so that each is done once, and a dead worker's is done again;
and which trainer writes a save directory (``checkpoint/lock.py``, one claim per run).

A claim on ``BASE`` is a file ``BASE.claim-<generation>`` holding its owner (host, pid, the
process's start time, its pid namespace). It is created whole and atomically: written under a
private name, then hard-linked to its final name, which fails if the name exists, so of two
workers creating the same generation exactly one wins (``os.link`` is atomic on local file
systems and on NFS). The owner refreshes the file's mtime every :attr:`ClaimPolicy.heartbeat_s`
while it works (a thread). The claim of the highest generation is the live one. It has expired
when its heartbeat is older than :attr:`ClaimPolicy.timeout_s`, or at once when its owner is a
process of this host (same pid namespace) that no longer exists; then the next taker creates
generation + 1, and again exactly one wins. A file name is never reused while its work is
unfinished, so a taker can only win against the claim it saw: no two workers hold one unit.

An owner that gives its claim back unfinished (an error, Ctrl-C) sets its mtime to 0, so it has
expired at once; one that finished (its outputs are written) deletes every generation. A worker
that was only paused past the timeout (a hung node) finds a higher generation at its next
heartbeat or before it writes: it has lost the claim and discards its work (:meth:`Claim.held`).

Heartbeat ages compare file mtimes (set by the file server on NFS) with this host's clock: the
hosts' clocks must agree to well within the timeout (NTP does).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from megatron_ext.config_loading import UserError

DEFAULT_TIMEOUT_S = 300.0
"""A claim whose heartbeat is older than this has expired (5 minutes; heartbeats every 30 s)."""
HEARTBEATS_PER_TIMEOUT = 10
"""Heartbeats within one timeout: a claim expires only after this many missed in a row."""


@dataclass(frozen=True, kw_only=True)
class ClaimPolicy:
    """When a claim has expired, and how often its owner shows it is alive."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    """A claim whose heartbeat is older than this is taken over (``--claim-timeout``). It must
    exceed the longest pause of a live worker (a stalled file system), or two may run one unit."""

    requeue_takes_over: bool = False
    """A SLURM requeue of the owner's job (same ``SLURM_JOB_ID``, higher ``SLURM_RESTART_COUNT``)
    takes the claim over at once: the requeued job is the same work, and SLURM ended the old
    allocation's processes first. Off for evaluation workers, which share one job's id."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise UserError(f"--claim-timeout must be > 0 seconds, got {self.timeout_s}")

    @property
    def heartbeat_s(self) -> float:
        """Seconds between two refreshes of a held claim's mtime."""
        return self.timeout_s / HEARTBEATS_PER_TIMEOUT


def _pid_namespace() -> int | None:
    """The inode of this process's pid namespace (Linux); two containers on one host with the
    same host name see different pids, so a pid is only judged within its namespace."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


@dataclass(frozen=True, kw_only=True)
class Owner:
    """The process holding a claim."""

    host: str
    pid: int
    started: float
    """The process's start time (seconds since the epoch): a pid reused by a later process is not it."""
    pid_namespace: int | None
    """:func:`_pid_namespace` of the owner; None where unknown (then only the heartbeat tells)."""
    slurm_job: str | None = None
    """``$SLURM_JOB_ID`` of the owner; None outside SLURM (and in claims written before it was recorded)."""
    slurm_restart: int = 0
    """``$SLURM_RESTART_COUNT`` of the owner (how often SLURM requeued its job; unset: 0)."""

    @classmethod
    def this_process(cls) -> Owner:
        return cls(host=socket.gethostname(), pid=os.getpid(), started=psutil.Process().create_time(),
                   pid_namespace=_pid_namespace(), slurm_job=os.environ.get("SLURM_JOB_ID") or None,
                   slurm_restart=int(os.environ.get("SLURM_RESTART_COUNT") or 0))

    def requeued_as(self, observer: Owner) -> bool:
        """True when ``observer`` runs in a later requeue of this owner's SLURM job."""
        return (self.slurm_job is not None and self.slurm_job == observer.slurm_job
                and observer.slurm_restart > self.slurm_restart)

    @property
    def label(self) -> str:
        """``host:pid``, as logs and run records name a worker."""
        return f"{self.host}:{self.pid}"

    def known_dead(self, observer: Owner) -> bool:
        """True when ``observer`` can see that this owner no longer runs: a process of its own host
        and pid namespace that is gone, a zombie, or another process under the same pid."""
        if self.pid_namespace is None or (self.host, self.pid_namespace) != (observer.host, observer.pid_namespace):
            return False
        try:
            process = psutil.Process(self.pid)
            return process.status() == psutil.STATUS_ZOMBIE or abs(process.create_time() - self.started) > 1.0
        except psutil.NoSuchProcess:
            return True


@dataclass(frozen=True, kw_only=True)
class Holder:
    """Another worker's claim, as seen when claiming failed."""

    owner: Owner | None
    """None: the claim file could not be parsed (only its age tells)."""
    age_s: float
    """Seconds since its last heartbeat."""
    generation: int

    def expired(self, policy: ClaimPolicy, observer: Owner) -> bool:
        return self.age_s > policy.timeout_s or (self.owner is not None and (
            self.owner.known_dead(observer) or (policy.requeue_takes_over and self.owner.requeued_as(observer))))

    def describe(self) -> str:
        who = self.owner.label if self.owner is not None else "an unreadable claim"
        return f"{who}, heartbeat {self.age_s:.0f} s ago"


def _claim_path(base: Path, generation: int) -> Path:
    return base.with_name(f"{base.name}.claim-{generation}")


def claim_files(base: Path) -> dict[int, Path]:
    """The claim files of ``base`` by generation, lowest first."""
    pattern = re.compile(re.escape(base.name) + r"\.claim-(\d+)$")
    found = {}
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(base.parent):
            if match := pattern.match(entry.name):
                found[int(match[1])] = Path(entry.path)
    return dict(sorted(found.items()))


def _read_holder(path: Path, generation: int) -> Holder:
    """The holder of the claim file ``path`` (FileNotFoundError when it is gone)."""
    age = time.time() - path.stat().st_mtime
    try:
        owner = Owner(**json.loads(path.read_text(encoding="utf-8"))["owner"])
    except (ValueError, KeyError, TypeError):
        owner = None
    return Holder(owner=owner, age_s=age, generation=generation)


def _create(path: Path, content: str) -> bool:
    """Create ``path`` holding ``content`` unless it exists; True when this call created it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    private = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}")
    private.write_text(content, encoding="utf-8")
    try:
        os.link(private, path)
        return True
    except FileExistsError:
        return False
    finally:
        private.unlink()


class Claim:
    """A claim this process holds: its heartbeat runs until :meth:`release` or :meth:`finish`;
    leaving a ``with`` block without finishing releases it."""

    def __init__(self, base: Path, generation: int, *, owner: Owner, policy: ClaimPolicy,
                 taken_from: Holder | None):
        self.base = base
        self.generation = generation
        self.path = _claim_path(base, generation)
        self.owner = owner
        self.taken_from = taken_from
        """The expired claim this one took over; None for a fresh claim."""
        self._lost = False
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, args=(policy.heartbeat_s,),
                                           name=f"claim heartbeat {self.path.name}", daemon=True)
        self._heartbeat.start()

    def _beat(self, interval: float) -> None:
        while not self._stop.wait(interval):
            if not self.held():
                return
            try:
                os.utime(self.path)
            except FileNotFoundError:  # deleted by a worker that found the work done
                self._lost = True
                return

    def held(self) -> bool:
        """Whether no other worker has taken this claim over (after a heartbeat lapse): checked now."""
        if not self._lost and (not self.path.exists()  # a taker finished and deleted every generation
                               or any(generation > self.generation for generation in claim_files(self.base))):
            self._lost = True
        return not self._lost

    def _stop_heartbeat(self) -> None:
        self._stop.set()
        self._heartbeat.join()

    def release(self) -> None:
        """Give the claim back unfinished: it has expired at once for every other worker."""
        self._stop_heartbeat()
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.path, (0, 0))

    def finish(self) -> None:
        """The work is done (its outputs exist): remove every claim file of it."""
        self._stop_heartbeat()
        for path in claim_files(self.base).values():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc) -> None:
        if not self._stop.is_set():
            self.release()


def try_claim(base: Path, *, owner: Owner, policy: ClaimPolicy) -> Claim | Holder:
    """Claim ``base`` for ``owner``: a :class:`Claim` when it was free or its claim had expired
    (taken over), else the live :class:`Holder`. The caller checks the work is still undone once
    it holds the claim (another worker may have finished it and deleted its claim meanwhile).

    The directory is listed once to find the newest generation; after that each generation is
    opened by name, so a listing a network file system caches a few seconds cannot keep a worker
    judging a generation that was already replaced."""
    record = json.dumps({"owner": asdict(owner), "claimed_at": time.time()}, indent=2) + "\n"
    newest = max(claim_files(base), default=None)
    while True:
        expired = None
        if newest is not None:
            try:
                holder = _read_holder(_claim_path(base, newest), newest)
            except FileNotFoundError:  # the work was finished and its claims deleted: look again
                time.sleep(0.05)
                newest = max(claim_files(base), default=None)
                continue
            if not holder.expired(policy, owner):
                return holder
            expired = holder
        generation = 0 if newest is None else newest + 1
        if _create(_claim_path(base, generation), record):
            return Claim(base, generation, owner=owner, policy=policy, taken_from=expired)
        newest = generation  # another worker created it first: judge that one
