"""The evaluation grid: fine-tune every model on every task at every (learning rate, seed), as in the paper.

This module is the entry point (:func:`evaluate_models`) and its inputs: the models and tasks
given, resolved and exported. The rest is in three parts: the grid (:mod:`.grid`: one run per
(model, task, LR, seed) through the task family's ``run``, its record, the units and workers that
share the grid), the aggregation (:mod:`.aggregation`: per (model, task) the best LR and the test
mean ± 95 % CI over seeds, and the models ranked per task), and the renderer (:mod:`.render`: the
summary files and plots, shared with the study's report).

Models are Hugging Face encoder directories or Megatron checkpoints (a save directory or one
``iter_*``; several checkpoints of a save directory as models ``NAME@STEP``), which are exported to
EuroBERT once. Runs are resumable: a finished run's JSON is reused, after checking it was made with
the same config and model.

Workers share a grid: the same call in N processes (or N tasks of a SLURM job array) on one
``output_dir`` does each run once. A worker claims a :class:`~.grid.GridUnit` (a run, or the runs
sharing one training) before fine-tuning it, through a claim file with a heartbeat (:mod:`megatron_ext.claims`); a dead
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
    plots/<task>.png, plots/tokens/<task>.png   score vs LR, and vs pretraining tokens (:mod:`.render`)
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_ext.claims import ClaimPolicy, Holder, Owner, try_claim
from megatron_ext.config_loading import UserError
from megatron_ext.eval.aggregation import TaskResult, aggregate_grid
from megatron_ext.eval.hub_datasets import BENCHMARKS, TASK_GROUPS, expand_tasks, prepare_benchmarks
from megatron_ext.eval.families import FAMILIES, family_of
from megatron_ext.eval.grid import (
    GridWorker,
    ModelRef,
    RunRecord,
    RunSpec,
    TaskRef,
    finetune_config,
    grid_units,
    run_path,
    shared_runs,
)
from megatron_ext.eval.finetuning import PAPER_LR_GRID, PAPER_SEEDS
from megatron_ext.eval.render import write_summary
from megatron_ext.eval.suite import TASKS, build_task
from megatron_ext.eval.own_task import build_own_task
from megatron_ext.eval.task_io import TASK_FILE, default_suite_dir, load_task
from megatron_ext.fileio import write_atomic

if TYPE_CHECKING:
    from megatron_ext.checkpoint.reader import Checkpoint

_NAME = re.compile(r"^[\w.+-]+$")
_SELECTION = re.compile(r"^(all|\d+(,\d+)*)$")
"""What may follow a save directory's ``@``: ``all``, or steps separated by commas."""


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
    from megatron_ext.checkpoint.reader import Checkpoint

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
    from megatron_ext.checkpoint.reader import Checkpoint

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
        elif Path(task).is_dir() and (own := build_own_task(Path(task), suite_dir)) is not None:
            task_dir = own  # a folder of train/validation/test CSV or JSONL: a classification task
        else:
            raise UserError(f"unknown task {task!r}: expected one of {sorted(TASKS)}, a benchmark "
                            f"{sorted(BENCHMARKS)}, a group {sorted(TASK_GROUPS)}, a directory with a "
                            f"{TASK_FILE} (docs/eval_suite.md) or a folder of train/validation/test .csv or "
                            ".jsonl files with text and label columns (docs/evaluation.md)")
        meta = json.loads((task_dir / TASK_FILE).read_text(encoding="utf-8"))
        family = family_of(meta.get("family"), task=task)
        name = task_dir.resolve().name
        if any(ref.name == name for ref in refs):
            raise UserError(f"two tasks are named {name!r}")
        for split in family.splits_read(task_dir):
            load_task(task_dir, split)
        refs.append(TaskRef(name=name, task_dir=task_dir.resolve(), family=family.name,
                            metric=meta.get("metric", "")))
    return refs


# ----------------------------------------------------------------------------- entry point


def evaluate_models(models: Sequence[str], tasks: Sequence[str], *, output_dir: str | Path,
                    lrs: Sequence[float] = PAPER_LR_GRID, seeds: Sequence[int] = PAPER_SEEDS,
                    overrides: Mapping[str, Any] | None = None, suite_dir: str | Path | None = None,
                    benchmarks_dir: str | Path | None = None, claims: ClaimPolicy = ClaimPolicy(),
                    summary_only: bool = False) -> Evaluation:
    """Fine-tune every model on every task at every LR and seed, then aggregate and write reports.

    Several processes (on one machine, or the tasks of a SLURM job array) may run this with the
    same arguments and ``output_dir``: each claims a run before fine-tuning it (:mod:`megatron_ext.claims`), so
    every run is done once; a worker with nothing left to claim waits for the runs others hold (and
    takes over those whose worker died), then writes the summary.

    Args:
        models: HF encoder directories or Megatron checkpoints, each ``PATH`` or ``NAME=PATH``; a
            save directory's checkpoints as ``PATH@all`` or ``PATH@STEP,STEP`` (:func:`resolve_models`).
        tasks: Names in :data:`~megatron_ext.eval.suite.TASKS`, benchmarks in
            :data:`~megatron_ext.eval.hub_datasets.BENCHMARKS` (``paper``: the paper's twelve), or task
            directories with ``task.json``.
        output_dir: Receives ``runs/``, ``exported/``, the summaries and plots (module docstring).
        lrs: Fine-tuning learning rates (default: the paper's grid); zero-shot tasks run once
            (:meth:`~megatron_ext.eval.family.Family.grid`).
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
    task_grids = {task.name: FAMILIES[task.family].grid(lrs, seeds) for task in task_refs}
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
        worker = GridWorker(grid_units(specs, shared_runs(task_refs)), owner=owner, claims=claims,
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
    results, rankings = aggregate_grid([record for record in records.values() if record is not None], lrs, seeds)
    write_summary(output_dir, results, lrs, seeds, rankings, missing)
    return done(results=tuple(results), summary_written=True)
