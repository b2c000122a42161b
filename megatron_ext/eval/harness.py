"""The evaluation grid: fine-tune every model on every task at every (learning rate, seed), as in the paper.

One run (:class:`RunSpec`) per (model, task, LR, seed) through the task family's ``run``
(:mod:`.families`), under the shared protocol (:mod:`.protocol`); retrieval tasks with the same
training pairs (MS MARCO for MS MARCO, NQ and MLDR) share one training per LR and seed, as in the
paper. Each finished run is a :class:`RunRecord`, each (model, task) a :class:`TaskResult`; all are
frozen, built once. Aggregation follows the paper: per LR, the mean over seeds; the best LR
maximises the mean validation score; the test score at that LR is reported as mean ± 95 %
confidence half-width over seeds (Student t). Stability is the seed spread at the best LR and
the whole score-vs-LR curve. A run whose loss turns non-finite is recorded as ``diverged`` and
counts as score 0 for validation and test, so an LR that blows up drags its mean down instead of
vanishing from the curve.

With several models, each task also ranks them as the paper does: on the test examples' own
scores (each run saves them), averaged over the best LR's seeds, with paired tests between models
(:mod:`.ranking`); models that no test separates share a rank.

Models are Hugging Face encoder directories or Megatron checkpoints (a save directory or one
``iter_*``), which are exported to EuroBERT once. Runs are resumable: a finished run's JSON is
reused, after checking it was made with the same config and model.

Layout of ``output_dir``::

    exported/<model>/, exported/<model>.json    export of a checkpoint model, and its source
    runs/<model>/<task>/lr<lr>_seed<seed>.json  one run: config, scores (and each example's), steps, time, losses
    summary.json, summary.md, summary.csv       one row per model x task, plus the LR curves and rankings
    plots/<task>.png                            score vs LR, one line per model, CI bands
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from megatron_ext.config_loading import UserError
from megatron_ext.fileio import write_atomic
from megatron_ext.eval.benchmarks import BENCHMARKS, TASK_GROUPS, expand_tasks, prepare_benchmarks
from megatron_ext.eval.families import FAMILIES, FAMILY_DEFAULTS, run_shared, shared_training_key
from megatron_ext.eval.protocol import PAPER_LR_GRID, PAPER_SEEDS, FinetuneConfig, RunResult
from megatron_ext.eval.ranking import RankedSystem, format_ranking, rank_systems
from megatron_ext.eval.task_io import SPLITS, TASK_FILE, default_suite_dir, load_task
from megatron_ext.eval.suite import TASKS, build_task

CONFIDENCE = 0.95
"""Level of the confidence interval over seeds."""
DIVERGED_SCORE = 0.0
"""Validation and test score given to a diverged run."""
_NAME = re.compile(r"^[\w.+-]+$")


@dataclass(frozen=True, kw_only=True)
class ModelRef:
    """A model to evaluate."""

    name: str
    """Directory name under ``runs/`` and label in reports."""
    hf_dir: Path
    """Hugging Face directory the families load."""
    source: str
    """What was given: the HF directory, or the checkpoint exported into ``hf_dir``."""


@dataclass(frozen=True, kw_only=True)
class TaskRef:
    """A task to evaluate on."""

    name: str
    """Directory name under ``runs/<model>/`` and label in reports."""
    task_dir: Path
    """Directory with ``task.json`` and the split files."""
    family: str
    """Key of :data:`FAMILIES`."""
    metric: str
    """``task.json``'s metric, for reports when no run returned one (all diverged)."""


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One fine-tuning run of the grid: a model on a task under the protocol's settings at one
    (LR, seed), and the file its record goes to."""

    model: ModelRef
    task: TaskRef
    """The task, and through it the family that fine-tunes."""
    config: FinetuneConfig
    """The protocol's settings, this run's LR and seed included (:func:`finetune_config`)."""
    path: Path
    """``runs/<model>/<task>/lr<lr>_seed<seed>.json`` (:func:`run_path`)."""

    @property
    def lr(self) -> float:
        return self.config.lr

    @property
    def seed(self) -> int:
        return self.config.seed


@dataclass(frozen=True, kw_only=True)
class LossSummary:
    """A run's training losses in brief (the run's file keeps no per-step losses)."""

    first: float
    last: float
    min: float
    max: float
    mean_last_10pct: float
    """Mean over the last tenth of the steps (at least the last step)."""

    @classmethod
    def of(cls, losses: Sequence[float]) -> LossSummary | None:
        """The summary of ``losses``; None without any."""
        if not losses:
            return None
        return cls(first=losses[0], last=losses[-1], min=min(losses), max=max(losses),
                   mean_last_10pct=statistics.fmean(losses[-max(1, len(losses) // 10):]))


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """A finished run of a :class:`RunSpec`: fine-tuned and scored, or diverged (scored
    :data:`DIVERGED_SCORE`). Its file is ``spec.path`` (:meth:`to_json`)."""

    spec: RunSpec
    status: Literal["ok", "diverged"]
    error: str | None = None
    """Why the run diverged (the non-finite loss); None for ``ok``."""
    metric: str | None
    """The family's metric (``accuracy``, ``f1``, ``ndcg@10``); None for a diverged run."""
    validation: float
    """Validation score (0-100); picks the LR."""
    test: float
    """Test score (0-100); reported."""
    steps: int | None
    """Optimizer steps taken; None for a diverged run."""
    seconds: float
    """Wall time of the run (a shared training's time is in each of its runs)."""
    extra: Mapping[str, float]
    """:attr:`RunResult.extra`: other metrics, ``<split>_<name>``."""
    per_example: Mapping[str, Mapping[str, float]] | None
    """:attr:`RunResult.per_example`; None for a diverged run."""
    losses: LossSummary | None
    """None for a diverged run."""

    @classmethod
    def finished(cls, spec: RunSpec, result: RunResult) -> RunRecord:
        return cls(spec=spec, status="ok", metric=result.metric, validation=result.validation, test=result.test,
                   steps=result.steps, seconds=result.seconds, extra=result.extra, per_example=result.per_example,
                   losses=LossSummary.of(result.losses))

    @classmethod
    def diverged(cls, spec: RunSpec, error: FloatingPointError, seconds: float) -> RunRecord:
        return cls(spec=spec, status="diverged", error=str(error), metric=None, validation=DIVERGED_SCORE,
                   test=DIVERGED_SCORE, steps=None, seconds=seconds, extra={}, per_example=None, losses=None)

    @classmethod
    def read(cls, spec: RunSpec) -> RunRecord | None:
        """The finished run at ``spec.path``, if any; one made with another model or config is an error."""
        if not spec.path.is_file():
            return None
        data = json.loads(spec.path.read_text(encoding="utf-8"))
        if data["model_source"] != spec.model.source:
            raise UserError(f"{spec.path} was made with model {data['model_source']}, not {spec.model.source}; "
                             "use another output directory or model name")
        config = dataclasses.asdict(spec.config)
        if data["config"] != config:
            differing = sorted(k for k, v in config.items() if data["config"].get(k) != v)
            raise UserError(f"{spec.path} was made with a different config ({', '.join(differing)}); use another "
                             "output directory or the same settings")
        losses = data["losses"]
        return cls(spec=spec, status=data["status"], error=data.get("error"), metric=data["metric"],
                   validation=data["validation"], test=data["test"], steps=data["steps"], seconds=data["seconds"],
                   extra=data["extra"], per_example=data["per_example"],
                   losses=None if losses is None else LossSummary(**losses))

    def to_json(self) -> dict[str, Any]:
        """The run's file: which run it is (model, task, LR, seed, config), then how it went."""
        spec = self.spec
        record = {"model": spec.model.name, "model_source": spec.model.source, "model_dir": str(spec.model.hf_dir),
                  "task": spec.task.name, "task_dir": str(spec.task.task_dir), "family": spec.task.family,
                  "lr": spec.lr, "seed": spec.seed, "config": dataclasses.asdict(spec.config), "status": self.status,
                  "error": self.error, "metric": self.metric, "validation": self.validation, "test": self.test,
                  "steps": self.steps, "seconds": self.seconds, "extra": self.extra, "per_example": self.per_example,
                  "losses": None if self.losses is None else dataclasses.asdict(self.losses)}
        if self.status == "ok":
            del record["error"]
        else:  # diverged runs have always listed losses before per_example
            record["per_example"] = record.pop("per_example")
        return record

    def save(self) -> None:
        write_atomic(self.spec.path, json.dumps(self.to_json(), indent=2) + "\n")

    def describe(self) -> str:
        """One line for the progress log."""
        head = f"{self.spec.model.name} {self.spec.task.name} lr={self.spec.lr:g} seed={self.spec.seed}:"
        if self.status == "diverged":
            return f"{head} diverged ({self.error}) -> scored {DIVERGED_SCORE:g}"
        return (f"{head} {self.metric} validation {self.validation:.2f} test {self.test:.2f} "
                f"({self.steps} steps, {self.seconds:.1f} s)")


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


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    """What :func:`evaluate_models` did."""

    results: tuple[TaskResult, ...]
    """One per (model, task), ranked: ``summary.json``'s ``results``."""
    executed: int
    """Runs fine-tuned by this call."""
    reused: int
    """Finished runs read back from ``runs/``."""
    output_dir: Path


# ----------------------------------------------------------------------------- inputs


def _split_name(spec: str) -> tuple[str | None, str]:
    name, sep, path = spec.partition("=")
    return (name, path) if sep and _NAME.match(name) else (None, spec)


def resolve_models(models: Sequence[str], output_dir: Path) -> list[ModelRef]:
    """HF directories as they are; Megatron checkpoints exported to ``output_dir/exported/<name>``.

    Each entry is ``PATH`` or ``NAME=PATH``; the name defaults to the path's last component.
    """
    from megatron_ext.checkpoint.handle import Checkpoint

    refs = []
    for spec in models:
        name, path = _split_name(spec)
        path = Path(path)
        name = name or path.resolve().name
        if not _NAME.match(name):
            raise UserError(f"model {spec!r}: name {name!r} must be letters, digits, '.', '+', '-' or '_'")
        if any(ref.name == name for ref in refs):
            raise UserError(f"two models are named {name!r}; name them with NAME=PATH")
        if not path.is_dir():
            raise UserError(f"model {spec!r}: {path} is not a directory")
        checkpoint = Checkpoint.latest(path)
        if checkpoint is not None:
            refs.append(ModelRef(name=name, hf_dir=_export(name, checkpoint.path, output_dir),
                                 source=str(checkpoint.path.resolve())))
        elif (path / "config.json").is_file():
            refs.append(ModelRef(name=name, hf_dir=path.resolve(), source=str(path.resolve())))
        else:
            raise UserError(f"model {spec!r}: {path} is neither a Hugging Face model directory (no config.json) "
                            "nor a Megatron checkpoint (no complete iter_* checkpoint)")
    return refs


def _export(name: str, checkpoint: Path, output_dir: Path) -> Path:
    """Export ``checkpoint`` unless ``exported/<name>`` already holds its export."""
    from megatron_ext.hf import export_checkpoint

    target = output_dir / "exported" / name
    marker = output_dir / "exported" / f"{name}.json"
    source = str(checkpoint.resolve())
    if marker.is_file() and json.loads(marker.read_text())["checkpoint"] == source and target.is_dir():
        return target
    export_checkpoint(checkpoint, target, overwrite=True, log=lambda line: print(f"export {name}: {line}", flush=True))
    write_atomic(marker, json.dumps({"checkpoint": source}, indent=2) + "\n")
    return target


def resolve_tasks(tasks: Sequence[str], suite_dir: str | Path | None = None,
                  benchmarks_dir: str | Path | None = None) -> list[TaskRef]:
    """Suite task names (built into ``suite_dir`` when absent), the paper's benchmarks (converted into
    ``suite_dir`` from ``benchmarks_dir`` or the hub when absent; ``paper`` names them all) or task
    directories with ``task.json``.

    Every split a run reads is loaded once here, so schema errors surface before any training; a
    benchmark whose data is neither local nor on a reachable hub fails before anything is converted.
    """
    suite_dir = Path(suite_dir) if suite_dir is not None else default_suite_dir()
    tasks = expand_tasks(tasks)
    benchmark_dirs = prepare_benchmarks([t for t in tasks if t in BENCHMARKS and t not in TASKS], suite_dir,
                                        benchmarks_dir, log=lambda line: print(line, flush=True))
    refs = []
    for task in tasks:
        if task in TASKS:
            task_dir = suite_dir / task
            if not (task_dir / TASK_FILE).is_file():
                print(f"building task {task} into {suite_dir}", flush=True)
                build_task(task, suite_dir)
        elif task in benchmark_dirs:
            task_dir = benchmark_dirs[task]
        elif (Path(task) / TASK_FILE).is_file():
            task_dir = Path(task)
        else:
            raise UserError(f"unknown task {task!r}: expected one of {sorted(TASKS)}, a benchmark "
                            f"{sorted(BENCHMARKS)}, a group {sorted(TASK_GROUPS)} or a directory with a "
                            f"{TASK_FILE} (docs/eval_suite.md)")
        meta = json.loads((task_dir / TASK_FILE).read_text(encoding="utf-8"))
        family = meta.get("family")
        if family not in FAMILIES:
            raise UserError(f"task {task!r} has family {family!r}, which the harness cannot fine-tune; "
                            f"families: {sorted(FAMILIES)}")
        name = task_dir.resolve().name
        if any(ref.name == name for ref in refs):
            raise UserError(f"two tasks are named {name!r}")
        for split in SPLITS + (("corpus",) if family == "ir" else ()):
            load_task(task_dir, split)
        refs.append(TaskRef(name=name, task_dir=task_dir.resolve(), family=family, metric=meta.get("metric", "")))
    return refs


def finetune_config(family: str, lr: float, seed: int, overrides: Mapping[str, Any]) -> FinetuneConfig:
    """The run's config: the family's defaults unless ``overrides`` set the run length, then ``overrides``."""
    fields = {f.name for f in dataclasses.fields(FinetuneConfig)} - {"lr", "seed"}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise UserError(f"unknown FinetuneConfig override(s) {unknown}; expected some of {sorted(fields)}")
    sets_length = "max_steps" in overrides or "epochs" in overrides
    defaults = {} if sets_length else FAMILY_DEFAULTS.get(family, {})
    return FinetuneConfig(**{**defaults, **overrides}, lr=lr, seed=seed)


def run_path(output_dir: Path, model: str, task: str, lr: float, seed: int) -> Path:
    return output_dir / "runs" / model / task / f"lr{lr:g}_seed{seed}.json"


# ----------------------------------------------------------------------------- runs


def _run(specs: Sequence[RunSpec]) -> list[RunRecord]:
    """Fine-tune once for ``specs``: one run, or the runs of tasks that share their training (same
    model, LR and seed; :func:`_shared_runs`); the record of each."""
    first = specs[0]
    model_dir = str(first.model.hf_dir)
    started = time.perf_counter()
    try:
        if len(specs) == 1:
            results = [FAMILIES[first.task.family](model_dir, first.task.task_dir, first.config)]
        else:
            results = run_shared(first.task.family, model_dir, [spec.task.task_dir for spec in specs], first.config)
    except FloatingPointError as error:
        seconds = time.perf_counter() - started
        return [RunRecord.diverged(spec, error, seconds) for spec in specs]
    return [RunRecord.finished(spec, result) for spec, result in zip(specs, results, strict=True)]


class _Runs:
    """The grid's runs, each recorded once: read back from ``runs/``, or fine-tuned (with the tasks
    that share its training and whose run is missing too, :func:`_shared_runs`)."""

    def __init__(self, specs: Mapping[tuple[str, str, float, int], RunSpec], shared: Mapping[str, list[TaskRef]]):
        self.specs = specs
        """By (model name, task name, LR, seed)."""
        self.shared = shared
        self.trained: dict[RunSpec, RunRecord] = {}
        """Runs fine-tuned with an earlier task's, not asked for yet."""
        self.executed = 0
        self.reused = 0

    def record(self, spec: RunSpec, log: Callable[[str], None]) -> RunRecord:
        """``spec``'s run: trained with an earlier task's, read back, or fine-tuned now (``log``: its line)."""
        if spec in self.trained:
            return self.trained.pop(spec)
        record = RunRecord.read(spec)
        if record is not None:
            self.reused += 1
            return record
        group = [self.specs[spec.model.name, task.name, spec.lr, spec.seed]
                 for task in self.shared.get(spec.task.name, [spec.task])]
        pending = [other for other in group if RunRecord.read(other) is None]
        if len(pending) > 1:
            log(f"{spec.model.name} lr={spec.lr:g} seed={spec.seed}: one training for "
                f"{', '.join(other.task.name for other in pending)}")
        for done in _run(pending):
            done.save()
            self.executed += 1
            log(done.describe())
            self.trained[done.spec] = done
        return self.trained.pop(spec)


def _shared_runs(tasks: Sequence[TaskRef]) -> dict[str, list[TaskRef]]:
    """Task name -> the tasks that train the same model with it (same family, whose run configs
    are then the same, and the same training data by
    :func:`~megatron_ext.eval.families.shared_training_key`), in the given order; only for groups
    of two or more."""
    groups: dict[tuple[str, str], list[TaskRef]] = {}
    for task in tasks:
        key = shared_training_key(task.family, task.task_dir)
        if key is not None:
            groups.setdefault((task.family, key), []).append(task)
    return {task.name: group for group in groups.values() if len(group) > 1 for task in group}


# ----------------------------------------------------------------------------- aggregation


def mean_ci(scores: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float | None, float | None]:
    """Mean, sample standard deviation and Student-t confidence half-width (None below two scores)."""
    from scipy import stats

    mean = statistics.fmean(scores)
    if len(scores) < 2:
        return mean, None, None
    std = statistics.stdev(scores)
    return mean, std, float(stats.t.ppf((1 + confidence) / 2, len(scores) - 1)) * std / math.sqrt(len(scores))


def aggregate(records: Sequence[RunRecord], lrs: Sequence[float], task: TaskRef) -> TaskResult:
    """Summary of one (model, task) from its runs over ``lrs`` x seeds."""
    curve = []
    for lr in lrs:
        runs = [r for r in records if r.spec.lr == lr]
        val_mean, val_std, _ = mean_ci([r.validation for r in runs])
        test_mean, test_std, test_ci = mean_ci([r.test for r in runs])
        curve.append(LRPoint(lr=lr, validation_mean=val_mean, validation_std=val_std, test_mean=test_mean,
                             test_std=test_std, test_ci95=test_ci,
                             diverged=sum(r.status == "diverged" for r in runs), seeds=len(runs)))
    best = max(curve, key=lambda point: point.validation_mean)  # ties: the first LR of the grid
    best_runs = sorted((r for r in records if r.spec.lr == best.lr), key=lambda r: r.spec.seed)
    metrics = {r.metric for r in records if r.metric}
    return TaskResult(
        model=records[0].spec.model.name, task=task.name, family=task.family,
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


# ----------------------------------------------------------------------------- outputs


def _pm(mean: float, ci: float | None) -> str:
    return f"{mean:.2f} ± {ci:.2f}" if ci is not None else f"{mean:.2f}"


def _std(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


CSV_COLUMNS = ("model", "task", "family", "metric", "best_lr", "test_mean", "test_ci95", "validation_mean",
               "validation_std", "test_std", "seeds", "diverged_runs", "runs", "rank")


def summary_markdown(results: Sequence[TaskResult], lrs: Sequence[float], seeds: Sequence[int],
                     rankings: Mapping[str, Sequence[RankedSystem]] | None = None) -> str:
    """``summary.md``: the model x task table, then each task's ranking, score-vs-LR table and plot."""
    rankings = rankings or {}
    diverged, runs = sum(r.diverged_runs for r in results), sum(r.runs for r in results)
    lines = [
        "# Fine-tuning evaluation", "",
        f"LR grid {', '.join(f'{lr:g}' for lr in lrs)}; seeds {', '.join(map(str, seeds))}. The best LR maximises "
        f"the mean validation score; test is the mean ± {CONFIDENCE:.0%} confidence half-width over seeds at that LR "
        f"(Student t). Diverged runs (non-finite training loss) count as score {DIVERGED_SCORE:g}: "
        f"{diverged} of {runs} runs.", "",
        "| model | task | metric | best LR | test (mean ± CI) | validation mean | seed std (validation / test) "
        "| diverged runs | rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r.model} | {r.task} | {r.metric} | {r.best_lr:g} | {_pm(r.test_mean, r.test_ci95)} | "
                     f"{r.validation_mean:.2f} | {_std(r.validation_std)} / {_std(r.test_std)} | "
                     f"{r.diverged_runs} | {'' if r.rank is None else r.rank} |")
    for task in dict.fromkeys(r.task for r in results):
        if task in rankings:
            lines += ["", f"## {task}: ranking", "",
                      "On the test examples' scores at each model's best LR (mean over seeds); paired "
                      "permutation tests, p < 0.05 opens a new rank.", "", format_ranking(rankings[task]).rstrip()]
        lines += ["", f"## {task}: score vs learning rate", "",
                  "Test mean ± CI (validation mean); a † marks diverged seeds.", "",
                  "| model | " + " | ".join(f"{lr:g}" for lr in lrs) + " |", "|---|" + "---|" * len(lrs)]
        for r in (r for r in results if r.task == task):
            cells = [f"{_pm(p.test_mean, p.test_ci95)} ({p.validation_mean:.2f})" + " †" * p.diverged
                     for p in r.lr_curve]
            lines.append(f"| {r.model} | " + " | ".join(cells) + " |")
        lines += ["", f"![{task}](plots/{task}.png)"]
    return "\n".join(lines) + "\n"


def plot_task(results: Sequence[TaskResult], task: str) -> bytes:
    """PNG of test score vs LR (log x) for one task: a line per model, its CI band (drawn within the
    metric's 0-100 range; few seeds give wide intervals), the best LR starred."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in results:
        lrs = [p.lr for p in r.lr_curve]
        means = [p.test_mean for p in r.lr_curve]
        halves = [p.test_ci95 or 0.0 for p in r.lr_curve]
        (line,) = ax.plot(lrs, means, marker="o", label=r.model)
        ax.fill_between(lrs, [max(0.0, m - h) for m, h in zip(means, halves)],
                        [min(100.0, m + h) for m, h in zip(means, halves)], color=line.get_color(), alpha=0.2)
        ax.plot([r.best_lr], [r.test_mean], marker="*", markersize=14, color=line.get_color())
    ax.set_xscale("log")
    ax.set_xlabel("fine-tuning learning rate")
    ax.set_ylabel(f"test {results[0].metric}")
    ax.set_title(f"{task}: test mean ± {CONFIDENCE:.0%} CI over seeds (★ best validation LR)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    plt.close(fig)
    return buffer.getvalue()


def write_outputs(output_dir: Path, results: Sequence[TaskResult], lrs: Sequence[float], seeds: Sequence[int],
                  rankings: Mapping[str, Sequence[RankedSystem]]) -> None:
    """``summary.{json,md,csv}`` and ``plots/<task>.png`` of ``results`` ranked by :func:`rank_models`."""
    rows = [r.to_json() for r in results]
    summary = {"lrs": list(lrs), "seeds": list(seeds), "confidence": CONFIDENCE, "diverged_score": DIVERGED_SCORE,
               "selection": "best LR = argmax of the mean validation score over seeds; test at that LR",
               "results": rows,
               "rankings": {task: [dataclasses.asdict(ranked) for ranked in ranked_systems]
                            for task, ranked_systems in rankings.items()}}
    write_atomic(output_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    write_atomic(output_dir / "summary.md", summary_markdown(results, lrs, seeds, rankings))
    table = io.StringIO()
    writer = csv.DictWriter(table, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(output_dir / "summary.csv", table.getvalue())
    for task in dict.fromkeys(r.task for r in results):
        write_atomic(output_dir / "plots" / f"{task}.png", plot_task([r for r in results if r.task == task], task))


# ----------------------------------------------------------------------------- entry point


def evaluate_models(models: Sequence[str], tasks: Sequence[str], *, output_dir: str | Path,
                    lrs: Sequence[float] = PAPER_LR_GRID, seeds: Sequence[int] = PAPER_SEEDS,
                    overrides: Mapping[str, Any] | None = None, suite_dir: str | Path | None = None,
                    benchmarks_dir: str | Path | None = None) -> Evaluation:
    """Fine-tune every model on every task at every LR and seed, then aggregate and write reports.

    Args:
        models: HF encoder directories or Megatron checkpoints, each ``PATH`` or ``NAME=PATH``.
        tasks: Names in :data:`~megatron_ext.eval.suite.TASKS`, benchmarks in
            :data:`~megatron_ext.eval.benchmarks.BENCHMARKS` (``paper``: the paper's twelve), or task
            directories with ``task.json``.
        output_dir: Receives ``runs/``, ``exported/``, the summaries and plots (module docstring).
        lrs: Fine-tuning learning rates (default: the paper's grid).
        seeds: Seeds per LR (default: the paper's five).
        overrides: :class:`FinetuneConfig` fields other than ``lr``/``seed`` (``max_steps``,
            ``batch_size``, ``max_eval_examples``, ``device`` ...). Setting ``max_steps`` or
            ``epochs`` also replaces token classification's one-epoch default.
        suite_dir: Where suite tasks are (built when absent) and benchmarks are converted to; default
            ``<data dir>/eval_suite``.
        benchmarks_dir: Local copies of the benchmarks' hub datasets (``tools/fetch_benchmarks.py``);
            None: the hub (or its cache with ``HF_HUB_OFFLINE=1``).
    """
    from tqdm import tqdm

    if not models or not tasks or not lrs or not seeds:
        raise UserError("models, tasks, lrs and seeds must each be non-empty")
    if len(set(lrs)) != len(lrs) or len(set(seeds)) != len(seeds):
        raise UserError(f"lrs {list(lrs)} and seeds {list(seeds)} must not repeat values")
    output_dir = Path(output_dir)
    overrides = dict(overrides or {})
    task_refs = resolve_tasks(tasks, suite_dir, benchmarks_dir)
    configs = {(task.name, lr, seed): finetune_config(task.family, lr, seed, overrides)
               for task in task_refs for lr in lrs for seed in seeds}  # refused before any export
    model_refs = resolve_models(models, output_dir)
    specs = {(model.name, task.name, lr, seed): RunSpec(model=model, task=task, config=configs[task.name, lr, seed],
                                                        path=run_path(output_dir, model.name, task.name, lr, seed))
             for model in model_refs for task in task_refs for lr in lrs for seed in seeds}
    runs = _Runs(specs, _shared_runs(task_refs))
    results = []
    with tqdm(total=len(specs), desc="evaluate", unit="run") as bar:
        for model in model_refs:
            for task in task_refs:
                records = []
                for lr in lrs:
                    for seed in seeds:
                        records.append(runs.record(specs[model.name, task.name, lr, seed], log=bar.write))
                        bar.update()
                results.append(aggregate(records, lrs, task))
    if runs.reused:
        print(f"reused {runs.reused} finished run(s) from {output_dir / 'runs'}", flush=True)
    results, rankings = rank_models(results)
    write_outputs(output_dir, results, lrs, seeds, rankings)
    return Evaluation(results=tuple(results), executed=runs.executed, reused=runs.reused, output_dir=output_dir)
