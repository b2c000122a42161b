"""The study's report: the paper's tables and figures from a study file and its evaluations.

Inputs are the study's plan (:func:`~megatron_ext.study.plan.plan_study`: each run's name, size,
seed, kind, source, ``train_iters`` and tokens per step) and the ``summary.json`` of one or more
evaluation folders (``tools/evaluate.py --output-dir``), one row per (model, task).

**Joining.** An evaluated model is named after a study run (``610m_clm_42k``) or one checkpoint
of it (``610m_clm_42k@12000``). Rows carry ``base_model``, ``checkpoint_step`` and
``pretrain_tokens`` where the harness wrote them; older rows have none, and then ``NAME@STEP`` is
parsed from the model's name, a plain name is the run's final checkpoint and its tokens are the
plan's ``steps x tokens_per_step``. A run's final checkpoint (step = ``train_iters``) is its row in
the tables; the other checkpoints are points of the score-vs-tokens figure only. Models that are
no run of the study (a reference encoder) are "other models": in the tables, in no figure. Runs
that differ only by their pretraining seed (``_s<seed>`` in their names, :class:`RunGroup`) are
one row, averaged over those seeds. Study runs and tasks without an evaluation are listed.

**Scores** (:func:`seed_score`, :func:`pool`). The test score of a task is the harness's: at the
LR with the best mean validation score, over the fine-tuning seeds. A family's score (the paper's
per-family columns) is the average over the family's tasks of those best-LR test means. Its 95 %
confidence interval is over fine-tuning seeds: for each seed the family's tasks' test scores at
their best LR are averaged, and the Student-t half-width of those per-seed averages is reported
(the mean of the per-seed averages is the family score). With several pretraining seeds the row is
the mean over the runs of their family scores and the interval is the Student-t half-width over
the runs. A family is scored only for a model evaluated on all of its tasks (the tasks of that
family any evaluated model has), so that every row averages the same tasks; the average column
weighs families equally and needs every family.

**Rankings** per task: the harness's (``summary.json``'s ``rankings``) when one evaluation folder
ranked exactly the report's models on the task, otherwise ranked again with
:func:`~megatron_ext.eval.aggregation.rank_models` (paired tests on the test examples' scores at each
model's best LR) from the run files under each folder's ``runs/``.

**Figures** (PNG, one subplot per family; each drawn when the study has the runs it needs and they
are evaluated, otherwise named with the reason): score vs CLM share (MLM, or the biphasic runs'
second objective, at 0 %; biphasic; CLM 100 %; one line per budget), score vs pretraining tokens (MLM and CLM runs: their budgets' final
checkpoints, and each run's evaluated checkpoints), continued pretraining against added steps (from
each source kind, the source's final score at +0) and score vs fine-tuning LR (one line per kind
at its longest evaluated run; the harness's score-vs-LR curves averaged over the family's tasks).

Layout of the report folder (written whole, replacing an earlier report)::

    report.md        the tables, the figures, skipped figures and missing evaluations
    report.json      the same numbers, and each figure's points
    figures/*.png
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from megatron_ext.config_loading import UserError
from megatron_ext.eval.aggregation import CONFIDENCE, TaskResult, aggregate, checkpoint_of, mean_ci, rank_models
from megatron_ext.eval.families import FAMILIES, PAPER_FAMILIES
from megatron_ext.eval.grid import ModelRef, RunRecord, RunSpec, TaskRef, run_path
from megatron_ext.eval.protocol import FinetuneConfig
from megatron_ext.eval.ranking import RankedSystem, format_ranking
from megatron_ext.eval.render import pm, tokens_label
from megatron_ext.study.plan import PlannedRun, StudyPlan
from megatron_ext.objectives import CLM, Objective
from megatron_ext.study.spec import BiphasicSpec, CptSpec, is_constant_mlm, steps_label

SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.json"
FIGURES_DIR = "figures"


# ----------------------------------------------------------------------------- evaluations


@dataclass(frozen=True, kw_only=True)
class EvaluatedModel:
    """One model of the evaluations (a ``summary.json`` model name) and its result per task."""

    name: str
    """The evaluation's model name: a run's (``610m_clm_42k``), a checkpoint's (``RUN@STEP``) or another."""
    base_model: str
    """The run (or other model) it is a checkpoint of: ``name`` without ``@STEP``."""
    checkpoint_step: int | None
    """The pretraining step of the checkpoint evaluated; None: not known (a Hugging Face folder, or
    a row of an older harness under a plain name), taken as the run's final checkpoint."""
    pretrain_tokens: int | None
    """As the harness recorded it (steps x global batch x sequence length); None: not recorded."""
    results: Mapping[str, TaskResult]
    """By task."""
    eval_dirs: Mapping[str, Path]
    """By task: the evaluation folder whose ``summary.json`` holds the result."""


def read_summaries(eval_dirs: Sequence[Path], log: Callable[[str], None]) -> dict[Path, dict[str, Any]]:
    """Each folder's ``summary.json``; a missing or unreadable one is an error naming it."""
    summaries = {}
    for eval_dir in eval_dirs:
        path = eval_dir / SUMMARY_FILE
        if not path.is_file():
            raise UserError(f"--eval-dir {eval_dir}: no {SUMMARY_FILE} (tools/evaluate.py --output-dir {eval_dir} "
                            "writes it)")
        try:
            summary = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise UserError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(summary, dict) or not isinstance(summary.get("results"), list):
            raise UserError(f"{path}: expected the harness's summary (a mapping with a 'results' list)")
        summaries[eval_dir] = summary
        log(f"read {len(summary['results'])} result(s) from {path}")
    return summaries


def evaluated_models(summaries: Mapping[Path, Mapping[str, Any]]) -> list[EvaluatedModel]:
    """The models of every summary, in the order first seen; one (model, task) in two folders is an error."""
    rows: dict[str, dict[str, tuple[Mapping[str, Any], TaskResult, Path]]] = {}
    for eval_dir, summary in summaries.items():
        path = eval_dir / SUMMARY_FILE
        for index, row in enumerate(summary["results"]):
            try:
                result = TaskResult.from_json(row)
            except (KeyError, TypeError) as err:
                raise UserError(f"{path}: results[{index}]: not a row of the harness's summary ({err!r})") from None
            earlier = rows.setdefault(result.model, {}).get(result.task)
            if earlier is not None:
                raise UserError(f"model {result.model} on task {result.task} is in {earlier[2] / SUMMARY_FILE} and "
                                f"in {path}: give each evaluation once")
            rows[result.model][result.task] = (row, result, eval_dir)
    models = []
    for name, by_task in rows.items():
        first = next(iter(by_task.values()))[0]
        base, step = checkpoint_of(first)
        tokens = next((row.get("pretrain_tokens") for row, _, _ in by_task.values() if row.get("pretrain_tokens")),
                      None)
        models.append(EvaluatedModel(name=name, base_model=base, checkpoint_step=step, pretrain_tokens=tokens,
                                     results={task: result for task, (_, result, _) in by_task.items()},
                                     eval_dirs={task: eval_dir for task, (_, _, eval_dir) in by_task.items()}))
    return models


# ----------------------------------------------------------------------------- joining to the study


@dataclass(frozen=True, kw_only=True)
class RunGroup:
    """Runs of the study that differ only by their pretraining seed: one row of the tables."""

    label: str
    """The run's name; with several runs, the first one's without its ``_s<seed>``."""
    runs: tuple[PlannedRun, ...]
    source: str | None
    """A continued pretraining's source group (its label); None for a run from scratch."""

    @property
    def first(self) -> PlannedRun:
        return self.runs[0]


@dataclass(frozen=True, kw_only=True)
class EvaluatedCheckpoint:
    """An evaluated checkpoint of a study run."""

    run: PlannedRun
    step: int
    tokens: int
    """Pretraining tokens of the checkpoint (a continued pretraining's: its own, counted from its step 0)."""
    model: EvaluatedModel

    @property
    def final(self) -> bool:
        return self.step == self.run.train_iters


def run_groups(plan: StudyPlan) -> list[RunGroup]:
    """The study's runs grouped over pretraining seeds, in study order."""
    by_name = {run.name: run for run in plan.runs}
    keys: dict[str, tuple] = {}

    def key(run: PlannedRun) -> tuple:
        if run.name not in keys:
            keys[run.name] = (run.size, run.kind, run.train_iters, key(by_name[run.source]) if run.source else None)
        return keys[run.name]

    grouped: dict[tuple, list[PlannedRun]] = {}
    for run in plan.runs:
        grouped.setdefault(key(run), []).append(run)
    labels = {k: runs[0].name if len(runs) == 1 else re.sub(rf"_s{runs[0].seed}(?=_|$)", "", runs[0].name)
              for k, runs in grouped.items()}
    return [RunGroup(label=labels[k], runs=tuple(runs), source=labels[k[3]] if k[3] is not None else None)
            for k, runs in grouped.items()]


@dataclass(frozen=True, kw_only=True)
class Joined:
    """The evaluations joined to the study's runs."""

    checkpoints: tuple[EvaluatedCheckpoint, ...]
    """Every evaluated checkpoint of a study run, in evaluation order (finals included)."""
    finals: Mapping[str, EvaluatedModel]
    """Run name -> the evaluation of its final checkpoint."""
    others: tuple[EvaluatedModel, ...]
    """Models that are no run of the study."""
    notes: tuple[str, ...]
    """Checkpoints evaluated twice under two names (the first is used)."""


def join(plan: StudyPlan, models: Sequence[EvaluatedModel]) -> Joined:
    """Match each evaluated model to a study run and checkpoint step (module docstring)."""
    runs = {run.name: run for run in plan.runs}
    checkpoints: dict[tuple[str, int], EvaluatedCheckpoint] = {}
    others, notes = [], []
    for model in models:
        run = runs.get(model.base_model)
        if run is None:
            others.append(model)
            continue
        step = run.train_iters if model.checkpoint_step is None else model.checkpoint_step
        tokens = model.pretrain_tokens or step * run.tokens_per_step
        earlier = checkpoints.get((run.name, step))
        if earlier is not None:
            notes.append(f"{model.name} is the checkpoint of {earlier.model.name} (run {run.name}, step {step:,}): "
                         f"{earlier.model.name} is used")
            continue
        checkpoints[run.name, step] = EvaluatedCheckpoint(run=run, step=step, tokens=tokens, model=model)
    finals = {name: c.model for (name, _), c in checkpoints.items() if c.final}
    return Joined(checkpoints=tuple(checkpoints.values()), finals=finals, others=tuple(others), notes=tuple(notes))


def family_tasks(models: Iterable[EvaluatedModel]) -> dict[str, tuple[str, ...]]:
    """Family -> its tasks, over every evaluated model (families in the registry's order, others after by name)."""
    tasks: dict[str, dict[str, None]] = {}
    for model in models:
        for task, result in model.results.items():
            tasks.setdefault(result.family, {})[task] = None
    order = [*(f for f in FAMILIES if f in tasks), *sorted(f for f in tasks if f not in FAMILIES)]
    return {family: tuple(tasks[family]) for family in order}


def family_title(family: str) -> str:
    return FAMILIES[family].title if family in FAMILIES else family


def column_title(family: str) -> str:
    """A family's column head: its title, marked when it is not one of the paper's families."""
    return family_title(family) + ("" if family in PAPER_FAMILIES else " (extra, not the paper's)")


# ----------------------------------------------------------------------------- scores


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


@dataclass(frozen=True, kw_only=True)
class Series:
    """One line of a figure's subplot."""

    label: str
    points: tuple[tuple[float, Score], ...]
    """``(x, score)``, by x."""
    color: str
    """Lines with the same key share a colour across subplots."""
    dashed: bool = False


@dataclass(frozen=True, kw_only=True)
class Figure:
    """One figure of the report: a subplot per family, or the reason it was skipped."""

    name: str
    """File stem under ``figures/`` and key in ``report.json``."""
    title: str
    xlabel: str
    x_axis: Literal["steps", "percent", "tokens", "lr"] = "steps"
    """How x is drawn: counts, a share in %, token counts (B, T), learning rates (log scale)."""
    series: Mapping[str, tuple[Series, ...]] = dataclasses.field(default_factory=dict)
    """Family -> its lines; families without points are absent."""
    skipped: str | None = None

    @property
    def file(self) -> str:
        return f"{FIGURES_DIR}/{self.name}.png"


def _drawable(series: Mapping[str, Sequence[Series]]) -> dict[str, tuple[Series, ...]]:
    """The lines with at least one point, by family; families left without lines are dropped."""
    kept = {family: tuple(s for s in lines if s.points) for family, lines in series.items()}
    return {family: lines for family, lines in kept.items() if lines}


def _longest_line(series: Mapping[str, Sequence[Series]]) -> int:
    return max((len(s.points) for lines in series.values() for s in lines), default=0)


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


def _by_family(tasks: Mapping[str, Sequence[str]],
               line: Callable[[str], Sequence[Series]]) -> dict[str, tuple[Series, ...]]:
    return _drawable({family: tuple(line(family)) for family in tasks})


def _size_label(plan: StudyPlan, size: str, text: str) -> str:
    return f"{size} {text}" if len(plan.study.sizes) > 1 else text


def _objective_label(objective: Objective) -> str:
    """``MLM`` for MLM at a constant ratio (the paper's runs), else the objective's name (``wwm-40``)."""
    return "MLM" if is_constant_mlm(objective) else objective.name


def clm_share_figure(plan: StudyPlan, scores: GroupScores, tasks: Mapping[str, Sequence[str]]) -> Figure:
    """Score vs the share of CLM steps: the run of the biphasic runs' second objective alone at 0 %,
    each biphasic split, CLM at 100 %; a line per size and budget."""
    study = plan.study
    second = study.biphasic.objective if study.biphasic else BiphasicSpec.__dataclass_fields__["objective"].default
    shares = {second.study_kind: 0.0, CLM().study_kind: 1.0}
    if study.biphasic is not None:
        shares.update({study.biphasic.kind(share): share for share in study.biphasic.clm_shares})
    figure = Figure(name="clm_share", title=f"Score vs share of CLM steps (0 %: {_objective_label(second)}, 100 %: CLM)",
                    xlabel="share of pretraining steps with CLM (%)", x_axis="percent")
    kinds = set(study.scratch_kinds()) & set(shares)
    if len(kinds) < 2:
        has = ", ".join(sorted(kinds)) or "none"
        return dataclasses.replace(figure, skipped=f"the study has fewer than two of the runs it compares "
                                                   f"({', '.join(shares)}); it has {has}")
    lines = [(size.name, budget) for size in study.sizes for budget in study.budgets]

    def family_lines(family: str) -> list[Series]:
        found = []
        for size, budget in lines:
            points = sorted((100 * shares[g.first.kind], scores.final[g.label][family]) for g in scores.groups
                            if g.first.size == size and g.first.train_iters == budget and g.source is None
                            and g.first.kind in shares and family in scores.final.get(g.label, {}))
            found.append(Series(label=_size_label(plan, size, f"{steps_label(budget)} steps"), points=tuple(points),
                                color=f"{size}/{budget}"))
        return found

    series = _by_family(tasks, family_lines)
    if _longest_line(series) < 2:
        return dataclasses.replace(figure, skipped="no budget has two or more of those runs evaluated on every task "
                                                   "of a family")
    return dataclasses.replace(figure, series=series)


def tokens_figure(plan: StudyPlan, scores: GroupScores, tasks: Mapping[str, Sequence[str]]) -> Figure:
    """Score vs pretraining tokens for the single-objective runs (MLM, CLM): per kind, a solid line
    through the budgets' final checkpoints and a dashed one through each run's evaluated checkpoints."""
    kinds = [objective.kind for objective in plan.study.objectives]
    figure = Figure(name="tokens", title="Score vs pretraining tokens, MLM and CLM",
                    xlabel="pretraining tokens", x_axis="tokens")
    if not kinds:
        return dataclasses.replace(figure, skipped="the study has no single-objective (MLM or CLM) runs")
    scratch = [g for g in scores.groups if g.source is None and g.first.kind in kinds]

    def family_lines(family: str) -> list[Series]:
        found = []
        for size in plan.study.sizes:
            for kind in kinds:
                groups = [g for g in scratch if g.first.size == size.name and g.first.kind == kind]
                finals = [(g.first.train_iters * g.first.tokens_per_step, scores.final[g.label][family])
                          for g in groups if family in scores.final.get(g.label, {})]
                label = _size_label(plan, size.name, kind)
                found.append(Series(label=f"{label} (final checkpoints)", points=tuple(sorted(finals)),
                                    color=f"{size.name}/{kind}"))
                for group in groups:
                    steps = {step: at for (of, step), at in scores.at_step.items() if of == group.label}
                    if any(step != group.first.train_iters for step in steps):
                        points = sorted((tokens, by_key[family]) for tokens, by_key in steps.values()
                                        if family in by_key)
                        found.append(Series(label=f"{group.label} checkpoints", points=tuple(points),
                                            color=f"{size.name}/{kind}", dashed=True))
        return found

    series = _by_family(tasks, family_lines)
    if _longest_line(series) < 2:
        return dataclasses.replace(figure, skipped="no MLM or CLM run is evaluated at two or more token counts "
                                                   "(budgets' final checkpoints or RUN@STEP checkpoints)")
    return dataclasses.replace(figure, series=series)


def cpt_figure(plan: StudyPlan, scores: GroupScores, tasks: Mapping[str, Sequence[str]]) -> Figure:
    """Continued pretraining against added steps: a line per source (CLM, MLM ...) through its
    continuations' final checkpoints, starting at the source's final score at +0."""
    objective = plan.study.cpt.objective if plan.study.cpt else CptSpec.__dataclass_fields__["objective"].default
    figure = Figure(name="cpt", title=f"Continued pretraining ({_objective_label(objective)}) from each source vs "
                                      "added steps",
                    xlabel="continued-pretraining steps added")
    cpt = [g for g in scores.groups if g.source is not None]
    if not cpt:
        return dataclasses.replace(figure, skipped="no CPT runs in this study")

    def family_lines(family: str) -> list[Series]:
        found = []
        for source in dict.fromkeys(g.source for g in cpt):
            points = [(float(g.first.train_iters), scores.final[g.label][family]) for g in cpt
                      if g.source == source and family in scores.final.get(g.label, {})]
            if points and family in scores.final.get(source, {}):
                points.append((0.0, scores.final[source][family]))
            kind = next(g for g in scores.groups if g.label == source).first.kind
            found.append(Series(label=f"from {kind} ({source})", points=tuple(sorted(points)), color=source))
        return found

    series = _by_family(tasks, family_lines)
    if not any(x > 0 for lines in series.values() for s in lines for x, _ in s.points):
        return dataclasses.replace(figure, skipped="no CPT run is evaluated on every task of a family")
    return dataclasses.replace(figure, series=series)


def lr_figure(plan: StudyPlan, scores: GroupScores, tasks: Mapping[str, Sequence[str]]) -> Figure:
    """Score vs fine-tuning LR, one line per kind (per size and CPT source) at its longest evaluated
    run: the harness's test means per LR averaged over the family's tasks (and pretraining seeds)."""
    figure = Figure(name="lr_sensitivity", title="Score vs fine-tuning learning rate (mean test score)",
                    xlabel="fine-tuning learning rate", x_axis="lr")
    longest: dict[tuple, RunGroup] = {}
    for group in scores.groups:
        if group.label in scores.lr_curves:
            key = (group.first.size, group.first.kind, group.source)
            if key not in longest or group.first.train_iters > longest[key].first.train_iters:
                longest[key] = group

    def family_lines(family: str) -> list[Series]:
        return [Series(label=group.label, color=group.label,
                       points=tuple((lr, Score(mean=mean, ci95=None, n=len(group.runs), over="pretraining seeds"))
                                    for lr, mean in scores.lr_curves[group.label].get(family, {}).items()))
                for group in longest.values()]

    # A zero-shot family (STS) has no LR: its one run is not a point of this figure.
    series = _by_family({family: names for family, names in tasks.items()
                         if family not in FAMILIES or not FAMILIES[family].zero_shot},
                        family_lines)
    if not series:
        return dataclasses.replace(figure, skipped="no study run is evaluated on every task of a family")
    if _longest_line(series) < 2:
        return dataclasses.replace(figure, skipped="the evaluations have one fine-tuning LR")
    return dataclasses.replace(figure, series=series)


FIGURES = (clm_share_figure, tokens_figure, cpt_figure, lr_figure)
"""The report's figures, in order."""


# ----------------------------------------------------------------------------- the report


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


METHOD = (
    "Test scores are the harness's: at the LR with the best mean validation score, mean over the fine-tuning seeds. "
    "A family's score is the average over its tasks of those best-LR test means; its {confidence:.0%} interval is "
    "the Student-t half-width, over fine-tuning seeds, of the per-seed averages over the family's tasks (each task "
    "at its best LR). Where a row pools several pretraining seeds (runs named _s<seed>), it is the mean over the "
    "runs of their family scores and the interval is the Student-t half-width over those runs (column 'CI over'). "
    "A family is scored only for a model evaluated on all its tasks; the average weighs the paper's families "
    "equally and needs all of them. A column marked 'extra, not the paper's' (similarity: zero-shot STS, "
    "Spearman x 100 of the embeddings' cosine similarities, one run without LR or seeds) stays out of the average."
)


def _score_json(score: Score) -> dict[str, Any]:
    return dataclasses.asdict(score)


def _row_json(row: TableRow) -> dict[str, Any]:
    record: dict[str, Any] = {"label": row.label, "models": list(row.models),
                              "scores": {key: _score_json(score) for key, score in row.scores.items()}}
    if row.group is not None:
        first = row.group.first
        record.update(kind=first.kind, size=first.size, train_iters=first.train_iters, source=row.group.source,
                      pretrain_tokens=first.train_iters * first.tokens_per_step,
                      runs=[run.name for run in row.group.runs])
    return record


def report_json(report: StudyReport) -> dict[str, Any]:
    """``report.json``: the tables' and figures' numbers."""
    return {
        "study": report.plan.study.name, "study_file": str(report.plan.path),
        "eval_dirs": [str(d) for d in report.eval_dirs], "confidence": CONFIDENCE,
        "method": METHOD.format(confidence=CONFIDENCE),
        "families": {family: {"title": family_title(family), "paper": family in PAPER_FAMILIES, "tasks": list(names)}
                     for family, names in report.tasks.items()},
        "study_models": [_row_json(row) for row in report.rows],
        "other_models": [_row_json(row) for row in report.other_rows],
        "tasks": {task: {model.name: {key: getattr(model.results[task], key)
                                      for key in ("metric", "best_lr", "test_mean", "test_ci95", "seeds")}
                         for model in report.task_models if task in model.results}
                  for names in report.tasks.values() for task in names},
        "rankings": {task: ({"skipped": r.skipped} if r.skipped else
                            {"source": r.source, "ranking": [dataclasses.asdict(entry) for entry in r.ranking]})
                     for task, r in report.rankings.items()},
        "checkpoints": [{"model": c.model.name, "run": c.run.name, "step": c.step, "tokens": c.tokens,
                         "final": c.final} for c in report.checkpoints],
        "figures": {f.name: ({"skipped": f.skipped} if f.skipped else
                             {"file": f.file, "title": f.title, "xlabel": f.xlabel,
                              "series": {family: [{"label": s.label, "dashed": s.dashed,
                                                   "points": [{"x": x, **_score_json(score)} for x, score in s.points]}
                                                  for s in lines]
                                         for family, lines in f.series.items()}})
                    for f in report.figures},
        "missing": list(report.missing),
        "notes": list(report.notes),
    }


def report_markdown(report: StudyReport) -> str:
    """``report.md``."""
    plan, families = report.plan, list(report.tasks)
    head = [column_title(f) for f in families] + ["average"]
    lines = [
        f"# Study report: {plan.study.name}", "",
        f"Study file `{plan.path}` ({len(plan.runs)} runs); evaluations: "
        + ", ".join(f"`{d / SUMMARY_FILE}`" for d in report.eval_dirs) + ".", "",
        "Families: " + "; ".join(f"{family_title(f)}: {', '.join(names)}" for f, names in report.tasks.items())
        + ".", "",
        "## Per-family scores", "", METHOD.format(confidence=CONFIDENCE), "",
        "| model | kind | size | steps | pretraining tokens | runs | " + " | ".join(head) + " | CI over |",
        "|---|---|---|---|---|---|" + "---|" * len(head) + "---|",
    ]

    def cells(row: TableRow) -> str:
        return " | ".join(row.scores[key].cell() if key in row.scores else "–" for key in [*families, AVERAGE])

    def over(row: TableRow) -> str:
        # only the cells with an interval: a zero-shot family (STS) is one run, without seeds
        units = {(s.over, s.n) for s in row.scores.values() if s.ci95 is not None}
        return ", ".join(f"{n} {what}" for what, n in sorted(units)) or "–"

    for row in report.rows:
        first = row.group.first
        lines.append(f"| {row.label} | {first.kind}{f' from {row.group.source}' if row.group.source else ''} | "
                     f"{first.size} | {steps_label(first.train_iters)} | "
                     f"{'+' if row.group.source else ''}{tokens_label(first.train_iters * first.tokens_per_step)} | "
                     f"{len(row.models)} | {cells(row)} | "
                     f"{over(row)} |")
    if not report.rows:
        lines.append("| (no study run's final checkpoint is evaluated) |" + " |" * (len(head) + 6))
    if report.other_rows:
        lines += ["", "Other models (not runs of the study):", "",
                  "| model | " + " | ".join(head) + " | CI over |", "|---|" + "---|" * (len(head) + 1)]
        lines += [f"| {row.label} | {cells(row)} | {over(row)} |" for row in report.other_rows]

    tasks = [task for names in report.tasks.values() for task in names]
    rank_of = {(task, entry.system): entry.rank for task, r in report.rankings.items() for entry in r.ranking}
    lines += ["", "## Per-task scores and rankings", "",
              f"Test at the best validation LR, mean ± {CONFIDENCE:.0%} CI over fine-tuning seeds; [rank] among the "
              "models of the task (paired permutation tests on the test examples' scores, p < 0.05 opens a new "
              "rank; tied models share a rank). A ranking's 'Mean' is the mean of those per-example scores; where "
              "the task's metric is not a mean over examples (token classification: entity F1 over the whole "
              "test set, against each sentence's F1 there) it differs from the score in this table.", "",
              "| model | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
    for model in report.task_models:
        row = []
        for task in tasks:
            result = model.results.get(task)
            if result is None:
                row.append("–")
                continue
            rank = rank_of.get((task, model.name))
            row.append(pm(result.test_mean, result.test_ci95) + ("" if rank is None else f" [{rank}]"))
        lines.append(f"| {model.name} | " + " | ".join(row) + " |")
    for task, ranking in report.rankings.items():
        lines += ["", f"### {task}", ""]
        if ranking.skipped:
            lines.append(f"Not ranked: {ranking.skipped}.")
        else:
            lines += [f"Source: {ranking.source}.", "", format_ranking(ranking.ranking).rstrip()]

    lines += ["", "## Figures", ""]
    for figure in report.figures:
        if not figure.skipped:
            lines += [f"### {figure.title}", "", f"![{figure.name}]({figure.file})", ""]
    skipped = [f for f in report.figures if f.skipped]
    if skipped:
        lines += ["Skipped figures:", ""] + [f"- {f.title} (`{f.name}`): {f.skipped}." for f in skipped] + [""]
    lines += ["## Missing evaluations", ""]
    lines += ([f"- {line}" for line in report.missing] if report.missing
              else ["None: every run is evaluated on every task."])
    if report.notes:
        lines += ["", "## Notes", ""] + [f"- {note}" for note in report.notes]
    return "\n".join(lines) + "\n"

