"""One trainer per save directory: the lock a run holds on ``checkpoint.save`` while it trains.

Two trainers started on one save directory would interleave their saves (one's ``.tmp-`` folder
removed as a leftover by the other's save, or both publishing into one ``iter_NNNNNNN``). So a run
takes this lock before it writes anything there, and a second run is refused before it builds its
model, with one line naming the owner (host, pid, since when) and what to do (exit code 2).

The lock is an evaluation claim (``megatron_ext/claims.py``) on ``<save>/trainer.lock``: files
``trainer.lock.claim-<generation>`` created whole and exclusively (a private file hard-linked to
its name: atomic on NFS, no ``flock``), refreshed by a heartbeat thread every 30 s. A dead owner's
lock is taken over at once on its own host (its pid is gone) and after
:data:`TRAINER_LOCK_POLICY`'s timeout (5 minutes) elsewhere; a SLURM requeue of the owner's job
(same ``SLURM_JOB_ID``, higher ``SLURM_RESTART_COUNT``) takes it over at once. Global rank 0
takes it for the whole run and broadcasts the outcome, so every rank stops on a refusal. Before
each save rank 0 checks the lock is still its own (a run paused past the timeout may have lost
it to another host's trainer): every rank then stops without writing.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import torch.distributed as dist

from megatron_ext.config_loading import UserError
from megatron_ext.claims import Claim, ClaimPolicy, Holder, Owner, claim_files, try_claim

LOCK_NAME = "trainer.lock"
"""The lock's base name in the save directory (its files: ``trainer.lock.claim-<generation>``)."""

TRAINER_LOCK_POLICY = ClaimPolicy(requeue_takes_over=True)
"""Heartbeat every 30 s; another host takes a lock over once its heartbeat is 5 minutes old."""


class SaveDirectoryInUse(UserError):
    """Another live trainer holds the save directory's lock."""


class SaveDirectoryLockLost(UserError):
    """This run's lock was taken over (its heartbeat lapsed past the timeout): it must not save."""


def _since(holder: Holder, base: Path) -> str:
    """When the holder took the lock (UTC), from its claim file; "unknown" if unreadable."""
    try:
        record = json.loads(claim_files(base)[holder.generation].read_text(encoding="utf-8"))
        taken = datetime.datetime.fromtimestamp(float(record["claimed_at"]), datetime.timezone.utc)
        return taken.strftime("%Y-%m-%d %H:%M:%S UTC")
    except (KeyError, OSError, ValueError, TypeError):
        return "an unknown time"


def refusal(save_dir: Path, holder: Holder, policy: ClaimPolicy = TRAINER_LOCK_POLICY) -> str:
    """The one-line refusal for a trainer that finds ``holder`` owning ``save_dir``."""
    base = save_dir / LOCK_NAME
    owner = holder.owner
    who = (f"host {owner.host}, pid {owner.pid}" + (f" (SLURM job {owner.slurm_job})" if owner.slurm_job else "")
           if owner is not None else "an unreadable lock")
    return (f"checkpoint.save={str(save_dir)!r} is in use by another trainer: {who}, since {_since(holder, base)}, "
            f"heartbeat {holder.age_s:.0f} s ago (lock {base}.claim-{holder.generation}). Wait for that run to end "
            f"or stop it, or give this run another --save; a lock whose trainer died is taken over at once on its "
            f"host and after {policy.timeout_s:.0f} s without heartbeat elsewhere")


class SaveDirectoryLock:
    """The lock of one run on its save directory, on every rank (held by rank 0's :class:`Claim`)."""

    def __init__(self, save_dir: Path, claim: Claim | None, *, created: tuple[Path, ...] = ()):
        self.save_dir = save_dir
        self._claim = claim
        self._created = created
        """The directories taking the lock created (deepest first): removed on release while empty,
        so that a run refused before it saved leaves nothing behind."""

    @classmethod
    def acquire(cls, save_dir: str | os.PathLike, *, policy: ClaimPolicy = TRAINER_LOCK_POLICY) -> SaveDirectoryLock:
        """Take the lock (a collective where torch.distributed is initialised: rank 0 takes it,
        every rank learns the outcome). Raises :class:`SaveDirectoryInUse` on every rank when a
        live trainer holds it."""
        save_dir = Path(save_dir).absolute()
        rank = dist.get_rank() if dist.is_initialized() else 0
        claim, outcome = None, [None]
        created = tuple(path for path in (save_dir, *save_dir.parents) if not path.exists())
        if rank == 0:
            found = try_claim(save_dir / LOCK_NAME, owner=Owner.this_process(), policy=policy)
            if isinstance(found, Holder):
                outcome[0] = refusal(save_dir, found, policy)
            else:
                claim = found
                if found.taken_from is not None:
                    outcome[0] = ""  # taken over: said below
                    print(f"took over the lock of {save_dir} from {found.taken_from.describe()} "
                          f"(its trainer is gone)", flush=True)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(outcome, src=0)
        if outcome[0]:
            raise SaveDirectoryInUse(outcome[0])
        return cls(save_dir, claim, created=created if claim is not None else ())

    def check_held(self, before: str) -> None:
        """Raise :class:`SaveDirectoryLockLost` on every rank unless rank 0 still holds the lock (a
        collective); ``before``: what the run was about to do, for the message."""
        lost = [None]
        if self._claim is not None and not self._claim.held():
            newest = max(claim_files(self._claim.base), default=None)
            lost[0] = (f"another trainer took over the lock of checkpoint.save={str(self.save_dir)!r} "
                       f"({self._claim.base}.claim-{newest}) after this run's heartbeat lapsed: stopping "
                       f"before {before}; check which run should train there")
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(lost, src=0)
        if lost[0]:
            raise SaveDirectoryLockLost(lost[0])

    def release(self) -> None:
        """Remove the lock (rank 0; nothing where another trainer took it over). Idempotent."""
        claim, self._claim = self._claim, None
        if claim is None:
            return
        if claim.held():
            claim.finish()  # deletes every generation: the directory is free
        else:
            claim.release()  # only stops the heartbeat of a claim another trainer holds now
        for directory in self._created:
            try:
                directory.rmdir()
            except OSError:  # not empty (the run saved, or another process wrote there): kept
                break

    def __enter__(self) -> SaveDirectoryLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
