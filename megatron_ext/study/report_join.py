"""The study report's inputs: the evaluations' ``summary.json`` files read, and their models joined
to the study's runs.

An evaluated model is named after a study run (``610m_clm_42k``) or one checkpoint of it
(``610m_clm_42k@12000``). Rows carry ``base_model``, ``checkpoint_step`` and ``pretrain_tokens``
where the harness wrote them; older rows have none, and then ``NAME@STEP`` is parsed from the
model's name, a plain name is the run's final checkpoint and its tokens are the plan's ``steps x
tokens_per_step``. A run's final checkpoint (step = ``train_iters``) is its row in the tables; the
other checkpoints are points of the score-vs-tokens figure only. Models that are no run of the study
(a reference encoder) are "other models": in the tables, in no figure. Runs that differ only by
their pretraining seed (``_s<seed>`` in their names, :class:`RunGroup`) are one row, averaged over
those seeds. Study runs and tasks without an evaluation are listed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_ext.config_loading import UserError
from megatron_ext.eval.aggregation import TaskResult, checkpoint_of
from megatron_ext.eval.families import FAMILIES
from megatron_ext.study.plan import PlannedRun, StudyPlan

SUMMARY_FILE = "summary.json"
"""The evaluation folder's summary that the harness writes (``tools/evaluate.py --output-dir``)."""


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
