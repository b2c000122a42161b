"""The study report's scores: a model's per-family scores over fine-tuning seeds, pooled over
pretraining seeds, and the scores of the study's run groups that the tables and figures show.

The test score of a task is the harness's: at the LR with the best mean validation score, over the
fine-tuning seeds. A family's score (the paper's per-family columns) is the average over the
family's tasks of those best-LR test means. Its 95 % confidence interval is over fine-tuning seeds:
for each seed the family's tasks' test scores at their best LR are averaged, and the Student-t half-
width of those per-seed averages is reported (the mean of the per-seed averages is the family
score). With several pretraining seeds the row is the mean over the runs of their family scores and
the interval is the Student-t half-width over the runs. A family is scored only for a model
evaluated on all of its tasks (the tasks of that family any evaluated model has), so that every row
averages the same tasks; the average column weighs families equally and needs every family.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from megatron_ext.eval.aggregation import TaskResult, mean_ci
from megatron_ext.eval.families import PAPER_FAMILIES
from megatron_ext.eval.render import pm
from megatron_ext.study.report_join import EvaluatedCheckpoint, EvaluatedModel, Joined, RunGroup


@dataclass(frozen=True, kw_only=True)
class Score:
    """A mean and its :data:`~megatron_ext.eval.aggregation.CONFIDENCE` interval."""

    mean: float
    ci95: float | None
    """Student-t half-width; None with fewer than two units."""
    n: int
    """Units the interval is over."""
    over: Literal["fine-tuning seeds", "pretraining seeds"]

    def cell(self) -> str:
        return pm(self.mean, self.ci95)


def seed_score(parts: Sequence[Sequence[TaskResult]]) -> Score:
    """The mean over ``parts`` of the mean over each part's tasks of the best-LR test means (one
    part: a family's score; one part per family: their average), with the Student-t interval of
    the same average taken per fine-tuning seed, over the seeds every task has."""
    results = [result for part in parts for result in part]
    if not results or any(not part for part in parts):
        raise ValueError("seed_score needs at least one result in every part")

    def average(value: Callable[[TaskResult], float]) -> float:
        return statistics.fmean(statistics.fmean(value(result) for result in part) for part in parts)

    seeds = sorted(set.intersection(*(set(r.best_lr_scores.seeds) for r in results)))
    per_seed = [average(lambda r: r.best_lr_scores.test[r.best_lr_scores.seeds.index(seed)]) for seed in seeds]
    ci = mean_ci(per_seed)[2] if per_seed else None
    return Score(mean=average(lambda r: r.test_mean), ci95=ci, n=len(per_seed), over="fine-tuning seeds")


def pool(scores: Sequence[Score]) -> Score:
    """One run's score as it is; several runs' (pretraining seeds): their mean and the Student-t
    interval over them."""
    if len(scores) == 1:
        return scores[0]
    mean, _, ci = mean_ci([score.mean for score in scores])
    return Score(mean=mean, ci95=ci, n=len(scores), over="pretraining seeds")


AVERAGE = "average"
"""Key of the families' average in score mappings."""


def model_scores(model: EvaluatedModel, tasks: Mapping[str, Sequence[str]]) -> dict[str, Score]:
    """Family -> :func:`seed_score` for each family whose every task ``model`` has; and
    :data:`AVERAGE` of the paper's families (:data:`~megatron_ext.eval.families.PAPER_FAMILIES`;
    an extra one such as STS stays out of it) when it has them all."""
    parts = {family: [model.results[t] for t in names] for family, names in tasks.items()
             if all(t in model.results for t in names)}
    scores = {family: seed_score([part]) for family, part in parts.items()}
    paper = [part for family, part in parts.items() if family in PAPER_FAMILIES]
    if paper and len(paper) == len([family for family in tasks if family in PAPER_FAMILIES]):
        scores[AVERAGE] = seed_score(paper)
    return scores


def pooled_scores(per_run: Sequence[Mapping[str, Score]]) -> dict[str, Score]:
    """Key -> :func:`pool` over the runs that have it."""
    keys = dict.fromkeys(key for scores in per_run for key in scores)
    return {key: pool([scores[key] for scores in per_run if key in scores]) for key in keys}


def family_lr_curve(results: Sequence[TaskResult]) -> dict[float, float]:
    """Fine-tuning LR -> the mean over ``results`` (a family's tasks) of the test mean at that LR,
    on the LRs every task has."""
    curves = [{point.lr: point.test_mean for point in result.lr_curve} for result in results]
    lrs = sorted(set.intersection(*(set(curve) for curve in curves)))
    return {lr: statistics.fmean(curve[lr] for curve in curves) for lr in lrs}


# ----------------------------------------------------------------------------- rankings


@dataclass(frozen=True, kw_only=True)
class GroupScores:
    """Scores of the study's groups (:class:`RunGroup`) that the figures draw."""

    groups: tuple[RunGroup, ...]
    final: Mapping[str, Mapping[str, Score]]
    """Group label -> family (and :data:`AVERAGE`) -> score of its final checkpoints."""
    at_step: Mapping[tuple[str, int], tuple[float, Mapping[str, Score]]]
    """(group label, checkpoint step) -> (pretraining tokens, scores), every evaluated checkpoint."""
    lr_curves: Mapping[str, Mapping[str, Mapping[float, float]]]
    """Group label -> family -> LR -> mean test score (over the family's tasks, then the runs)."""

    @classmethod
    def of(cls, groups: Sequence[RunGroup], joined: Joined, tasks: Mapping[str, Sequence[str]]) -> GroupScores:
        group_of = {run.name: group for group in groups for run in group.runs}
        final, lr_curves = {}, {}
        for group in groups:
            finals = [joined.finals[run.name] for run in group.runs if run.name in joined.finals]
            if finals:
                final[group.label] = pooled_scores([model_scores(model, tasks) for model in finals])
            curves = [{family: family_lr_curve([model.results[t] for t in names]) for family, names in tasks.items()
                       if all(t in model.results for t in names)} for model in finals]
            pooled = {}
            for family in dict.fromkeys(f for curve in curves for f in curve):
                runs = [curve[family] for curve in curves if family in curve]
                lrs = sorted(set.intersection(*(set(curve) for curve in runs)))
                pooled[family] = {lr: statistics.fmean(curve[lr] for curve in runs) for lr in lrs}
            if pooled:
                lr_curves[group.label] = pooled
        steps: dict[tuple[str, int], list[EvaluatedCheckpoint]] = {}
        for checkpoint in joined.checkpoints:
            steps.setdefault((group_of[checkpoint.run.name].label, checkpoint.step), []).append(checkpoint)
        at_step = {key: (statistics.fmean(c.tokens for c in found),
                         pooled_scores([model_scores(c.model, tasks) for c in found]))
                   for key, found in steps.items()}
        return cls(groups=tuple(groups), final=final, at_step=at_step, lr_curves=lr_curves)
