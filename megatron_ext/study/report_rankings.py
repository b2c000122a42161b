"""The study report's rankings: per task, the report's models ranked by paired tests.

The harness's ranking (``summary.json``'s ``rankings``) when one evaluation folder ranked exactly
the report's models on the task, otherwise ranked again with
:func:`~megatron_ext.eval.aggregation.rank_models` (paired tests on the test examples' scores at
each model's best LR) from the run files under each folder's ``runs/``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_ext.config_loading import UserError
from megatron_ext.eval.aggregation import TaskResult, aggregate, rank_models
from megatron_ext.eval.grid import ModelRef, RunRecord, RunSpec, TaskRef, run_path
from megatron_ext.eval.finetuning import FinetuneConfig
from megatron_ext.eval.ranking import RankedSystem
from megatron_ext.study.report_join import SUMMARY_FILE, EvaluatedModel


@dataclass(frozen=True, kw_only=True)
class TaskRanking:
    """The models of one task ranked (:func:`~megatron_ext.eval.ranking.rank_systems`), or why not."""

    task: str
    ranking: tuple[RankedSystem, ...] = ()
    source: str = ""
    """Where it comes from: a ``summary.json``, or ranked again from the run files."""
    skipped: str | None = None


class _RunsUnavailable(Exception):
    """The run files a ranking needs are missing or disagree with ``summary.json``."""


def _with_test_examples(result: TaskResult, eval_dir: Path) -> TaskResult:
    """``result`` again from its best LR's run files (read by the harness's :meth:`RunRecord.read`
    and :func:`aggregate`), which keep each test example's score."""
    records = []
    for seed in result.best_lr_scores.seeds:
        path = run_path(eval_dir, result.model, result.task, result.best_lr, seed)
        if not path.is_file():
            raise _RunsUnavailable(f"no run file {path}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            task_dir, model_dir, source, config = (data[key] for key in ("task_dir", "model_dir", "model_source",
                                                                          "config"))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise _RunsUnavailable(f"{path} is not a run file of the harness ({err!r})") from None
        model = ModelRef(name=result.model, hf_dir=Path(model_dir), source=source, base_model=result.base_model,
                         checkpoint_step=result.checkpoint_step, pretrain_tokens=result.pretrain_tokens)
        task = TaskRef(name=result.task, task_dir=Path(task_dir), family=result.family, metric=result.metric)
        try:
            records.append(RunRecord.read(RunSpec(model=model, task=task, config=FinetuneConfig(**config), path=path)))
        except (UserError, TypeError) as err:  # written with another FinetuneConfig than today's
            raise _RunsUnavailable(f"{path}: {err}") from None
    again = aggregate(records, [result.best_lr], records[0].spec.task)
    if abs(again.test_mean - result.test_mean) > 1e-9:
        raise _RunsUnavailable(f"the run files of {result.model} on {result.task} under {eval_dir / 'runs'} give test "
                               f"{again.test_mean:.4f} at LR {result.best_lr:g}, {SUMMARY_FILE} {result.test_mean:.4f}")
    return again


def task_rankings(models: Sequence[EvaluatedModel], tasks: Sequence[str],
                  summaries: Mapping[Path, Mapping[str, Any]], log: Callable[[str], None]) -> dict[str, TaskRanking]:
    """Per task, ``models`` ranked: the harness's ranking when one folder ranked exactly them,
    otherwise ranked again from the run files (module docstring)."""
    rankings = {}
    for task in tasks:
        on_task = [model for model in models if task in model.results]
        if len(on_task) < 2:
            rankings[task] = TaskRanking(task=task, skipped="fewer than two models evaluated on it")
            continue
        names = {model.name for model in on_task}
        folders = {model.eval_dirs[task] for model in on_task}
        if len(folders) == 1:
            folder = folders.pop()
            saved = (summaries[folder].get("rankings") or {}).get(task)
            if saved and {entry["system"] for entry in saved} == names:
                rankings[task] = TaskRanking(task=task, ranking=tuple(RankedSystem(**entry) for entry in saved),
                                             source=f"the harness's ranking in {folder / SUMMARY_FILE}")
                continue
        try:
            results = [_with_test_examples(model.results[task], model.eval_dirs[task]) for model in on_task]
        except _RunsUnavailable as why:
            rankings[task] = TaskRanking(task=task, skipped=f"ranking again needs the run files: {why}")
            continue
        unscored = [r.model for r in results if not r.test_examples]
        if len(results) - len(unscored) < 2:
            rankings[task] = TaskRanking(task=task, skipped="the runs saved no per-example test scores")
            continue
        try:
            ranked = rank_models(results)[1][task]
        except ValueError as err:  # rank_systems: too few shared examples, non-finite scores
            rankings[task] = TaskRanking(task=task, skipped=str(err))
            continue
        left_out = f"; without per-example scores: {', '.join(unscored)}" if unscored else ""
        rankings[task] = TaskRanking(task=task, ranking=tuple(ranked),
                                     source=f"ranked again from the run files (runs/ of each --eval-dir){left_out}")
        log(f"ranked {len(ranked)} models on {task} from their run files")
    return rankings


# ----------------------------------------------------------------------------- figures
