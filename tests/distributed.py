"""Run a test body on several CPU ranks (spawned processes, gloo) and report their tracebacks."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.multiprocessing as mp


def _guarded(rank: int, worker: Callable, errors: str, rendezvous: str, args: tuple) -> None:
    try:
        worker(rank, rendezvous, *args)
    except BaseException:
        Path(errors, f"rank{rank}.txt").write_text(traceback.format_exc())
        raise


def run_ranks(worker: Callable, *args, world: int, tmp_path: Path) -> None:
    """Call ``worker(rank, rendezvous, *args)`` on ``world`` ranks; fail with every rank's traceback.

    ``rendezvous`` is a ``file://`` init method for ``torch.distributed``; ``worker`` must be a
    module-level function (it is pickled into the spawned processes).
    """
    errors = tmp_path / "rank_errors"
    errors.mkdir(exist_ok=True)
    rendezvous = f"file://{tmp_path}/rendezvous"
    try:
        mp.spawn(_guarded, args=(worker, str(errors), rendezvous, args), nprocs=world, join=True)
    except Exception:
        report = "\n".join(p.read_text() for p in sorted(errors.iterdir()))
        pytest.fail(f"{worker.__name__} failed on a rank:\n{report}")
