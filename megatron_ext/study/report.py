"""The study's report: the paper's tables and figures from a study file and its evaluations.

Inputs are the study's plan (:func:`~megatron_ext.study.plan.plan_study`: each run's name, size,
seed, kind, source, ``train_iters`` and tokens per step) and the ``summary.json`` of one or more
evaluation folders (``tools/evaluate.py --output-dir``), one row per (model, task).
:func:`build_report` takes them through one module per concern, each with its method in its
docstring: joining the evaluations to the study's runs (``report_join``), scores and their
pooling over seeds (``report_scores``), per-task rankings (``report_rankings``) and the figures
(``report_figures``); ``report_files`` writes the report folder (JSON, markdown, PNG).

Layout of the report folder (written whole, replacing an earlier report)::

    report.md        the tables, the figures, skipped figures and missing evaluations
    report.json      the same numbers, and each figure's points
    figures/*.png
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_ext.config_loading import UserError
from megatron_ext.study.plan import StudyPlan
from megatron_ext.study.report_figures import FIGURES, Figure
from megatron_ext.study.report_join import (SUMMARY_FILE, EvaluatedCheckpoint, EvaluatedModel, Joined, RunGroup,
                                            evaluated_models, family_tasks, join, read_summaries, run_groups)
from megatron_ext.study.report_rankings import TaskRanking, task_rankings
from megatron_ext.study.report_scores import GroupScores, Score, model_scores


@dataclass(frozen=True, kw_only=True)
class TableRow:
    """A row of the per-family table: a group of study runs, or another model."""

    label: str
    models: tuple[str, ...]
    """The evaluated models it averages (final checkpoints)."""
    group: RunGroup | None
    scores: Mapping[str, Score]
    """Family (and :data:`AVERAGE`) -> score."""


@dataclass(frozen=True, kw_only=True)
class StudyReport:
    """Everything ``report.md`` and ``report.json`` show."""

    plan: StudyPlan
    eval_dirs: tuple[Path, ...]
    tasks: Mapping[str, tuple[str, ...]]
    """Family -> tasks."""
    rows: tuple[TableRow, ...]
    """Study groups with an evaluated final checkpoint, in study order."""
    other_rows: tuple[TableRow, ...]
    task_models: tuple[EvaluatedModel, ...]
    """The models of the per-task table and rankings: each study run's final checkpoint, then the others."""
    rankings: Mapping[str, TaskRanking]
    figures: tuple[Figure, ...]
    missing: tuple[str, ...]
    """One line per study run or model without (all) its evaluations."""
    notes: tuple[str, ...]
    checkpoints: tuple[EvaluatedCheckpoint, ...]


def missing_evaluations(plan: StudyPlan, joined: Joined, tasks: Mapping[str, Sequence[str]]) -> list[str]:
    """Each study run whose final checkpoint is not evaluated on every task, and each other model
    likewise."""
    every = [task for names in tasks.values() for task in names]
    lines = []
    for run in plan.runs:
        model = joined.finals.get(run.name)
        if model is None:
            steps = sorted(c.step for c in joined.checkpoints if c.run.name == run.name)
            only = f" (only checkpoints at steps {', '.join(f'{s:,}' for s in steps)})" if steps else ""
            lines.append(f"{run.name}: final checkpoint (step {run.train_iters:,}) not evaluated{only}")
        elif absent := [t for t in every if t not in model.results]:
            lines.append(f"{run.name}: not evaluated on {', '.join(absent)}")
    for model in joined.others:
        if absent := [t for t in every if t not in model.results]:
            lines.append(f"{model.name} (other model): not evaluated on {', '.join(absent)}")
    return lines


def incomplete_summaries(summaries: Mapping[Path, Mapping[str, Any]]) -> list[str]:
    """One line per summary written before its grid was complete (``missing_runs``: the runs
    without a record, listed by the harness's ``--summary-only``)."""
    lines = []
    for eval_dir, summary in summaries.items():
        missing = summary.get("missing_runs") or []
        if missing:
            listed = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            lines.append(f"{eval_dir / SUMMARY_FILE}: written with {len(missing)} fine-tuning run(s) not done yet "
                         f"({listed}); its scores are over the runs done")
    return lines


def build_report(plan: StudyPlan, eval_dirs: Sequence[str | Path],
                 log: Callable[[str], None] = lambda line: None) -> StudyReport:
    """Join the evaluations of ``eval_dirs`` to ``plan`` and compute the tables, rankings and figures."""
    eval_dirs = tuple(Path(d) for d in eval_dirs)
    if not eval_dirs:
        raise UserError("give at least one --eval-dir")
    summaries = read_summaries(eval_dirs, log)
    models = evaluated_models(summaries)
    if not models:
        raise UserError(f"no results in {', '.join(str(d / SUMMARY_FILE) for d in eval_dirs)}")
    joined = join(plan, models)
    tasks = family_tasks(models)
    groups = run_groups(plan)
    scores = GroupScores.of(groups, joined, tasks)
    log(f"joined {len(models)} evaluated model(s) to the study's {len(plan.runs)} runs: {len(joined.finals)} final "
        f"checkpoint(s), {len(joined.checkpoints) - len(joined.finals)} other checkpoint(s), {len(joined.others)} "
        "other model(s)")
    rows = tuple(TableRow(label=g.label, group=g, scores=scores.final[g.label],
                          models=tuple(joined.finals[r.name].name for r in g.runs if r.name in joined.finals))
                 for g in groups if g.label in scores.final)
    other_rows = tuple(TableRow(label=m.name, group=None, scores=model_scores(m, tasks), models=(m.name,))
                       for m in joined.others)
    task_models = tuple(joined.finals[run.name] for run in plan.runs if run.name in joined.finals) + joined.others
    every_task = [task for names in tasks.values() for task in names]
    rankings = task_rankings(task_models, every_task, summaries, log)
    figures = []
    for make in FIGURES:
        figure = make(plan, scores, tasks)
        figures.append(figure)
        log(f"figure {figure.name}: " + (f"skipped ({figure.skipped})" if figure.skipped else
                                         f"{sum(len(lines) for lines in figure.series.values())} line(s) over "
                                         f"{len(figure.series)} famil{'y' if len(figure.series) == 1 else 'ies'}"))
    return StudyReport(plan=plan, eval_dirs=eval_dirs, tasks=tasks, rows=rows, other_rows=other_rows,
                       task_models=task_models, rankings=rankings, figures=tuple(figures),
                       missing=tuple(missing_evaluations(plan, joined, tasks) + incomplete_summaries(summaries)),
                       notes=joined.notes,
                       checkpoints=joined.checkpoints)
