"""Aggregation of the grid's runs, as the paper does: per (model, task) a :class:`TaskResult`, and rankings.

Per LR, the mean over seeds; the best LR maximises the mean validation score; the test score at
that LR is reported as mean ± :data:`CONFIDENCE` half-width over seeds (Student t,
:func:`mean_ci`). Stability is the seed spread at the best LR and the whole score-vs-LR curve. A
diverged run counts as :data:`~megatron_ext.eval.grid.DIVERGED_SCORE` for validation and test, so
an LR that blows up drags its mean down instead of vanishing from the curve. A zero-shot task's
one run is reported as it is.

With several models, each task also ranks them as the paper does (:func:`rank_models`): on the
test examples' own scores, averaged over the best LR's seeds, with paired tests between models
(:mod:`.ranking`); models that no test separates share a rank.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_ext.eval.families import FAMILIES
from megatron_ext.eval.grid import DIVERGED_SCORE, RunRecord, TaskRef
from megatron_ext.eval.ranking import RankedSystem, rank_systems

CONFIDENCE = 0.95
"""Level of the confidence interval over seeds."""


@dataclass(frozen=True, kw_only=True)
class LRPoint:
    """One LR of a :class:`TaskResult`'s score-vs-LR curve: its runs over the seeds."""

    lr: float
    validation_mean: float
    validation_std: float | None
    """Sample standard deviation over seeds; None with one seed."""
    test_mean: float
    test_std: float | None
    test_ci95: float | None
    """Half-width of the :data:`CONFIDENCE` interval of the test mean (Student t); None with one seed."""
    diverged: int
    """Seeds whose run diverged (scored :data:`DIVERGED_SCORE`)."""
    seeds: int


@dataclass(frozen=True, kw_only=True)
class BestLRScores:
    """Each seed's scores at the best LR, by seed."""

    seeds: tuple[int, ...]
    validation: tuple[float, ...]
    test: tuple[float, ...]


@dataclass(frozen=True, kw_only=True)
class TaskResult:
    """One model on one task over the LR x seed grid (:func:`aggregate`); :meth:`to_json` is its
    entry in ``summary.json``'s ``results``."""

    model: str
    base_model: str
    checkpoint_step: int | None
    pretrain_tokens: int | None
    """:class:`~megatron_ext.eval.grid.ModelRef`'s, for the score against pretraining tokens."""
    task: str
    family: str
    metric: str
    best_lr: float
    """The LR with the best mean validation score (ties: the first of the grid)."""
    test_mean: float
    """Mean test score over the seeds at the best LR."""
    test_ci95: float | None
    test_std: float | None
    validation_mean: float
    validation_std: float | None
    seeds: int
    """Runs at the best LR."""
    diverged_runs: int
    """Over the whole grid."""
    runs: int
    """Runs aggregated (fewer than the grid's in a summary written before all exist)."""
    best_lr_scores: BestLRScores
    lr_curve: tuple[LRPoint, ...]
    test_examples: Mapping[str, float]
    """Each test example's score at the best LR, mean over its seeds (:func:`rank_models` ranks on
    them); not in ``summary.json`` (the runs' files hold them)."""
    rank: int | None = None
    """Rank among the models of the task (:func:`rank_models`); None when not ranked."""

    def to_json(self) -> dict[str, Any]:
        result = dataclasses.asdict(self)
        del result["test_examples"]
        if self.rank is None:
            del result["rank"]
        return result

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> TaskResult:
        """A ``summary.json`` row (:meth:`to_json`) again, without per-example scores; a row of an
        older harness without ``base_model``/``checkpoint_step``/``pretrain_tokens`` gets them from
        :func:`checkpoint_of`. Keys that are no field (a newer harness's) are left out."""
        base, step = checkpoint_of(row)
        scores = row["best_lr_scores"]
        nested = {"best_lr_scores": BestLRScores(**{key: tuple(values) for key, values in scores.items()}),
                  "lr_curve": tuple(LRPoint(**point) for point in row["lr_curve"]), "test_examples": {}}
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {"base_model": base, "checkpoint_step": step, "pretrain_tokens": None, **row, **nested}
        return cls(**{key: value for key, value in values.items() if key in fields})


def checkpoint_of(row: Mapping[str, Any]) -> tuple[str, int | None]:
    """``(base model, checkpoint step)`` of a ``summary.json`` row: its own keys, or parsed from ``NAME@STEP``."""
    if "base_model" in row:
        return row["base_model"], row.get("checkpoint_step")
    name, at, step = row["model"].rpartition("@")
    return (name, int(step)) if at and step.isdigit() else (row["model"], None)


def mean_ci(scores: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float | None, float | None]:
    """Mean, sample standard deviation and Student-t confidence half-width (None below two scores)."""
    from scipy import stats

    mean = statistics.fmean(scores)
    if len(scores) < 2:
        return mean, None, None
    std = statistics.stdev(scores)
    return mean, std, float(stats.t.ppf((1 + confidence) / 2, len(scores) - 1)) * std / math.sqrt(len(scores))


def aggregate(records: Sequence[RunRecord], lrs: Sequence[float], task: TaskRef) -> TaskResult:
    """Summary of one (model, task) from its runs over ``lrs`` x seeds (an LR without any run yet,
    in a summary written before the grid is complete, is left out of the curve)."""
    curve = []
    for lr in lrs:
        runs = [r for r in records if r.spec.lr == lr]
        if not runs:
            continue
        val_mean, val_std, _ = mean_ci([r.validation for r in runs])
        test_mean, test_std, test_ci = mean_ci([r.test for r in runs])
        curve.append(LRPoint(lr=lr, validation_mean=val_mean, validation_std=val_std, test_mean=test_mean,
                             test_std=test_std, test_ci95=test_ci,
                             diverged=sum(r.status == "diverged" for r in runs), seeds=len(runs)))
    best = max(curve, key=lambda point: point.validation_mean)  # ties: the first LR of the grid
    best_runs = sorted((r for r in records if r.spec.lr == best.lr), key=lambda r: r.spec.seed)
    metrics = {r.metric for r in records if r.metric}
    model = records[0].spec.model
    return TaskResult(
        model=model.name, base_model=model.base_model, checkpoint_step=model.checkpoint_step,
        pretrain_tokens=model.pretrain_tokens, task=task.name, family=task.family,
        metric=metrics.pop() if len(metrics) == 1 else task.metric,
        best_lr=best.lr, test_mean=best.test_mean, test_ci95=best.test_ci95, test_std=best.test_std,
        validation_mean=best.validation_mean, validation_std=best.validation_std, seeds=best.seeds,
        diverged_runs=sum(point.diverged for point in curve), runs=len(records),
        best_lr_scores=BestLRScores(seeds=tuple(r.spec.seed for r in best_runs),
                                    validation=tuple(r.validation for r in best_runs),
                                    test=tuple(r.test for r in best_runs)),
        lr_curve=tuple(curve),
        test_examples=_mean_examples(best_runs, "test"),
    )


def _mean_examples(runs: Sequence[RunRecord], split: str) -> dict[str, float]:
    """Each example's score averaged over ``runs`` (a diverged run scores every example
    :data:`DIVERGED_SCORE`, as it scores the split); empty when no run saved per-example scores."""
    saved = [r.per_example[split] for r in runs if r.status == "ok" and r.per_example]
    if not saved:
        return {}
    ids = list(dict.fromkeys(example for scores in saved for example in scores))
    diverged = sum(r.status == "diverged" for r in runs)
    return {example: (sum(scores.get(example, DIVERGED_SCORE) for scores in saved) + diverged * DIVERGED_SCORE)
            / (len(saved) + diverged) for example in ids}


def rank_models(results: Sequence[TaskResult]) -> tuple[list[TaskResult], dict[str, list[RankedSystem]]]:
    """Per task with two models or more: the models ranked on their test examples' scores at the
    best LR (:func:`~megatron_ext.eval.ranking.rank_systems`). Returns ``results`` with the ranked
    ones' ``rank`` set, and the rankings by task."""
    rankings = {}
    for task in dict.fromkeys(r.task for r in results):
        rows = [r for r in results if r.task == task and r.test_examples]
        if len(rows) >= 2:
            rankings[task] = rank_systems({r.model: r.test_examples for r in rows})
    rank_of = {(task, ranked.system): ranked.rank for task, ranked_systems in rankings.items()
               for ranked in ranked_systems}
    ranked = [dataclasses.replace(r, rank=rank_of[r.task, r.model]) if (r.task, r.model) in rank_of else r
              for r in results]
    return ranked, rankings


def aggregate_grid(records: Sequence[RunRecord], lrs: Sequence[float],
                   seeds: Sequence[int]) -> tuple[list[TaskResult], dict[str, list[RankedSystem]]]:
    """The grid's results: :func:`aggregate` per (model, task), in the order ``records`` first have
    them (the grid's: models, then tasks), each over its family's LRs
    (:meth:`~megatron_ext.eval.family.Family.grid`), then :func:`rank_models`."""
    runs: dict[tuple[str, str], list[RunRecord]] = {}
    for record in records:
        runs.setdefault((record.spec.model.name, record.spec.task.name), []).append(record)
    results = [aggregate(found, FAMILIES[found[0].spec.task.family].grid(lrs, seeds)[0], found[0].spec.task)
               for found in runs.values()]
    return rank_models(results)


def checkpoint_series(results: Sequence[TaskResult]) -> dict[str, list[TaskResult]]:
    """Base model -> the results of its checkpoints (by step), for every base model that is a
    Megatron save directory; empty unless one of them has two checkpoints or more (``@all``,
    ``@STEPS``), when scores against pretraining tokens say something."""
    series: dict[str, list[TaskResult]] = {}
    for r in results:
        if r.checkpoint_step is not None:
            series.setdefault(r.base_model, []).append(r)
    if not any(len({r.model for r in rows}) >= 2 for rows in series.values()):
        return {}
    return {base: sorted(rows, key=lambda r: r.checkpoint_step) for base, rows in series.items()}
