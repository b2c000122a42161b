"""The evaluation grid: one run per (model, task, LR, seed), its record, and the workers that share the grid.

A :class:`RunSpec` is one run of a model (:class:`ModelRef`) on a task (:class:`TaskRef`) through
the task family's ``run`` (:mod:`.families`) under the shared protocol (:mod:`.finetuning`); once
done it is a :class:`RunRecord`, saved to ``runs/<model>/<task>/lr<lr>_seed<seed>.json``
(:func:`run_path`). A run whose loss turns non-finite is recorded as ``diverged`` and scored
:data:`DIVERGED_SCORE`. Zero-shot families train nothing: their tasks get one run per model
(:meth:`~megatron_ext.eval.family.Family.grid`).

Workers share a grid: the same call in N processes (or N tasks of a SLURM job array) on one
output directory does each run once. A :class:`GridWorker` claims a :class:`GridUnit` (a run, or
the runs of the tasks that share one training: retrieval tasks with the same training pairs, as in
the paper) before fine-tuning it, through a claim file with a heartbeat (:mod:`megatron_ext.claims`);
a dead worker's claim expires and is taken over.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from megatron_ext.claims import Claim, ClaimPolicy, Holder, Owner, try_claim
from megatron_ext.config_loading import UserError
from megatron_ext.eval.families import FAMILIES
from megatron_ext.eval.finetuning import FinetuneConfig, RunResult
from megatron_ext.fileio import write_atomic
from megatron_ext.progress import duration

DIVERGED_SCORE = 0.0
"""Validation and test score given to a diverged run."""


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
    """Key of :data:`~megatron_ext.eval.families.FAMILIES`."""
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
        return cls.from_json(spec, data)

    @classmethod
    def from_json(cls, spec: RunSpec, data: Mapping[str, Any]) -> RunRecord:
        """The record of ``spec`` in ``data`` (:meth:`to_json`), as it is: :meth:`read` checks it first."""
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



def finetune_config(family: str, lr: float, seed: int, overrides: Mapping[str, Any]) -> FinetuneConfig:
    """The run's config: the family's defaults unless ``overrides`` set the run length, then ``overrides``."""
    fields = {f.name for f in dataclasses.fields(FinetuneConfig)} - {"lr", "seed"}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise UserError(f"unknown FinetuneConfig override(s) {unknown}; expected some of {sorted(fields)}")
    if lr <= 0 and not FAMILIES[family].zero_shot:
        raise UserError(f"fine-tuning LRs must be > 0, got {lr:g}")
    sets_length = "max_steps" in overrides or "epochs" in overrides
    defaults = {} if sets_length else FAMILIES[family].defaults
    return FinetuneConfig(**{**defaults, **overrides}, lr=lr, seed=seed)


def run_path(output_dir: Path, model: str, task: str, lr: float, seed: int) -> Path:
    return output_dir / "runs" / model / task / f"lr{lr:g}_seed{seed}.json"




def _run(specs: Sequence[RunSpec], worker: str) -> list[RunRecord]:
    """Fine-tune once for ``specs``: one run, or the runs of tasks that share their training (same
    model, LR and seed; :func:`shared_runs`); the record of each, made by ``worker``."""
    first = specs[0]
    family = FAMILIES[first.task.family]
    model_dir = str(first.model.hf_dir)
    started = time.perf_counter()
    try:
        if len(specs) == 1:
            results = [family.run(model_dir, first.task.task_dir, first.config)]
        else:
            results = family.run_shared([spec.task.task_dir for spec in specs], model_dir, first.config)
    except FloatingPointError as error:
        seconds = time.perf_counter() - started
        return [RunRecord.diverged(spec, error, seconds, worker) for spec in specs]
    return [RunRecord.finished(spec, result, worker) for spec, result in zip(specs, results, strict=True)]


@dataclass(frozen=True, kw_only=True)
class GridUnit:
    """What one worker fine-tunes at once, under one claim: a run, or the runs of the tasks that
    share its training (same model, LR and seed; :func:`shared_runs`)."""

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


def shared_runs(tasks: Sequence[TaskRef]) -> dict[str, list[TaskRef]]:
    """Task name -> the tasks that train the same model with it (same family, whose run configs
    are then the same, and the same training data by its
    :meth:`~megatron_ext.eval.family.Family.shared_training_key`), in the given order; only for groups
    of two or more."""
    groups: dict[tuple[str, str], list[TaskRef]] = {}
    for task in tasks:
        key = FAMILIES[task.family].shared_training_key(task.task_dir)
        if key is not None:
            groups.setdefault((task.family, key), []).append(task)
    return {task.name: group for group in groups.values() if len(group) > 1 for task in group}
