"""Task families of the evaluation harness: ``run(model_dir, task_dir, config) -> RunResult``.

:data:`FAMILIES` maps the family of a task (``task.json``'s ``family``) to its fine-tuning run.
SC and TC share one run with a linear head (:mod:`.linear_head`) and differ only in its pieces.
QA, IR and STS are imported when first run, so a suite of SC and TC tasks never loads their
dependencies. STS (:mod:`.sts`) fine-tunes nothing: it is in :data:`ZERO_SHOT_FAMILIES`, whose
tasks :func:`grid` gives one run instead of the LR x seed grid.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from megatron_ext.eval.families import sc, tc
from megatron_ext.eval.protocol import FinetuneConfig, RunResult
from megatron_ext.eval.task_io import SPLITS

FamilyRun = Callable[[str, Path, FinetuneConfig], RunResult]


def _lazy(module: str) -> FamilyRun:
    def run(model_dir: str, task_dir: Path, config: FinetuneConfig) -> RunResult:
        return importlib.import_module(f"{__name__}.{module}").run(model_dir, task_dir, config)

    run.__qualname__ = f"{module}.run"
    return run


FAMILIES: dict[str, FamilyRun] = {"sc": sc.run, "tc": tc.run, "qa": _lazy("qa"), "ir": _lazy("ir"),
                                  "sts": _lazy("sts")}

PAPER_FAMILIES = ("sc", "tc", "qa", "ir")
"""The paper's families; reports show any other (STS) apart, as an extra not in the paper's average."""
ZERO_SHOT_FAMILIES = frozenset({"sts"})
"""Families whose run trains nothing: an LR or a seed would change nothing, so each (model, task)
is one run, at :data:`ZERO_SHOT_LR` and :data:`ZERO_SHOT_SEED` (:func:`grid`)."""
ZERO_SHOT_LR = 0.0
"""The LR of a zero-shot run: nothing is trained (``lr0_seed0.json`` under ``runs/``)."""
ZERO_SHOT_SEED = 0


def grid(family: str, lrs: Sequence[float], seeds: Sequence[int]) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """The (LRs, seeds) a task of ``family`` runs at: the grid's for a family that fine-tunes, one
    run at :data:`ZERO_SHOT_LR` and :data:`ZERO_SHOT_SEED` for a zero-shot one."""
    if family in ZERO_SHOT_FAMILIES:
        return (ZERO_SHOT_LR,), (ZERO_SHOT_SEED,)
    return tuple(lrs), tuple(seeds)


def splits_read(family: str, task_dir: Path) -> tuple[str, ...]:
    """The splits a run of ``family`` reads from ``task_dir`` (the harness loads them all before any
    run, so a schema error stops the grid before it starts)."""
    if family == "sts":
        return importlib.import_module(f"{__name__}.sts").splits_present(task_dir)
    return SPLITS + (("corpus",) if family == "ir" else ())

def shared_training_key(family: str, task_dir: Path) -> str | None:
    """Tasks of a family that trains one model for several evaluations (retrieval: the paper trains
    on MS MARCO pairs once and evaluates MS MARCO, NQ and MLDR) share a run when their keys are
    equal; None for the families that train per task."""
    if family != "ir":
        return None
    return importlib.import_module(f"{__name__}.ir").training_key(task_dir)


def run_shared(family: str, model_dir: str, task_dirs: list[Path], config: FinetuneConfig) -> list[RunResult]:
    """One training run scored on each of ``task_dirs`` (equal :func:`shared_training_key`)."""
    return importlib.import_module(f"{__name__}.{family}").run_shared(task_dirs, model_dir, config)


FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {"tc": {"epochs": 1.0}}
"""FinetuneConfig values a family uses unless the caller sets the length of the run (the paper
trains token classification for one epoch, everything else for ``max_steps``)."""
