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
vanishing from the curve. Zero-shot families (STS: :data:`~.families.ZERO_SHOT_FAMILIES`) train
nothing: their tasks get one run per model (:func:`~.families.grid`), whose test score is reported
as it is.

With several models, each task also ranks them as the paper does: on the test examples' own
scores (each run saves them), averaged over the best LR's seeds, with paired tests between models
(:mod:`.ranking`); models that no test separates share a rank.

Models are Hugging Face encoder directories or Megatron checkpoints (a save directory or one
``iter_*``; several checkpoints of a save directory as models ``NAME@STEP``), which are exported to
EuroBERT once. Runs are resumable: a finished run's JSON is reused, after checking it was made with
the same config and model.

Workers share a grid: the same call in N processes (or N tasks of a SLURM job array) on one
``output_dir`` does each run once. A worker claims a :class:`GridUnit` (a run, or the runs sharing
one training) before fine-tuning it, through a claim file with a heartbeat (:mod:`megatron_ext.claims`); a dead
worker's claim expires and is taken over; exports are claimed the same way. A worker returns when
nothing is left to claim, and whichever finds every run recorded writes the summary (the same
files whoever writes them; ``summary_only`` writes one from the runs present).

Layout of ``output_dir``::

    exported/<model>/, exported/<model>.json    export of a checkpoint model, and its source
    runs/<model>/<task>/lr<lr>_seed<seed>.json  one run: config, scores (and each example's), steps, time,
                                                losses, the worker that ran it
    runs/<model>/<task>/lr<lr>_seed<seed>.claim-<n>, exported/<model>.claim-<n>
                                                a worker's claim while it runs it (deleted once done)
    summary.json, summary.md, summary.csv       one row per model x task, plus the LR curves and rankings
    plots/<task>.png                            score vs LR, one line per model, CI bands
    plots/tokens/<task>.png                     score vs pretraining tokens, for models with several checkpoints
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
import json
import math
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from megatron_ext.config_loading import UserError
from megatron_ext.fileio import write_atomic
from megatron_ext.claims import Claim, ClaimPolicy, Holder, Owner, try_claim
from megatron_ext.eval.benchmarks import BENCHMARKS, TASK_GROUPS, expand_tasks, prepare_benchmarks
from megatron_ext.eval.families import (
    FAMILIES,
    FAMILY_DEFAULTS,
    ZERO_SHOT_FAMILIES,
    grid,
    run_shared,
    shared_training_key,
    splits_read,
)
from megatron_ext.eval.protocol import PAPER_LR_GRID, PAPER_SEEDS, FinetuneConfig, RunResult
from megatron_ext.eval.ranking import RankedSystem, format_ranking, rank_systems
from megatron_ext.training.step_log import duration
from megatron_ext.eval.task_io import TASK_FILE, default_suite_dir, load_task
from megatron_ext.eval.suite import TASKS, build_task

if TYPE_CHECKING:
    from megatron_ext.checkpoint.handle import Checkpoint

CONFIDENCE = 0.95
"""Level of the confidence interval over seeds."""
DIVERGED_SCORE = 0.0
"""Validation and test score given to a diverged run."""
_NAME = re.compile(r"^[\w.+-]+$")
_SELECTION = re.compile(r"^(all|\d+(,\d+)*)$")
"""What may follow a save directory's ``@``: ``all``, or steps separated by commas."""


@dataclass(frozen=True, kw_only=True)
class ModelRef:
    """A model to evaluate."""

    name: str
    """Directory name under ``runs/`` and label in reports (``NAME`` or ``NAME@STEP``)."""
    hf_dir: Path
    """Hugging Face directory the families load."""
    source: str
    """What was given: the HF directory, or the checkpoint exported into ``hf_dir``."""
    base_model: str
    """The name given (``NAME`` of ``NAME=PATH``): a save directory's checkpoints picked with
    ``@all`` or ``@STEPS`` are the models ``NAME@STEP`` of one base model; otherwise ``name``."""
    checkpoint_step: int | None
    """The training step of a Megatron checkpoint; None for a Hugging Face directory."""
    pretrain_tokens: int | None
    """Tokens pretrained up to ``checkpoint_step``: step x global batch size x sequence length of
    the checkpoint's ``run_config.json``; None for a Hugging Face directory or a checkpoint saved
    without a data section (an import)."""


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
    worker: str | None = None
    """``host:pid`` of the worker that fine-tuned it (:attr:`megatron_ext.claims.Owner.label`); None in files
    written before workers shared a grid."""

    @classmethod
    def finished(cls, spec: RunSpec, result: RunResult, worker: str) -> RunRecord:
        return cls(spec=spec, status="ok", metric=result.metric, validation=result.validation, test=result.test,
                   steps=result.steps, seconds=result.seconds, extra=result.extra, per_example=result.per_example,
                   losses=LossSummary.of(result.losses), worker=worker)

    @classmethod
    def diverged(cls, spec: RunSpec, error: FloatingPointError, seconds: float, worker: str) -> RunRecord:
        return cls(spec=spec, status="diverged", error=str(error), metric=None, validation=DIVERGED_SCORE,
                   test=DIVERGED_SCORE, steps=None, seconds=seconds, extra={}, per_example=None, losses=None,
                   worker=worker)

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
                   losses=None if losses is None else LossSummary(**losses), worker=data.get("worker"))

    def to_json(self) -> dict[str, Any]:
        """The run's file: which run it is (model, task, LR, seed, config), then how it went."""
        spec = self.spec
        record = {"model": spec.model.name, "model_source": spec.model.source, "model_dir": str(spec.model.hf_dir),
                  "task": spec.task.name, "task_dir": str(spec.task.task_dir), "family": spec.task.family,
                  "lr": spec.lr, "seed": spec.seed, "config": dataclasses.asdict(spec.config), "status": self.status,
                  "error": self.error, "metric": self.metric, "validation": self.validation, "test": self.test,
                  "steps": self.steps, "seconds": self.seconds, "worker": self.worker, "extra": self.extra,
                  "per_example": self.per_example,
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
    base_model: str
    checkpoint_step: int | None
    pretrain_tokens: int | None
    """:class:`ModelRef`'s, for the score against pretraining tokens."""
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


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    """What :func:`evaluate_models` did."""

    results: tuple[TaskResult, ...]
    """One per (model, task) with runs, ranked: ``summary.json``'s ``results``; empty when this
    worker left runs to others (the summary is theirs to write)."""
    executed: int
    """Runs fine-tuned by this call."""
    reused: int
    """Runs already finished when this call began, read back from ``runs/``."""
    by_others: int
    """Runs other workers finished while this call ran."""
    missing: tuple[RunSpec, ...]
    """Runs without a record at the end: held by other workers (or, with ``summary_only``, not run yet)."""
    summary_written: bool
    """Whether this call wrote ``summary.*`` (every run exists, or ``summary_only``)."""
    output_dir: Path


# ----------------------------------------------------------------------------- inputs


def _split_name(spec: str) -> tuple[str | None, str]:
    name, sep, path = spec.partition("=")
    return (name, path) if sep and _NAME.match(name) else (None, spec)


def _split_selection(path: str) -> tuple[str, str | None]:
    """``PATH@all`` or ``PATH@STEP[,STEP...]`` -> (PATH, what follows the ``@``); anything else
    (an existing directory whose name has an ``@`` included) -> (path, None)."""
    head, sep, tail = path.rpartition("@")
    if not sep or Path(path).is_dir() or not _SELECTION.match(tail):
        return path, None
    return head, tail


def _selected_checkpoints(spec: str, save_dir: Path, selection: str) -> list[Checkpoint]:
    """The checkpoints of ``save_dir`` that ``selection`` (``all`` or ``STEP,STEP``) names, by step."""
    from megatron_ext.checkpoint.handle import Checkpoint

    found = Checkpoint.every(save_dir)
    if not found:
        raise UserError(f"model {spec!r}: @{selection} picks checkpoints of a save directory, and {save_dir} "
                        "holds no complete iter_* checkpoint")
    if selection == "all":
        return found
    steps = [int(step) for step in selection.split(",")]
    repeated = sorted({step for step in steps if steps.count(step) > 1})
    if repeated:
        raise UserError(f"model {spec!r}: step(s) {', '.join(map(str, repeated))} given twice")
    by_step = {checkpoint.step: checkpoint for checkpoint in found}
    absent = [step for step in steps if step not in by_step]
    if absent:
        raise UserError(f"model {spec!r}: {save_dir} has no complete checkpoint at step(s) "
                        f"{', '.join(map(str, absent))}; it has step(s) {', '.join(map(str, by_step))}")
    return [by_step[step] for step in sorted(steps)]


def pretrain_tokens(checkpoint: Checkpoint) -> int | None:
    """Tokens seen up to ``checkpoint``: its step x global batch size x sequence length (its
    ``run_config.json``'s data section); None without one (an imported Hugging Face model)."""
    data = checkpoint.run_config().get("data") or {}
    if "global_batch_size" not in data or "seq_length" not in data:
        return None
    return checkpoint.step * int(data["global_batch_size"]) * int(data["seq_length"])


def resolve_models(models: Sequence[str], output_dir: Path, *, export: bool = True,
                   claims: ClaimPolicy = ClaimPolicy(), owner: Owner | None = None) -> list[ModelRef]:
    """HF directories as they are; Megatron checkpoints exported to ``output_dir/exported/<name>``
    (with ``export``, else only named: :func:`export_models`).

    Each entry is ``PATH`` or ``NAME=PATH``; the name defaults to the path's last component. A
    save directory stands for its newest checkpoint; ``PATH@all`` for each of its complete
    checkpoints and ``PATH@STEP,STEP,...`` for those steps (each must exist), as models
    ``NAME@STEP``.
    """
    from megatron_ext.checkpoint.handle import Checkpoint

    refs: list[ModelRef] = []
    bases: set[str] = set()
    for spec in models:
        name, path = _split_name(spec)
        path, selection = _split_selection(path)
        path = Path(path)
        name = name or path.resolve().name
        if not _NAME.match(name):
            raise UserError(f"model {spec!r}: name {name!r} must be letters, digits, '.', '+', '-' or '_'")
        if name in bases:
            raise UserError(f"two models are named {name!r}; name them with NAME=PATH")
        bases.add(name)
        if not path.is_dir():
            raise UserError(f"model {spec!r}: {path} is not a directory")
        if selection is not None:
            named = [(f"{name}@{checkpoint.step}", checkpoint)
                     for checkpoint in _selected_checkpoints(spec, path, selection)]
        else:
            checkpoint = Checkpoint.latest(path)
            named = [(name, checkpoint)] if checkpoint is not None else []
        for model_name, checkpoint in named:
            refs.append(ModelRef(name=model_name, hf_dir=output_dir / "exported" / model_name,
                                 source=str(checkpoint.path.resolve()), base_model=name,
                                 checkpoint_step=checkpoint.step, pretrain_tokens=pretrain_tokens(checkpoint)))
        if named:
            continue
        if not (path / "config.json").is_file():
            raise UserError(f"model {spec!r}: {path} is neither a Hugging Face model directory (no config.json) "
                            "nor a Megatron checkpoint (no complete iter_* checkpoint)")
        refs.append(ModelRef(name=name, hf_dir=path.resolve(), source=str(path.resolve()), base_model=name,
                             checkpoint_step=None, pretrain_tokens=None))
    if export:
        export_models(refs, output_dir, claims=claims, owner=owner or Owner.this_process())
    return refs


def _exported(model: ModelRef, output_dir: Path) -> bool:
    """Whether ``exported/<name>`` holds the export of ``model``'s checkpoint (its marker says so)."""
    marker = output_dir / "exported" / f"{model.name}.json"
    return (marker.is_file() and json.loads(marker.read_text())["checkpoint"] == model.source
            and model.hf_dir.is_dir())


def export_models(models: Sequence[ModelRef], output_dir: Path, *, claims: ClaimPolicy, owner: Owner) -> None:
    """Export each checkpoint model not exported yet, once among the workers sharing ``output_dir``:
    a worker claims an export (:mod:`megatron_ext.claims`) before doing it; exports others hold are waited for
    (or taken over when their claim expires)."""
    from megatron_ext.hf import export_checkpoint

    pending = [model for model in models if model.checkpoint_step is not None]
    announced: set[str] = set()
    while pending:
        held = []
        for model in pending:
            if _exported(model, output_dir):
                continue
            got = try_claim(output_dir / "exported" / model.name, owner=owner, policy=claims)
            if isinstance(got, Holder):
                held.append(model)
                if model.name not in announced:
                    print(f"export {model.name}: waiting for {got.describe()}", flush=True)
                    announced.add(model.name)
                continue
            with got:
                if not _exported(model, output_dir):
                    export_checkpoint(model.source, model.hf_dir, overwrite=True,
                                      log=lambda line, name=model.name: print(f"export {name}: {line}", flush=True))
                    write_atomic(output_dir / "exported" / f"{model.name}.json",
                                 json.dumps({"checkpoint": model.source}, indent=2) + "\n")
                got.finish()
        if held:
            time.sleep(claims.heartbeat_s)
        pending = held


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
        for split in splits_read(family, task_dir):
            load_task(task_dir, split)
        refs.append(TaskRef(name=name, task_dir=task_dir.resolve(), family=family, metric=meta.get("metric", "")))
    return refs


def finetune_config(family: str, lr: float, seed: int, overrides: Mapping[str, Any]) -> FinetuneConfig:
    """The run's config: the family's defaults unless ``overrides`` set the run length, then ``overrides``."""
    fields = {f.name for f in dataclasses.fields(FinetuneConfig)} - {"lr", "seed"}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise UserError(f"unknown FinetuneConfig override(s) {unknown}; expected some of {sorted(fields)}")
    if lr <= 0 and family not in ZERO_SHOT_FAMILIES:
        raise UserError(f"fine-tuning LRs must be > 0, got {lr:g}")
    sets_length = "max_steps" in overrides or "epochs" in overrides
    defaults = {} if sets_length else FAMILY_DEFAULTS.get(family, {})
    return FinetuneConfig(**{**defaults, **overrides}, lr=lr, seed=seed)


def run_path(output_dir: Path, model: str, task: str, lr: float, seed: int) -> Path:
    return output_dir / "runs" / model / task / f"lr{lr:g}_seed{seed}.json"


# ----------------------------------------------------------------------------- runs


def _run(specs: Sequence[RunSpec], worker: str) -> list[RunRecord]:
    """Fine-tune once for ``specs``: one run, or the runs of tasks that share their training (same
    model, LR and seed; :func:`_shared_runs`); the record of each, made by ``worker``."""
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
        return [RunRecord.diverged(spec, error, seconds, worker) for spec in specs]
    return [RunRecord.finished(spec, result, worker) for spec, result in zip(specs, results, strict=True)]


@dataclass(frozen=True, kw_only=True)
class GridUnit:
    """What one worker fine-tunes at once, under one claim: a run, or the runs of the tasks that
    share its training (same model, LR and seed; :func:`_shared_runs`)."""

    specs: tuple[RunSpec, ...]

    @property
    def claim_base(self) -> Path:
        """Its claim files are ``<this>.claim-<generation>``: beside the record of its task first
        by name (the same whatever order ``--tasks`` gives)."""
        return min(self.specs, key=lambda spec: spec.task.name).path.with_suffix("")

    def pending(self) -> list[RunSpec]:
        """Its runs without a record yet."""
        return [spec for spec in self.specs if not spec.path.is_file()]

    def describe(self) -> str:
        first = self.specs[0]
        return (f"{first.model.name} {'+'.join(spec.task.name for spec in self.specs)} "
                f"lr={first.lr:g} seed={first.seed}")


def grid_units(specs: Mapping[tuple[str, str, float, int], RunSpec],
               shared: Mapping[str, list[TaskRef]]) -> list[GridUnit]:
    """The grid's units in the order of ``specs`` (model, task, LR, seed): a run's unit comes where
    its first task's run is."""
    units, seen = [], set()
    for (model, task, lr, seed), spec in specs.items():
        if spec not in seen:
            group = tuple(specs[model, other.name, lr, seed] for other in shared.get(task, [spec.task]))
            seen.update(group)
            units.append(GridUnit(specs=group))
    return units


class _Progress:
    """The line of each finished run: runs done of the grid by all workers, and the ETA at the
    rate they have been finishing since this worker started."""

    def __init__(self, specs: Sequence[RunSpec]):
        self.specs = specs
        self.started = time.monotonic()
        self.done_at_start = self.done()

    def done(self) -> int:
        return sum(spec.path.is_file() for spec in self.specs)

    def line(self, text: str) -> str:
        done = self.done()
        finished_since = done - self.done_at_start
        eta = (duration((len(self.specs) - done) * (time.monotonic() - self.started) / finished_since)
               if finished_since else "?")
        return f"[{done}/{len(self.specs)} runs done, ETA {eta}] {text}"


class GridWorker:
    """One worker of the grid: claims each unit without records (:mod:`megatron_ext.claims`), fine-tunes it and
    saves its records, pass after pass until a pass finds nothing to claim."""

    def __init__(self, units: Sequence[GridUnit], *, owner: Owner, claims: ClaimPolicy,
                 log: Callable[[str], None]):
        self.units = units
        self.owner = owner
        self.claims = claims
        self.log = log
        self.progress = _Progress([spec for unit in units for spec in unit.specs])
        self.executed = 0
        """Runs this worker fine-tuned and recorded."""

    def run(self) -> list[tuple[GridUnit, Holder]]:
        """Work until every unit has its records; returns the units other workers still hold (none
        unless their records vanished). A worker with nothing left to claim waits while others hold
        units, looking again every heartbeat: if a holder dies (on another node too), its claim
        expires and a waiting worker takes the unit over, and the last one writes the summary."""
        waiting = False
        while True:
            claimed, held = False, []
            for unit in self.units:
                if not unit.pending():
                    continue
                got = try_claim(unit.claim_base, owner=self.owner, policy=self.claims)
                if isinstance(got, Holder):
                    held.append((unit, got))
                    continue
                claimed, waiting = True, False
                with got:
                    self._fine_tune(unit, got)
            if claimed:
                continue
            if not held:
                return held
            if not waiting:
                self.log(f"nothing left to claim; waiting for {len(held)} unit(s) other workers hold (taken over if "
                         f"a holder stops its heartbeat for {self.claims.timeout_s:g} s)")
                waiting = True
            time.sleep(self.claims.heartbeat_s)

    def _fine_tune(self, unit: GridUnit, claim: Claim) -> None:
        pending = unit.pending()  # another worker may have finished it since we looked
        if not pending:
            claim.finish()
            return
        if claim.taken_from is not None:
            self.log(f"{unit.describe()}: taking over the expired claim of {claim.taken_from.describe()}")
        first = pending[0]
        if len(pending) > 1:
            self.log(f"{first.model.name} lr={first.lr:g} seed={first.seed}: one training for "
                     f"{', '.join(spec.task.name for spec in pending)}")
        records = _run(pending, self.owner.label)
        if not claim.held():
            self.log(f"{unit.describe()}: another worker took this claim over (this worker's heartbeat "
                     "lapsed past --claim-timeout); its result is discarded")
            return
        for record in records:
            record.save()
            self.executed += 1
            self.log(self.progress.line(record.describe()))
        claim.finish()


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


# ----------------------------------------------------------------------------- outputs


def best_lr_label(result: TaskResult) -> str:
    """The best LR as reports print it: ``zero-shot`` for a family that trains nothing."""
    return "zero-shot" if result.family in ZERO_SHOT_FAMILIES else f"{result.best_lr:g}"


def _pm(mean: float, ci: float | None) -> str:
    return f"{mean:.2f} ± {ci:.2f}" if ci is not None else f"{mean:.2f}"


def _std(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def _tokens(count: int | None) -> str:
    """``2.15B``, ``86M``: a token count at a glance ("" when unknown)."""
    if count is None:
        return ""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{suffix}"
    return str(count)


CSV_COLUMNS = ("model", "base_model", "checkpoint_step", "pretrain_tokens", "task", "family", "metric", "best_lr",
               "test_mean", "test_ci95", "validation_mean", "validation_std", "test_std", "seeds", "diverged_runs",
               "runs", "rank")


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


def _tokens_section(results: Sequence[TaskResult]) -> list[str]:
    """``summary.md``'s score against pretraining tokens: a table per base model (a row per
    checkpoint, a column per task), and per task a plot of the base models with several checkpoints."""
    series = checkpoint_series(results)
    if not series:
        return []
    tasks = list(dict.fromkeys(r.task for r in results))
    lines = ["", "## Score vs pretraining tokens", "",
             "Test mean ± CI at each checkpoint's best LR; pretraining tokens = step x global batch size x "
             "sequence length of the checkpoint's run config."]
    for base, rows in series.items():
        by_model: dict[str, dict[str, TaskResult]] = {}
        for r in rows:
            by_model.setdefault(r.model, {})[r.task] = r
        lines += ["", f"### {base}", "", "| step | pretraining tokens | " + " | ".join(tasks) + " |",
                  "|---|---|" + "---|" * len(tasks)]
        for cells in by_model.values():
            first = next(iter(cells.values()))
            lines.append(f"| {first.checkpoint_step} | {_tokens(first.pretrain_tokens)} | " + " | ".join(
                _pm(cells[t].test_mean, cells[t].test_ci95) if t in cells else "" for t in tasks) + " |")
    lines.append("")
    lines += [f"![{task} vs pretraining tokens](plots/tokens/{task}.png)" for task in _tokens_plot_tasks(results)]
    return lines


def _tokens_plot_tasks(results: Sequence[TaskResult]) -> list[str]:
    """Tasks with a base model scored at two checkpoints or more (a score-vs-tokens line)."""
    series = checkpoint_series(results)
    return [task for task in dict.fromkeys(r.task for r in results)
            if any(len([r for r in rows if r.task == task and r.pretrain_tokens is not None]) >= 2
                   for rows in series.values())]


def _zero_shot_note(results: Sequence[TaskResult]) -> list[str]:
    tasks = list(dict.fromkeys(r.task for r in results if r.family in ZERO_SHOT_FAMILIES))
    if not tasks:
        return []
    return [f"Zero-shot tasks ({', '.join(tasks)}; not the paper's): nothing is fine-tuned, so each model has one "
            "run, without LR or seeds, and no confidence interval; STS scores are Spearman's correlation x 100 "
            "(-100 to 100) of the embeddings' cosine similarities with the gold ratings.", ""]


def _missing_note(missing: Sequence[RunSpec], total: int) -> list[str]:
    if not missing:
        return []
    listed = [f"{spec.model.name} {spec.task.name} lr={spec.lr:g} seed={spec.seed}" for spec in missing[:20]]
    return [f"**Incomplete:** {len(missing)} of {total} runs have no record yet (written with --summary-only); "
            f"the scores are over the runs present. Missing: {'; '.join(listed)}"
            + (" ..." if len(missing) > len(listed) else "") + ".", ""]


def summary_markdown(results: Sequence[TaskResult], lrs: Sequence[float], seeds: Sequence[int],
                     rankings: Mapping[str, Sequence[RankedSystem]] | None = None,
                     missing: Sequence[RunSpec] = ()) -> str:
    """``summary.md``: the model x task table, the scores against pretraining tokens (several
    checkpoints of a model), then each task's ranking, score-vs-LR table and plot."""
    rankings = rankings or {}
    diverged, runs = sum(r.diverged_runs for r in results), sum(r.runs for r in results)
    lines = [
        "# Fine-tuning evaluation", "",
        f"LR grid {', '.join(f'{lr:g}' for lr in lrs)}; seeds {', '.join(map(str, seeds))}. The best LR maximises "
        f"the mean validation score; test is the mean ± {CONFIDENCE:.0%} confidence half-width over seeds at that LR "
        f"(Student t). Diverged runs (non-finite training loss) count as score {DIVERGED_SCORE:g}: "
        f"{diverged} of {runs} runs.", "",
        *_zero_shot_note(results),
        *_missing_note(missing, runs + len(missing)),
        "| model | task | metric | best LR | test (mean ± CI) | validation mean | seed std (validation / test) "
        "| diverged runs | rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r.model} | {r.task} | {r.metric} | {best_lr_label(r)} | {_pm(r.test_mean, r.test_ci95)} | "
                     f"{r.validation_mean:.2f} | {_std(r.validation_std)} / {_std(r.test_std)} | "
                     f"{r.diverged_runs} | {'' if r.rank is None else r.rank} |")
    lines += _tokens_section(results)
    for task in dict.fromkeys(r.task for r in results):
        if task in rankings:
            lines += ["", f"## {task}: ranking", "",
                      "On the test examples' scores at each model's best LR (mean over seeds); paired "
                      "permutation tests, p < 0.05 opens a new rank.", "", format_ranking(rankings[task]).rstrip()]
        if all(r.family in ZERO_SHOT_FAMILIES for r in results if r.task == task):
            continue  # one zero-shot run per model: no LR to plot against
        lines += ["", f"## {task}: score vs learning rate", "",
                  "Test mean ± CI (validation mean); a † marks diverged seeds.", "",
                  "| model | " + " | ".join(f"{lr:g}" for lr in lrs) + " |", "|---|" + "---|" * len(lrs)]
        for r in (r for r in results if r.task == task):
            points = {p.lr: p for p in r.lr_curve}
            cells = [f"{_pm(p.test_mean, p.test_ci95)} ({p.validation_mean:.2f})" + " †" * p.diverged
                     if (p := points.get(lr)) else "" for lr in lrs]
            lines.append(f"| {r.model} | " + " | ".join(cells) + " |")
        lines += ["", f"![{task}](plots/{task}.png)"]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True, kw_only=True)
class _Line:
    """One line of a score plot, with its CI band and, optionally, a starred point."""

    label: str
    x: list[float]
    mean: list[float]
    ci: list[float | None]
    star: tuple[float, float] | None = None


def _plot(lines: Sequence[_Line], *, xlabel: str, ylabel: str, title: str, log_x: bool) -> bytes:
    """PNG of score lines, each with its CI band drawn within the metric's 0-100 range (few seeds
    give wide intervals)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for line in lines:
        halves = [half or 0.0 for half in line.ci]
        (drawn,) = ax.plot(line.x, line.mean, marker="o", label=line.label)
        ax.fill_between(line.x, [max(0.0, m - h) for m, h in zip(line.mean, halves)],
                        [min(100.0, m + h) for m, h in zip(line.mean, halves)], color=drawn.get_color(), alpha=0.2)
        if line.star is not None:
            ax.plot(*line.star, marker="*", markersize=14, color=drawn.get_color())
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    plt.close(fig)
    return buffer.getvalue()


def plot_task(results: Sequence[TaskResult], task: str) -> bytes:
    """PNG of test score vs LR (log x) for one task: a line per model, its CI band, the best LR starred."""
    lines = [_Line(label=r.model, x=[p.lr for p in r.lr_curve], mean=[p.test_mean for p in r.lr_curve],
                   ci=[p.test_ci95 for p in r.lr_curve], star=(r.best_lr, r.test_mean)) for r in results]
    return _plot(lines, xlabel="fine-tuning learning rate", ylabel=f"test {results[0].metric}", log_x=True,
                 title=f"{task}: test mean ± {CONFIDENCE:.0%} CI over seeds (★ best validation LR)")


def plot_tokens(results: Sequence[TaskResult], task: str) -> bytes:
    """PNG of test score (at the best LR) vs pretraining tokens for one task: a line per base model
    with two checkpoints or more, its CI band."""
    lines = []
    for base, rows in checkpoint_series(results).items():
        points = [r for r in rows if r.task == task and r.pretrain_tokens is not None]
        if len(points) >= 2:
            lines.append(_Line(label=base, x=[r.pretrain_tokens for r in points], mean=[r.test_mean for r in points],
                               ci=[r.test_ci95 for r in points]))
    metric = next(r.metric for r in results if r.task == task)
    return _plot(lines, xlabel="pretraining tokens", ylabel=f"test {metric}", log_x=False,
                 title=f"{task}: test mean ± {CONFIDENCE:.0%} CI at the best LR, by checkpoint")


def write_outputs(output_dir: Path, results: Sequence[TaskResult], lrs: Sequence[float], seeds: Sequence[int],
                  rankings: Mapping[str, Sequence[RankedSystem]], missing: Sequence[RunSpec] = ()) -> None:
    """``summary.{json,md,csv}``, ``plots/<task>.png`` and, for models with several checkpoints,
    ``plots/tokens/<task>.png`` of ``results`` ranked by :func:`rank_models`; ``missing``: runs
    without a record (a summary written on demand before the grid is complete)."""
    rows = [r.to_json() for r in results]
    summary = {"lrs": list(lrs), "seeds": list(seeds), "confidence": CONFIDENCE, "diverged_score": DIVERGED_SCORE,
               "selection": "best LR = argmax of the mean validation score over seeds; test at that LR",
               "missing_runs": [str(spec.path.relative_to(output_dir)) for spec in missing],
               "results": rows,
               "rankings": {task: [dataclasses.asdict(ranked) for ranked in ranked_systems]
                            for task, ranked_systems in rankings.items()}}
    write_atomic(output_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    write_atomic(output_dir / "summary.md", summary_markdown(results, lrs, seeds, rankings, missing))
    table = io.StringIO()
    writer = csv.DictWriter(table, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(output_dir / "summary.csv", table.getvalue())
    for task in dict.fromkeys(r.task for r in results if r.family not in ZERO_SHOT_FAMILIES):
        write_atomic(output_dir / "plots" / f"{task}.png", plot_task([r for r in results if r.task == task], task))
    for task in _tokens_plot_tasks(results):
        write_atomic(output_dir / "plots" / "tokens" / f"{task}.png", plot_tokens(results, task))


# ----------------------------------------------------------------------------- entry point


def evaluate_models(models: Sequence[str], tasks: Sequence[str], *, output_dir: str | Path,
                    lrs: Sequence[float] = PAPER_LR_GRID, seeds: Sequence[int] = PAPER_SEEDS,
                    overrides: Mapping[str, Any] | None = None, suite_dir: str | Path | None = None,
                    benchmarks_dir: str | Path | None = None, claims: ClaimPolicy = ClaimPolicy(),
                    summary_only: bool = False) -> Evaluation:
    """Fine-tune every model on every task at every LR and seed, then aggregate and write reports.

    Several processes (on one machine, or the tasks of a SLURM job array) may run this with the
    same arguments and ``output_dir``: each claims a run before fine-tuning it (:mod:`.claims`), so
    every run is done once; a worker with nothing left to claim waits for the runs others hold (and
    takes over those whose worker died), then writes the summary.

    Args:
        models: HF encoder directories or Megatron checkpoints, each ``PATH`` or ``NAME=PATH``; a
            save directory's checkpoints as ``PATH@all`` or ``PATH@STEP,STEP`` (:func:`resolve_models`).
        tasks: Names in :data:`~megatron_ext.eval.suite.TASKS`, benchmarks in
            :data:`~megatron_ext.eval.benchmarks.BENCHMARKS` (``paper``: the paper's twelve), or task
            directories with ``task.json``.
        output_dir: Receives ``runs/``, ``exported/``, the summaries and plots (module docstring).
        lrs: Fine-tuning learning rates (default: the paper's grid); zero-shot tasks run once (:func:`grid`).
        seeds: Seeds per LR (default: the paper's five).
        overrides: :class:`FinetuneConfig` fields other than ``lr``/``seed`` (``max_steps``,
            ``batch_size``, ``max_eval_examples``, ``device`` ...). Setting ``max_steps`` or
            ``epochs`` also replaces token classification's one-epoch default.
        suite_dir: Where suite tasks are (built when absent) and benchmarks are converted to; default
            ``<data dir>/eval_suite``.
        benchmarks_dir: Local copies of the benchmarks' hub datasets (``tools/fetch_benchmarks.py``);
            None: the hub (or its cache with ``HF_HUB_OFFLINE=1``).
        claims: When another worker's claim has expired (``--claim-timeout``).
        summary_only: Fine-tune nothing: write the summary from the runs recorded so far, listing
            the missing ones.
    """
    if not models or not tasks or not lrs or not seeds:
        raise UserError("models, tasks, lrs and seeds must each be non-empty")
    if len(set(lrs)) != len(lrs) or len(set(seeds)) != len(seeds):
        raise UserError(f"lrs {list(lrs)} and seeds {list(seeds)} must not repeat values")
    output_dir = Path(output_dir)
    overrides = dict(overrides or {})
    owner = Owner.this_process()
    task_refs = resolve_tasks(tasks, suite_dir, benchmarks_dir)
    task_grids = {task.name: grid(task.family, lrs, seeds) for task in task_refs}
    configs = {(task.name, lr, seed): finetune_config(task.family, lr, seed, overrides)
               for task in task_refs for lr in task_grids[task.name][0]
               for seed in task_grids[task.name][1]}  # refused before any export
    model_refs = resolve_models(models, output_dir, export=False)
    specs = {(model.name, task.name, lr, seed): RunSpec(model=model, task=task, config=configs[task.name, lr, seed],
                                                        path=run_path(output_dir, model.name, task.name, lr, seed))
             for model in model_refs for task in task_refs for (name, lr, seed) in configs if name == task.name}
    # Every finished run is read (and refused if made with another model or config) before any work.
    records = {spec: RunRecord.read(spec) for spec in specs.values()}
    reused = sum(record is not None for record in records.values())
    executed, held = 0, []
    if not summary_only:
        unfinished = {spec.model.name for spec, record in records.items() if record is None}
        export_models([model for model in model_refs if model.name in unfinished], output_dir, claims=claims,
                      owner=owner)
        worker = GridWorker(grid_units(specs, _shared_runs(task_refs)), owner=owner, claims=claims,
                            log=lambda line: print(line, flush=True))
        held = worker.run()
        executed = worker.executed
        records = {spec: record or RunRecord.read(spec) for spec, record in records.items()}
        if reused:
            print(f"reused {reused} finished run(s) from {output_dir / 'runs'}", flush=True)
    missing = tuple(spec for spec, record in records.items() if record is None)
    done = functools.partial(Evaluation, executed=executed, reused=reused, missing=missing, output_dir=output_dir,
                             by_others=len(specs) - len(missing) - reused - executed)
    if missing and not summary_only:
        holders = "; ".join(f"{unit.describe()} ({holder.describe()})" for unit, holder in held[:5])
        print(f"{len(missing)} of {len(specs)} run(s) have no record yet, held by other workers: {holders}"
              f"{' ...' if len(held) > 5 else ''}. The last worker to finish writes the summary; --summary-only "
              "writes one from the runs present, and rerunning this command takes over claims that expired "
              f"(no heartbeat for {claims.timeout_s:g} s, or a dead process on this host).", flush=True)
        return done(results=(), summary_written=False)
    results = []
    for model in model_refs:
        for task in task_refs:
            task_lrs, task_seeds = task_grids[task.name]
            present = [records[specs[model.name, task.name, lr, seed]] for lr in task_lrs for seed in task_seeds]
            present = [record for record in present if record is not None]
            if present:
                results.append(aggregate(present, task_lrs, task))
    results, rankings = rank_models(results)
    write_outputs(output_dir, results, lrs, seeds, rankings, missing)
    return done(results=tuple(results), summary_written=True)
