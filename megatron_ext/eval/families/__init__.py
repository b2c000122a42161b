"""Task families of the evaluation harness: ``run(model_dir, task_dir, config) -> RunResult``.

:data:`FAMILIES` maps the family of a task (``task.json``'s ``family``) to its fine-tuning run.
SC and TC share one run with a linear head (:mod:`.linear_head`) and differ only in its pieces.
QA and IR are imported when first run, so a suite of SC and TC tasks never loads their
dependencies.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_ext.eval.families import sc, tc
from megatron_ext.eval.protocol import FinetuneConfig, RunResult

FamilyRun = Callable[[str, Path, FinetuneConfig], RunResult]


def _lazy(module: str) -> FamilyRun:
    def run(model_dir: str, task_dir: Path, config: FinetuneConfig) -> RunResult:
        return importlib.import_module(f"{__name__}.{module}").run(model_dir, task_dir, config)

    run.__qualname__ = f"{module}.run"
    return run


FAMILIES: dict[str, FamilyRun] = {"sc": sc.run, "tc": tc.run, "qa": _lazy("qa"), "ir": _lazy("ir")}

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
