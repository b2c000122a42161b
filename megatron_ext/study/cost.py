"""What a run or a study costs before it is launched: GPU-hours and wall time.

A training segment's cost is its FLOPs (``training.dry_run.phase_flops``: the FLOPs ``--dry-run``
prints, per objective, in the convention of ``metrics.MFU_CONVENTION``) divided by a speed, the
training FLOP/s one device achieves for that shape (size, sequence length, precision, spec) on a
GPU kind. Where a speed comes from, in this order, is printed with every figure:

1. **calibrated**: ``--calibrate`` timed a few steps of each distinct shape on this machine,
   the warm-up steps excluded (:func:`calibrate_training`), and the trainer's start-up;
2. **measured**: a throughput measurement committed under ``benchmarks/results/`` (any
   ``throughput*.json`` below it) for this GPU kind, model (by its parameter count), sequence
   length and precision: the file, its device and the commit and date that added it;
3. **assumed**: the GPU kind's dense peak (``metrics.PEAK_TFLOPS``, from the vendors' datasheets)
   at an assumed MFU (:data:`ASSUMED_MFU` unless ``--mfu``), marked as an assumption.

A measured or assumed speed is per device and objective-independent in FLOP/s: the objective mix
enters through the FLOPs (an MLM-40 step's LM head runs at 40 % of the positions, a CLM step's at
all). A calibrated speed is per objective.

Several GPUs: data parallelism, each GPU at the one-GPU speed, plus the distributed optimizer's
traffic of ``docs/scaling.md``: 2 x 4 x N x (DP - 1) / DP bytes per GPU per step (fp32 gradients
reduce-scattered, fp32 parameters all-gathered) over NVLink (:data:`NVLINK_BYTES_PER_S`) within a
node or InfiniBand (:data:`INTERNODE_BYTES_PER_S` per GPU) across nodes; the half that
``overlap_grad_reduce`` (reduce-scatter) or ``overlap_param_gather`` (all-gather) overlaps is
taken as hidden.

Evaluation: the study's fine-tuning runs (models x tasks x LRs x seeds; a zero-shot task once per
model) times the time of one run per family and size: calibrated (one run per family on this
machine), measured (``benchmarks/finetune_speed.py``'s record for this device, scaled by steps and
parameters), or assumed (6 x N x steps x batch x input length at :data:`ASSUMED_FINETUNE_MFU` of
the peak, plus :data:`ASSUMED_FINETUNE_OVERHEAD_S` of loading and scoring), over the workers.

Committed results live in the repository's ``benchmarks/results``, not in an installed package:
the reader takes a results directory (``--results-dir``; default: the checkout's, when there is
one) and says so when there is none.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import subprocess
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from megatron_ext.config_loading import UserError
from megatron_ext.model.config import layer_matmul_parameters, parameter_count
from megatron_ext.training.config import RunConfig
from megatron_ext.training.metrics import MFU_CONVENTION, PEAK_TFLOPS
from megatron_ext.training.dry_run import phase_flops

REPO_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
"""The checkout's committed measurements (absent in an installed package)."""

CPU = "cpu"
"""The GPU kind of a CPU-only machine (no peak: measured or calibrated speeds only)."""

ASSUMED_MFU = 0.35
"""MFU assumed without a measurement: within this project's measured 27-42 % (610M and 1B, H100/H200,
``benchmarks/results/gpu_visits``) and below the 38-42 % of published Megatron/MPT runs at ~1B."""

ASSUMED_FINETUNE_MFU = 0.2
"""MFU assumed for a fine-tuning run on a GPU (small batches, evaluation passes): an assumption."""

ASSUMED_FINETUNE_OVERHEAD_S = 30.0
"""Seconds per fine-tuning run assumed for loading the model and scoring (no GPU measurement yet)."""

ASSUMED_FINETUNE_TOKENS = 256
"""Tokens per fine-tuning example assumed where the study sets no ``max_length``."""

NVLINK_BYTES_PER_S = 400e9
"""Per GPU within a node (docs/scaling.md, H100 NVLink)."""

INTERNODE_BYTES_PER_S = 45e9
"""Per GPU across nodes: 8 x 400 Gb/s InfiniBand per node of 8 GPUs (docs/scaling.md)."""

ASSUMED_STARTUP_S = {CPU: 20.0, "gpu": 120.0}
"""Seconds a trainer takes besides its steps (imports, model build, data index, checkpoint load, the
final save) where ``--calibrate`` did not measure them: assumed, on a CPU from the miniature's
segments (a 50-step segment took 26 s), on a GPU node a guess."""

BANDS: dict[str, tuple[float, float]] = {"calibrated": (0.75, 1.25), "measured": (0.5, 2.0), "assumed": (1 / 3, 3.0)}
"""The range the real wall time is expected in, as factors of the estimate, by the least certain
speed source used: calibrated on this machine (the start-up and pace of this very trainer),
measured elsewhere (same kind of device, another moment, start-up assumed), assumed from a peak."""

MEASURED_FINETUNE_PARAMETERS = {"all-MiniLM-L6-v2": 22_713_216}
"""Parameters of the models ``benchmarks/finetune_speed.py`` recorded before it wrote them."""

Source = Literal["calibrated", "measured", "assumed"]


def precision_of(config: RunConfig) -> str:
    """``fp8``, ``bf16`` or ``fp32``: the precision a throughput row is recorded under."""
    if config.training.fp8_recipe:
        return "fp8"
    return "bf16" if config.training.bf16 else "fp32"


def gpu_kind(name: str) -> str:
    """``name`` as a kind of :data:`PEAK_TFLOPS` (case-insensitive) or :data:`CPU`; a clear error otherwise."""
    if name.lower() == CPU:
        return CPU
    for kind in PEAK_TFLOPS:
        if kind.lower() == name.lower():
            return kind
    raise UserError(f"--gpu {name}: unknown GPU kind; known: {', '.join(PEAK_TFLOPS)}, {CPU}")


def device_kind(device: str) -> str | None:
    """The kind of a recorded device name (``NVIDIA H100 80GB HBM3`` -> ``H100``, ``cpu2`` -> ``cpu``)."""
    if device.lower().startswith(CPU):
        return CPU
    return next((kind for kind in PEAK_TFLOPS if kind.lower() in device.lower()), None)


def hours(seconds: float) -> str:
    """``12.3 h``, ``4.1 min`` or ``12 s``."""
    if seconds >= 3600:
        return f"{seconds / 3600:,.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


@dataclass(frozen=True, kw_only=True)
class Speed:
    """Training FLOP/s of one device for a shape, and where the figure comes from."""

    flops_per_s: float
    source: Source
    detail: str
    """What was measured or assumed: the file, device, commit and date; or the peak and MFU."""
    startup_s: float = 0.0
    """Seconds a trainer takes besides its steps (imports, build, data, final save): calibrated only."""

    def label(self) -> str:
        return f"{self.source}: {self.detail}"


@dataclass(frozen=True, kw_only=True)
class MeasuredRow:
    """One throughput row of a committed results file."""

    file: str
    device: str
    provenance: str
    """``commit abc1234, 2026-11-24`` (the commit that added the file, and the measurement's date)."""
    model: str
    parameters: int
    seq_length: int
    precision: str
    backend: str | None
    flops_per_s: float
    date: str
    variant: str | None = None
    """The throughput variant it was timed as (None: the row's default side)."""


def _git_added(results_dir: Path) -> dict[str, tuple[str, str]]:
    """``{path relative to results_dir: (commit, date)}`` of the commit that added each file."""
    try:
        top = subprocess.run(["git", "-C", str(results_dir), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=20, check=True).stdout.strip()
        log = subprocess.run(["git", "-C", top, "log", "--diff-filter=A", "--name-only", "--format=@%h %cs", "--",
                              str(results_dir.resolve())], capture_output=True, text=True, timeout=60,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found: dict[str, tuple[str, str]] = {}
    commit = date = ""
    for line in log.splitlines():
        if line.startswith("@"):
            commit, date = line[1:].split(" ", 1)
        elif line.strip():
            path = (Path(top) / line.strip()).resolve()
            try:
                found.setdefault(str(path.relative_to(results_dir.resolve())), (commit, date))
            except ValueError:
                continue
    return found


@functools.lru_cache(maxsize=8)
def read_measurements(results_dir: Path) -> tuple[MeasuredRow, ...]:
    """Every throughput row (with its FLOP/s) of the ``throughput*.json`` files below ``results_dir``
    (read once per process: a test or a tool may plan many runs)."""
    added = _git_added(results_dir)
    rows = []
    for path in sorted(results_dir.rglob("throughput*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(record, dict) or not isinstance(record.get("rows"), list) or "device" not in record:
            continue
        relative = str(path.relative_to(results_dir))
        commit, added_on = added.get(relative, ("", ""))
        dated = re.search(r"\d{4}-\d{2}-\d{2}", relative)
        date = record.get("date") or (dated.group(0) if dated else added_on)
        made = (f"commit {record['commit']}" if record.get("commit") else
                f"added in commit {commit}" if commit else "commit unknown")
        provenance = ", ".join(part for part in (made, date) if part)
        for row in record["rows"]:
            if not row.get("tflops") or not row.get("parameters") or row.get("error"):
                continue
            measured = functools.partial(MeasuredRow, file=relative, device=record["device"], provenance=provenance,
                               model=str(row.get("model")), parameters=int(row["parameters"]),
                               seq_length=int(row["seq_length"]), precision=str(row["precision"]), date=date)
            # The layer implementation under its name of the time (``attention_backend`` before the rename).
            backend = row.get("transformer_impl") or row.get("attention_backend")
            rows.append(measured(backend=backend, flops_per_s=float(row["tflops"]) * 1e12))
            rows.extend(measured(backend=settings["transformer_impl"],
                                 flops_per_s=float(row["tflops"]) * 1e12 * variant["tokens_per_s"] / row["tokens_per_s"],
                                 variant=name)
                        for name, variant, settings in _same_flops_variants(row))
    return tuple(rows)


SAME_FLOPS_SETTINGS = frozenset({"transformer_impl", "cuda_graphs", "gradient_accumulation_fusion", "rope_fusion"})
"""Settings that change how a step runs but not its FLOPs per token: a throughput variant that
differs from its row only in these is a speed of the same step (the row's FLOP/s scaled by tokens/s)."""


def _same_flops_variants(row: dict) -> Iterator[tuple[str, dict, dict]]:
    """The timed variants of a throughput row (``benchmarks/throughput.py --variants``) that ran the
    row's step with other :data:`SAME_FLOPS_SETTINGS`: (name, variant, its settings)."""
    default = row.get("settings") or {}
    for name, variant in (row.get("variants") or {}).items():
        settings = variant.get("settings") or {}
        if (not variant.get("tokens_per_s") or variant.get("error") or not settings or not default
                or not row.get("tokens_per_s") or "transformer_impl" not in settings):
            continue
        changed = {key for key in default.keys() | settings.keys() if default.get(key) != settings.get(key)}
        if changed and changed <= SAME_FLOPS_SETTINGS:
            yield name, variant, settings


RESULTS_DIR_VARIABLE = "MEGATRON_EXT_RESULTS_DIR"
"""Where an installed package (which has no ``benchmarks/``) finds committed measurements."""


def default_results_dir() -> Path | None:
    """``$MEGATRON_EXT_RESULTS_DIR``, else the checkout's ``benchmarks/results``, else None (an
    installed package without the variable: speeds are then calibrated or assumed, and said so)."""
    if os.environ.get(RESULTS_DIR_VARIABLE):
        path = Path(os.environ[RESULTS_DIR_VARIABLE])
        if not path.is_dir():
            raise UserError(f"{RESULTS_DIR_VARIABLE}={path}: not a directory (expected a benchmarks/results folder)")
        return path
    return REPO_RESULTS if REPO_RESULTS.is_dir() else None


class SpeedTable:
    """The training speed of any run config on one GPU kind: calibrated, measured, else assumed."""

    def __init__(self, *, kind: str, results_dir: Path | None, mfu: float = ASSUMED_MFU,
                 calibrated: dict[tuple, Speed] | None = None):
        self.kind = kind
        self.mfu = mfu
        self.calibrated = dict(calibrated or {})
        self.results_dir = results_dir
        self.notices: list[str] = []
        if results_dir is None:
            self.rows: tuple[MeasuredRow, ...] = ()
            self.notices.append("no benchmarks/results directory (an installed package has none; --results-dir "
                                "DIR names one): speeds are assumed from peak FLOP/s")
        elif not results_dir.is_dir():
            raise UserError(f"--results-dir {results_dir}: no such directory")
        else:
            self.rows = read_measurements(results_dir)

    def speed(self, config: RunConfig, objective: str) -> Speed | None:
        """The speed of ``config``'s steps of ``objective`` (a phase's objective tag); None: unknown
        (a CPU without a measurement or calibration)."""
        key = calibration_key(config, objective)
        if key in self.calibrated:
            return self.calibrated[key]
        measured = self._measured(config)
        if measured is not None:
            return measured
        peak = PEAK_TFLOPS.get(self.kind)
        if peak is None:
            return None
        fp8 = precision_of(config) == "fp8" and peak[1] is not None
        value = (peak[1] if fp8 else peak[0]) * 1e12
        if self.results_dir is not None:
            self.notice(f"no measurement for {self.kind} at {parameter_count(config.model):,} parameters, seq "
                        f"{config.data.seq_length}, {precision_of(config)} in {self.results_dir}: assumed "
                        f"{100 * self.mfu:.0f} % MFU")
        startup = ASSUMED_STARTUP_S["gpu"]
        return Speed(flops_per_s=value * self.mfu, source="assumed", startup_s=startup,
                     detail=f"{self.kind} {'fp8' if fp8 else 'bf16'} dense peak {value / 1e12:,.0f} TFLOP/s "
                            f"(datasheet) x {100 * self.mfu:.0f} % MFU, an assumption; {startup:.0f} s start-up per "
                            "trainer assumed")

    def notice(self, line: str) -> None:
        if line not in self.notices:
            self.notices.append(line)

    def _measured(self, config: RunConfig) -> Speed | None:
        """The newest row of this kind, sequence length and precision for this model: the same
        parameter count, else the same layers (a row's preset) with another vocabulary."""
        parameters = parameter_count(config.model)
        found = [r for r in self.rows if device_kind(r.device) == self.kind and r.seq_length == config.data.seq_length
                 and r.precision == precision_of(config)
                 and (r.parameters == parameters or _same_layers(r.model, config))]
        if not found:
            return None
        backend = config.model.transformer_impl
        best = max(found, key=lambda r: (r.parameters == parameters, r.backend == backend, r.date, r.flops_per_s))
        spec = (f", {best.backend} spec" if best.backend else "") + (f" (variant {best.variant})" if best.variant else "")
        other = "" if best.parameters == parameters else \
            f" (its layers, another vocabulary: {best.parameters:,} parameters against {parameters:,})"
        startup = ASSUMED_STARTUP_S[CPU if self.kind == CPU else "gpu"]
        return Speed(flops_per_s=best.flops_per_s, source="measured", startup_s=startup,
                     detail=f"{best.file}: {best.device}, {best.provenance}: {best.model} seq {best.seq_length} "
                            f"{best.precision}{spec}, {best.flops_per_s / 1e12:,.3g} TFLOP/s{other}; {startup:.0f} s "
                            "start-up per trainer assumed")


def _same_layers(preset_name: str, config: RunConfig) -> bool:
    """Whether ``config``'s layers are those of the model preset ``preset_name``."""
    from megatron_ext.model.config import PRESETS

    preset = PRESETS.get(preset_name)
    fields = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups")
    return preset is not None and all(getattr(preset, f) == getattr(config.model, f) for f in fields)


def calibration_key(config: RunConfig, objective: str) -> tuple:
    """What sets a step's speed: the model, the batch shape, the precision and the objective."""
    m, d = config.model, config.data
    return (parameter_count(m), m.num_layers, m.hidden_size, m.transformer_impl, d.seq_length, d.micro_batch_size,
            d.global_batch_size, precision_of(config), config.training.lm_head_scored_only, objective)


# -- several GPUs -----------------------------------------------------------------------------------


def data_parallel_overhead(config: RunConfig, gpus: int, gpus_per_node: int) -> tuple[float, str]:
    """Seconds added to each step by the distributed optimizer's traffic on ``gpus`` data-parallel
    GPUs (docs/scaling.md), and the statement of it."""
    parallel = config.parallel
    dp = gpus // (parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size)
    if dp <= 1:
        return 0.0, ""
    n = parameter_count(config.model)
    moved = 2 * 4 * n * (dp - 1) / dp
    within = gpus <= gpus_per_node
    link = NVLINK_BYTES_PER_S if within else INTERNODE_BYTES_PER_S
    seconds = moved / link
    hidden = 0.5 * parallel.overlap_grad_reduce + 0.5 * parallel.overlap_param_gather
    text = (f"data parallel over {gpus} GPUs: {moved / 1e9:.1f} GB/GPU/step (2 x 4 x N x (DP-1)/DP, docs/scaling.md) "
            f"over {'NVLink' if within else 'InfiniBand'} at {link / 1e9:.0f} GB/s = {1e3 * seconds:.0f} ms, "
            f"{100 * hidden:.0f} % overlapped")
    return seconds * (1 - hidden), text


# -- a run, a segment -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class SegmentCost:
    """Steps ``[start, end)`` of one run on ``gpus`` GPUs."""

    run: str
    start: int
    end: int
    flops: float
    gpus: int
    seconds: float | None
    """Wall time; None: no speed known."""
    speeds: tuple[str, ...]
    """Where the speeds come from (one label per distinct speed)."""
    scaling: str = ""
    """The data-parallel statement (several GPUs)."""
    sources: tuple[str, ...] = ()
    """The speed sources used (``calibrated``, ``measured``, ``assumed``)."""

    @property
    def gpu_hours(self) -> float | None:
        return None if self.seconds is None else self.seconds * self.gpus / 3600


def segment_cost(config: RunConfig, *, run: str, start: int = 0, end: int | None = None, gpus: int,
                 gpus_per_node: int, speeds: SpeedTable) -> SegmentCost:
    """The cost of steps ``[start, end)`` of ``config`` (default: the whole run)."""
    end = config.training.train_iters if end is None else end
    parts = phase_flops(config, start, end)
    flops = sum(f for _, f in parts)
    seconds, labels, startup, sources = 0.0, [], 0.0, []
    for objective, phase in parts:
        speed = speeds.speed(config, objective)
        if speed is None:
            return SegmentCost(run=run, start=start, end=end, flops=flops, gpus=gpus, seconds=None,
                               speeds=(f"no speed known for {speeds.kind}: --calibrate here, or --gpu KIND",))
        seconds += phase / (speed.flops_per_s * gpus)
        startup = max(startup, speed.startup_s)
        if speed.label() not in labels:
            labels.append(speed.label())
            sources.append(speed.source)
    extra, scaling = data_parallel_overhead(config, gpus, gpus_per_node)
    return SegmentCost(run=run, start=start, end=end, flops=flops, gpus=gpus, speeds=tuple(labels), scaling=scaling,
                       seconds=seconds + (end - start) * extra + startup, sources=tuple(sources))


def band(sources: Iterable[str]) -> tuple[float, float]:
    """The widest :data:`BANDS` of ``sources`` (the least certain speed decides)."""
    found = [BANDS[source] for source in sources] or [BANDS["assumed"]]
    return min(low for low, _ in found), max(high for _, high in found)


def format_band(sources: Iterable[str]) -> str:
    sources = sorted(set(sources), key=list(BANDS).index)
    low, high = band(sources)
    return f"expected within x{low:.3g} to x{high:.3g} of the estimate ({', '.join(sources)} speeds)"


def format_run_cost(cost: SegmentCost, kind: str, notices: Iterable[str] = ()) -> str:
    """What ``pretrain_encoder.py --dry-run`` prints under the plan."""
    lines = [f"notice            {line}" for line in notices]
    if cost.seconds is None:
        return "\n".join(lines + [f"cost              unknown: {cost.speeds[0]}"])
    devices = f"{cost.gpus} CPU process{'es' if cost.gpus != 1 else ''}" if kind == CPU else f"{cost.gpus} {kind} GPU(s)"
    lines.append(f"cost              {cost.gpu_hours:,.1f} GPU-hours, wall time {hours(cost.seconds)} on {devices} "
                 f"({cost.flops:.3e} FLOPs); {format_band(cost.sources)}")
    lines += [f"  speed           {label}" for label in cost.speeds]
    if cost.scaling:
        lines.append(f"  scaling         {cost.scaling}")
    return "\n".join(lines)


def check_budget(budget: float | None, total: float | None, items: list[tuple[str, float]], what: str) -> None:
    """Refuse (one line naming the biggest items) an estimate above ``budget`` GPU-hours."""
    if budget is None:
        return
    if total is None:
        raise UserError(f"--budget-gpu-hours {budget:g}: the cost of {what} is unknown (no speed for this machine): "
                        "give --gpu KIND or --calibrate")
    if total > budget:
        biggest = sorted(items, key=lambda item: -item[1])[:3]
        named = ", ".join(f"{name} {value:,.1f}" for name, value in biggest)
        raise UserError(f"--budget-gpu-hours {budget:g}: {what} is estimated at {total:,.1f} GPU-hours; "
                        f"the biggest: {named}")


def add_cost_flags(parser: argparse.ArgumentParser, *, study: bool) -> None:
    """The cost flags of ``pretrain_encoder.py --dry-run``, ``plan_study.py`` and ``run_study.py``."""
    group = parser.add_argument_group("cost estimate (--dry-run)")
    group.add_argument("--gpu", default=None, metavar="KIND",
                       help=f"GPU kind to estimate for: {', '.join(PEAK_TFLOPS)} or {CPU} [this machine's]")
    if study:
        group.add_argument("--gpus", type=int, default=None, metavar="N",
                           help="GPUs per run [the size's resources: nodes x gpus_per_node, else 1]")
        group.add_argument("--calibrate", action="store_true",
                           help="time a few steps of each distinct shape (and one fine-tuning run per family) "
                                "on this machine first")
    group.add_argument("--gpus-per-node", type=int, default=8, metavar="N",
                       help="GPUs per node (NVLink within, InfiniBand across) [8]")
    group.add_argument("--mfu", type=float, default=ASSUMED_MFU, metavar="X",
                       help=f"MFU assumed where nothing is measured [{ASSUMED_MFU}]")
    group.add_argument("--results-dir", default=None, metavar="DIR",
                       help="committed measurements [the checkout's benchmarks/results]")
    group.add_argument("--budget-gpu-hours", type=float, default=None, metavar="N",
                       help="refuse (exit 2) when the estimate is above N GPU-hours")


def speed_table(args: argparse.Namespace, calibrated: dict[tuple, Speed] | None = None) -> SpeedTable:
    """The speeds the cost flags ask for."""
    if not 0 < args.mfu <= 1:
        raise UserError(f"--mfu: expected a share in (0, 1], got {args.mfu}")
    if args.gpus_per_node < 1:
        raise UserError(f"--gpus-per-node: expected at least 1, got {args.gpus_per_node}")
    kind = gpu_kind(args.gpu) if args.gpu else this_machine_kind()
    results = Path(args.results_dir) if args.results_dir else default_results_dir()
    return SpeedTable(kind=kind, results_dir=results, mfu=args.mfu, calibrated=calibrated)


def this_machine_kind() -> str:
    """The kind of this machine's GPU (or :data:`CPU`); an unknown GPU is named as an error."""
    from megatron_ext import hardware

    name = hardware.device_name() if hardware.on_gpu() else None
    if not name:
        return CPU
    kind = device_kind(name)
    if kind is None:
        raise UserError(f"this machine's GPU ({name}) has no known peak: give --gpu KIND "
                        f"({', '.join(PEAK_TFLOPS)})")
    return kind


# -- calibration ------------------------------------------------------------------------------------


def steady_step_seconds(records: list[dict], *, warmup: int, tokens_per_step: int) -> float:
    """Mean seconds per step of a trainer's ``metrics.jsonl`` train records logged at every step
    (each with its ``tokens_per_s``), the first ``warmup`` steps excluded."""
    timed = [tokens_per_step / r["tokens_per_s"] for r in records
             if r.get("kind") == "train" and "tokens_per_s" in r][warmup:]
    if not timed:
        raise UserError(f"calibration: no step after the {warmup} warm-up step(s) was timed")
    return sum(timed) / len(timed)


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """What ``--calibrate`` measured on this machine."""

    training: dict[tuple, Speed] = field(default_factory=dict)
    finetuning: dict[tuple[str, str], float] = field(default_factory=dict)
    """``(size, family)`` -> seconds of one fine-tuning run at the study's settings."""


def calibration_recipe(recipe: dict, objective_phase: dict, *, steps: int, root: Path) -> dict:
    """``recipe`` cut to ``steps`` steps of one objective, writing under ``root``: nothing loaded or kept."""
    from megatron_ext.training.config import deep_merge

    trimmed = deep_merge(recipe, {
        "phases": [{"objective": objective_phase["objective"], "share": 1.0}],
        "training": {"train_iters": steps, "eval_interval": 0, "log_interval": 1, "exit_duration_in_mins": None,
                     "exit_interval": None},
        "schedule": {"lr_warmup_iters": 1, "lr_wsd_decay_iters": 1},
        "checkpoint": {"save": str(root / "checkpoints"), "save_interval": steps, "keep_last": 1},
        "logging": {"log_dir": str(root / "log"), "wandb_mode": "disabled"},
    })
    for key in ("load", "finetune", "branch_from", "branch_step", "keep_steps"):
        trimmed["checkpoint"].pop(key, None)
    return trimmed


def calibrate_training(runs: Iterable, *, warmup: int = 2, steps: int = 4,
                       say: Callable[[str], None] = print) -> tuple[dict[tuple, Speed], dict[str, Path]]:
    """Time ``warmup + steps`` steps of each distinct shape of ``runs`` (a study's planned runs:
    ``.name``, ``.size``, ``.recipe``, ``.config``) with the trainer on this machine; returns the
    speeds by :func:`calibration_key` and, per size, a checkpoint of the last calibration run (what
    the fine-tuning calibration starts from)."""
    import os
    import tempfile
    import time

    import yaml

    from megatron_ext.launch.programs import program

    speeds: dict[tuple, Speed] = {}
    checkpoints: dict[str, Path] = {}
    scratch = Path(tempfile.mkdtemp(prefix="calibration-"))
    for run in runs:
        config = costed_config(run)
        for index, phase in enumerate(run.recipe["phases"]):
            objective = config.resolved_phases[index].objective.tag
            key = calibration_key(config, objective)
            if key in speeds:
                continue
            root = scratch / f"{len(speeds)}"
            recipe = calibration_recipe(run.recipe, phase, steps=warmup + steps, root=root)
            path = root / "recipe.yaml"
            root.mkdir(parents=True)
            path.write_text(yaml.safe_dump(recipe, sort_keys=False))
            started = time.perf_counter()
            done = subprocess.run([*program("pretrain_encoder"), "--config", str(path)],
                                  capture_output=True, text=True, env=dict(os.environ))
            wall = time.perf_counter() - started
            if done.returncode != 0:
                tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
                raise UserError(f"--calibrate: the trainer failed on {run.name}'s shape (exit {done.returncode}): "
                                f"{tail[0]}")
            records = [json.loads(line) for line in (root / "log" / "metrics.jsonl").read_text().splitlines()]
            tokens = config.data.global_batch_size * config.data.seq_length
            step_s = steady_step_seconds(records, warmup=warmup, tokens_per_step=tokens)
            flops = _one_step_flops(config, objective)
            all_steps = sum(tokens / r["tokens_per_s"] for r in records if "tokens_per_s" in r)
            speeds[key] = Speed(flops_per_s=flops / step_s, source="calibrated",
                                startup_s=max(0.0, wall - all_steps),
                                detail=f"{steps} steps of {run.size} {objective} timed here after {warmup} warm-up "
                                       f"({step_s:.3g} s/step, start-up and save {max(0.0, wall - all_steps):.0f} s)")
            checkpoints[run.size] = root / "checkpoints"
            say(f"calibrated {run.size} {objective}: {speeds[key].detail}")
    return speeds, checkpoints


def _one_step_flops(config: RunConfig, objective: str) -> float:
    """FLOPs of one step of ``config``'s first phase training ``objective``."""
    for phase in config.resolved_phases:
        if phase.objective.tag == objective:
            return sum(f for _, f in phase_flops(config, phase.start, phase.start + 1))
    raise AssertionError(objective)


# -- a study ----------------------------------------------------------------------------------------


_VOCABULARIES: dict[str, int | None] = {}


def costed_config(run, notice: Callable[[str], None] = lambda line: None) -> RunConfig:
    """``run``'s config with its tokenizer's vocabulary (a plan reads no tokenizer and validates
    ``vocab_size: from_tokenizer`` with a placeholder; the LM head's FLOPs need the real one). A
    tokenizer that cannot be read here leaves the placeholder, and ``notice`` says so."""
    from megatron_ext.config_loading import build_dataclass
    from megatron_ext.study.plan import VOCAB_NOT_READ
    from megatron_ext.tokenizer import TokenizerConfig, build_tokenizer
    from megatron_ext.training.config import needs_tokenizer_vocab, run_config_from_dict

    if not needs_tokenizer_vocab(run.recipe):
        return run.config
    settings = run.recipe.get("tokenizer") or {}
    key = json.dumps(settings, sort_keys=True)
    if key not in _VOCABULARIES:
        try:
            _VOCABULARIES[key] = build_tokenizer(build_dataclass(TokenizerConfig, settings, "tokenizer")).vocab_size
        except (UserError, OSError, ValueError) as error:
            _VOCABULARIES[key] = None
            notice(f"tokenizer {settings.get('tokenizer_model')} not read here ({str(error)[:80]}): the LM head is "
                   f"counted with a {VOCAB_NOT_READ}-token placeholder vocabulary")
    vocab = _VOCABULARIES[key]
    return run.config if vocab is None else run_config_from_dict(run.recipe, tokenizer_vocab_size=vocab)


def _flag(flags: Iterable[str], *names: str) -> int | None:
    """The integer value of the last of ``flags`` spelled ``--name=N`` or ``--name=TYPE:N``."""
    value = None
    for flag in flags:
        name, _, raw = flag.partition("=")
        if name in names and raw:
            count = raw.rsplit(":", 1)[-1]
            if count.isdigit():
                value = int(count)
    return value


def study_gpus_per_run(plan, size: str, *, gpus_per_node: int) -> int:
    """GPUs of one run of ``size``: its ``resources`` over the study's, ``nodes`` x ``gpus_per_node``
    (``gpus_per_node`` here where only ``nodes`` is set); older study files' SLURM flags
    (``--nodes``, ``--gpus-per-node``, ``--gpus``, read as the ``slurm`` extras) where the neutral
    keys say nothing; 1 when nothing does. The one place that reads a study's resources for a cost."""
    spec = next(s for s in plan.study.sizes if s.name == size)
    resources = spec.resources.over(plan.study.resources)
    nodes, per_node = resources.nodes, resources.gpus_per_node
    if nodes is None and per_node is None:
        flags = list(resources.extras.get("slurm", ()))
        gpus = _flag(flags, "--gpus", "-G")
        if gpus is not None:
            return gpus
        nodes, per_node = _flag(flags, "--nodes", "-N"), _flag(flags, "--gpus-per-node")
        if nodes is None and per_node is None:
            return 1
    return (nodes or 1) * (per_node if per_node is not None else gpus_per_node)


def finetune_families(tasks: Iterable[str]) -> list[tuple[str, str, bool]]:
    """``(task, family, zero-shot)`` of each of ``tasks`` as ``evaluate.py --tasks`` takes them,
    without building or reading any (a task directory's ``task.json`` is read)."""
    from megatron_ext.eval.hub_datasets import BENCHMARKS, expand_tasks
    from megatron_ext.eval.families import FAMILIES
    from megatron_ext.eval.suite import TASKS

    found = []
    for task in expand_tasks(list(tasks)):
        if task in TASKS:
            family = TASKS[task].family
        elif task in BENCHMARKS:
            family = BENCHMARKS[task].family
        elif (Path(task) / "task.json").is_file():
            family = json.loads((Path(task) / "task.json").read_text()).get("family", "")
        else:
            raise UserError(f"evaluation.tasks: unknown task {task!r} (a suite task, a benchmark or a directory "
                            "with task.json)")
        if family not in FAMILIES:
            raise UserError(f"evaluation.tasks: task {task!r} has family {family!r}; families: {sorted(FAMILIES)}")
        found.append((task, family, FAMILIES[family].zero_shot))
    return found


@dataclass(frozen=True, kw_only=True)
class FinetuneCost:
    """One kind of fine-tuning run of the study: its count and the time of one."""

    what: str
    """``610m sc`` or ``reference ettin sc``."""
    runs: int
    seconds: float
    source: str


@dataclass(frozen=True, kw_only=True)
class EvaluationCost:
    items: tuple[FinetuneCost, ...]
    workers: int

    @property
    def seconds(self) -> float:
        """Device-seconds: every run on one device."""
        return sum(item.runs * item.seconds for item in self.items)

    @property
    def runs(self) -> int:
        return sum(item.runs for item in self.items)

    @property
    def wall_s(self) -> float:
        return self.seconds / self.workers


def _finetune_measurement(results_dir: Path | None, kind: str) -> tuple[dict, str] | None:
    """The newest ``finetune_speed`` measurement for ``kind`` under ``results_dir``: its config and
    seconds of one run of ours, and its label."""
    if results_dir is None:
        return None
    added = None
    for path in sorted(results_dir.rglob("finetune_speed*.json")):
        record = json.loads(path.read_text())
        if device_kind(str(record.get("device", ""))) != kind or not record.get("measurements"):
            continue
        label, measurement = list(record["measurements"].items())[-1]
        parameters = record.get("parameters") or MEASURED_FINETUNE_PARAMETERS.get(record.get("model"))
        if parameters is None:
            continue
        if added is None:
            added = _git_added(results_dir)
        commit, date = added.get(str(path.relative_to(results_dir)), ("unknown", ""))
        config = {**measurement["config"], "parameters": parameters, "seconds": measurement["median_seconds"]["ours"]}
        return config, (f"{path.relative_to(results_dir)} ('{label}'): {record['device']}, added in commit {commit}"
                        f"{', ' + date if date else ''}: {record.get('model')} {record.get('task')} "
                        f"{config['steps']} steps in {config['seconds']:.0f} s")
    return None


def evaluation_cost(plan, *, speeds: SpeedTable, calibrated: dict[tuple[str, str], float] | None = None
                    ) -> EvaluationCost | None:
    """The fine-tuning runs of the study's ``evaluation:`` section and their time (module docstring)."""
    from megatron_ext.eval.finetuning import PAPER_LR_GRID, PAPER_SEEDS

    spec = plan.study.evaluation
    if spec is None:
        return None
    calibrated = calibrated or {}
    families = finetune_families(spec.tasks)
    steps = spec.max_steps or 1000
    batch = spec.batch_size or 32
    length = spec.max_length or ASSUMED_FINETUNE_TOKENS
    measured = _finetune_measurement(speeds.results_dir, speeds.kind)
    seeds = len(spec.seeds or PAPER_SEEDS)

    def one_run(size: str, config: RunConfig, family: str) -> tuple[float, str]:
        if (size, family) in calibrated:
            return calibrated[size, family], f"calibrated: one {family} run of {size} timed here"
        n = parameter_count(config.model)
        if measured is not None:
            base, label = measured
            scale = steps / base["steps"] * batch / base["batch_size"] * n / base["parameters"]
            return base["seconds"] * scale, (f"measured, scaled by steps, batch and parameters "
                                             f"(x{scale:.3g}; every family as SC): {label}")
        peak = PEAK_TFLOPS.get(speeds.kind)
        if peak is None:
            return math.nan, f"no fine-tuning speed for {speeds.kind}: --calibrate here, or --gpu KIND"
        body = config.model.num_layers * layer_matmul_parameters(config.model)
        flops = 6 * body * steps * batch * length
        return (flops / (peak[0] * 1e12 * ASSUMED_FINETUNE_MFU) + ASSUMED_FINETUNE_OVERHEAD_S,
                f"assumed: 6 x {body / 1e6:,.0f}M x {steps} steps x {batch} x {length} tokens at "
                f"{100 * ASSUMED_FINETUNE_MFU:.0f} % of {speeds.kind}'s peak + {ASSUMED_FINETUNE_OVERHEAD_S:.0f} s")

    items = []
    for size in plan.study.sizes:
        runs = [r for r in plan.runs if r.size == size.name]
        checkpoints = sum(1 + (len(plan.segment(r.name).saves) if r.kind in spec.all_checkpoints else 0) for r in runs)
        config = costed_config(runs[0], speeds.notice)
        for family in sorted({f for _, f, _ in families}):
            count = sum((1 if zero else len(spec.lrs or PAPER_LR_GRID) * seeds) for _, f, zero in families if f == family)
            seconds, source = one_run(size.name, config, family)
            items.append(FinetuneCost(what=f"{size.name} {family}", runs=checkpoints * count, seconds=seconds,
                                      source=source))
    largest = max(plan.runs, key=lambda r: parameter_count(r.config.model))
    for reference in spec.references:
        for family in sorted({f for _, f, _ in families}):
            count = sum((1 if zero else len(reference.lrs or spec.lrs or PAPER_LR_GRID) * seeds)
                        for _, f, zero in families if f == family)
            seconds, source = one_run(largest.size, costed_config(largest, speeds.notice), family)
            items.append(FinetuneCost(what=f"reference {reference.name} {family}", runs=count, seconds=seconds,
                                      source=f"as {largest.size}'s run: " + source))
    return EvaluationCost(items=tuple(items), workers=spec.workers)


@dataclass(frozen=True, kw_only=True)
class StudyCost:
    """A study's training (as the tree and as separate runs) and evaluation."""

    kind: str
    segments: tuple[SegmentCost, ...]
    """The tree's segments, in plan order."""
    separate: tuple[SegmentCost, ...]
    """Each run trained alone from step 0."""
    evaluation: EvaluationCost | None
    sequential_s: float | None
    """Training wall time with one segment at a time (the local launcher)."""
    parallel_s: float | None
    """Training wall time with one job per segment, each once its parent's job is done (SLURM)."""
    notices: tuple[str, ...] = ()

    @staticmethod
    def _sum(costs: Iterable[SegmentCost]) -> float | None:
        values = [c.gpu_hours for c in costs]
        return None if any(v is None for v in values) else sum(values)

    @property
    def tree_gpu_hours(self) -> float | None:
        return self._sum(self.segments)

    @property
    def separate_gpu_hours(self) -> float | None:
        return self._sum(self.separate)

    @property
    def evaluation_gpu_hours(self) -> float | None:
        if self.evaluation is None:
            return 0.0
        return None if math.isnan(self.evaluation.seconds) else self.evaluation.seconds / 3600

    @property
    def total_gpu_hours(self) -> float | None:
        tree, evaluation = self.tree_gpu_hours, self.evaluation_gpu_hours
        return None if tree is None or evaluation is None else tree + evaluation

    def items(self) -> list[tuple[str, float]]:
        """The study's parts and their GPU-hours (what a refused budget names)."""
        found = [(f"segment {c.run}", c.gpu_hours) for c in self.segments if c.gpu_hours is not None]
        if self.evaluation is not None:
            found += [(f"fine-tuning {i.what} ({i.runs} runs)", i.runs * i.seconds / 3600) for i in self.evaluation.items
                      if not math.isnan(i.seconds)]
        return found


def study_cost(plan, *, speeds: SpeedTable, gpus: int | None, gpus_per_node: int,
               calibration: Calibration | None = None) -> StudyCost:
    """The cost of ``plan`` (a ``study.plan.StudyPlan``): each segment on its size's GPUs
    (``gpus`` for every run when given), the runs alone, the evaluation."""
    calibration = calibration or Calibration()
    segments, separate = [], []
    for segment in plan.segments:
        run = plan.run(segment.run)
        config = costed_config(run, speeds.notice)
        n = gpus if gpus is not None else study_gpus_per_run(plan, run.size, gpus_per_node=gpus_per_node)
        segments.append(segment_cost(config, run=run.name, start=segment.start, end=segment.end, gpus=n,
                                     gpus_per_node=gpus_per_node, speeds=speeds))
        separate.append(segment_cost(config, run=run.name, gpus=n, gpus_per_node=gpus_per_node, speeds=speeds))
    known = all(c.seconds is not None for c in segments)
    sequential = sum(c.seconds for c in segments) if known else None
    parallel = None
    if known:
        step_cost = {c.run: c.seconds / max(1, c.end - c.start) for c in segments}
        parallel = plan.wall_steps("parent_done", step_cost=step_cost)
    return StudyCost(kind=speeds.kind, segments=tuple(segments), separate=tuple(separate),
                     evaluation=evaluation_cost(plan, speeds=speeds, calibrated=calibration.finetuning),
                     sequential_s=sequential, parallel_s=parallel, notices=tuple(speeds.notices))


def _gh(value: float | None) -> str:
    return "?" if value is None else f"{value:,.1f}"


def format_study_cost(plan, cost: StudyCost) -> str:
    """What ``plan_study.py --dry-run`` and ``run_study.py --dry-run`` print: per run and segment,
    the tree against separate runs, the evaluation, the whole study."""
    from megatron_ext.study.render import tree_rows

    kind = cost.kind
    out = ["", f"cost on {kind} ({MFU_CONVENTION} FLOPs / speed; GPU-hours = wall time x GPUs per run)"]
    out += [f"  notice: {line}" for line in cost.notices]
    by_run = {c.run: c for c in cost.segments}
    alone = {c.run: c for c in cost.separate}
    rows = tree_rows(plan)
    width = max(len(name) for name, _ in rows) + 2
    out.append(f"  {'segment':<{width}}{'GPUs':>5}{'segment GPU-h':>15}{'wall':>10}{'run alone GPU-h':>17}")
    for name, segment in rows:
        c, a = by_run[segment.run], alone[segment.run]
        wall = "?" if c.seconds is None else hours(c.seconds)
        out.append(f"  {name:<{width}}{c.gpus:>5}{_gh(c.gpu_hours):>15}{wall:>10}{_gh(a.gpu_hours):>17}")
    tree, separate = cost.tree_gpu_hours, cost.separate_gpu_hours
    saved = "" if tree is None or not separate else f" ({100 * (1 - tree / separate):.1f} % saved)"
    out.append(f"  training as the tree: {_gh(tree)} GPU-hours; every run from scratch: {_gh(separate)} "
               f"GPU-hours{saved}")
    if cost.sequential_s is not None:
        out.append(f"  training wall time: {hours(cost.sequential_s)} one segment at a time (local launcher); "
                   f"{hours(cost.parallel_s)} with a job per segment after its parent's (slurm launcher)")
    speeds = sorted({label for c in cost.segments for label in c.speeds})
    if cost.sequential_s is not None:
        out.append(f"  training: {format_band(s for c in cost.segments for s in c.sources)}")
    out += ["  speeds:"] + [f"    {label}" for label in speeds]
    scalings = sorted({c.scaling for c in cost.segments if c.scaling})
    out += [f"    {line}" for line in scalings]
    evaluation = cost.evaluation
    if evaluation is not None:
        out.append(f"  evaluation: {evaluation.runs:,} fine-tuning runs on one {kind} each, {evaluation.workers} "
                   f"worker(s): {_gh(cost.evaluation_gpu_hours)} GPU-hours, wall time "
                   f"{'?' if math.isnan(evaluation.wall_s) else hours(evaluation.wall_s)}")
        for item in evaluation.items:
            each = "?" if math.isnan(item.seconds) else f"{item.seconds:,.0f} s"
            out.append(f"    {item.what:<28}{item.runs:>7,} runs x {each:>8}  [{item.source}]")
    total = cost.total_gpu_hours
    line = f"  whole study: {_gh(total)} GPU-hours"
    if cost.sequential_s is not None and (evaluation is None or not math.isnan(evaluation.wall_s)):
        after = evaluation.wall_s if evaluation is not None else 0.0
        line += (f"; wall time {hours(cost.sequential_s + after)} (local launcher) or "
                 f"{hours(cost.parallel_s + after)} (slurm launcher), the evaluation after the training")
    out.append(line)
    return "\n".join(out)


def calibrate_finetuning(plan, checkpoints: dict[str, Path], *, say: Callable[[str], None] = print
                         ) -> dict[tuple[str, str], float]:
    """Seconds of one fine-tuning run per family for each size, timed here on ``checkpoints`` (a
    calibration run's, per size) at the study's settings (its first LR and seed, one task per
    family), in the environment of one of ``evaluation.workers`` processes."""
    import dataclasses
    import sys
    import tempfile

    from megatron_ext.study.evaluation import _settings

    spec = plan.study.evaluation
    if spec is None:
        return {}
    first: dict[str, str] = {}
    for task, family, _ in finetune_families(spec.tasks):
        first.setdefault(family, task)
    one = dataclasses.replace(spec, tasks=tuple(first.values()), seeds=spec.seeds[:1] or (0,))
    lrs = spec.lrs[:1] or (5e-5,)
    found: dict[tuple[str, str], float] = {}
    scratch = Path(tempfile.mkdtemp(prefix="calibration-eval-"))
    for size, checkpoint in checkpoints.items():
        out = scratch / size
        argv = [sys.executable, "-m", "megatron_ext.cli.evaluate", "--models", f"calibration={checkpoint}",
                "--output-dir", str(out), *_settings(one, lrs)]
        # As one of evaluation.workers copies on this machine: its share of the cores (launch/local.py).
        threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // max(1, spec.workers)))}
        done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **threads})
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
            raise UserError(f"--calibrate: a fine-tuning run of {size} failed (exit {done.returncode}): {tail[0]}")
        for family, task in first.items():
            records = [json.loads(p.read_text()) for p in (out / "runs" / "calibration").glob(f"{task}/*.json")]
            if records:
                found[size, family] = sum(r["seconds"] for r in records) / len(records)
                say(f"calibrated fine-tuning {size} {family} ({task}): {found[size, family]:.1f} s per run")
    return found


def calibrate(plan, *, say: Callable[[str], None] = print) -> Calibration:
    """``--calibrate``: the study's training shapes, then one fine-tuning run per family and size."""
    say("calibrating on this machine: a few steps of each distinct shape, then one fine-tuning run per family")
    training, checkpoints = calibrate_training(plan.runs, say=say)
    return Calibration(training=training, finetuning=calibrate_finetuning(plan, checkpoints, say=say))


def report_study_cost(plan, args: argparse.Namespace, *, say: Callable[[str], None] = print,
                      show: bool = True) -> StudyCost:
    """The cost flags' work for a study tool: calibrate when asked, estimate, print (``show``), and
    refuse a budget the estimate exceeds."""
    calibration = calibrate(plan, say=say) if args.calibrate else Calibration()
    speeds = speed_table(args, calibration.training)
    if args.gpus is not None and args.gpus < 1:
        raise UserError(f"--gpus: expected at least 1, got {args.gpus}")
    cost = study_cost(plan, speeds=speeds, gpus=args.gpus, gpus_per_node=args.gpus_per_node, calibration=calibration)
    if show:
        say(format_study_cost(plan, cost))
    check_budget(args.budget_gpu_hours, cost.total_gpu_hours, cost.items(), f"study {plan.study.name}")
    return cost


def seconds_left(plan, segments: Iterable, *, gpus: int | None, say: Callable[[str], None] = print
                 ) -> dict[str, float] | None:
    """The estimated seconds of each segment's steps still to train (from its newest checkpoint) on
    this machine's kind, ``gpus`` per run (None: the study's); None where no speed is known (said)."""
    from megatron_ext.study.state import first_step, saved_step

    try:
        speeds = SpeedTable(kind=this_machine_kind(), results_dir=default_results_dir())
    except UserError as error:
        say(f"ETA: at the pace so far ({error})")
        return None
    found = {}
    for segment in segments:
        run = plan.run(segment.run)
        n = gpus if gpus is not None else study_gpus_per_run(plan, run.size, gpus_per_node=8)
        start = first_step(segment, run, saved_step(run))
        cost = segment_cost(costed_config(run), run=run.name, start=min(start, segment.end), end=segment.end, gpus=n,
                            gpus_per_node=8, speeds=speeds)
        if cost.seconds is None:
            say(f"ETA: at the pace so far ({cost.speeds[0]})")
            return None
        found[run.name] = cost.seconds
    return found
