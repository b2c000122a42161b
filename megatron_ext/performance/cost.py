"""The cost model: what a run costs before it is launched, in GPU-hours and wall time, from measured
speeds (pure: no I/O but reading the measured-speed table).

A training segment's cost is its FLOPs (``training.dry_run.phase_flops``: the FLOPs ``--dry-run``
prints, per objective, in the convention of ``flops.MFU_CONVENTION``; with isolated documents read from
the first entries of the data's index) divided by a speed, the
training FLOP/s one device achieves for that shape (size, sequence length, precision, spec) on a
GPU kind. Where a speed comes from, in this order, is printed with every figure:

1. **calibrated**: ``--calibrate`` timed a few steps of each distinct shape on this machine,
   the warm-up steps excluded (:func:`calibrate_training`), and the trainer's start-up;
2. **measured**: a throughput measurement (``measured_speeds``: the committed ones shipped
   with the package, and a results folder of the user's own) for this GPU kind, model (by its
   parameter count), sequence length and precision: the file, its device and the commit and date
   that added it;
3. **assumed**: the GPU kind's dense peak (``devices.PEAK_TFLOPS``, from the vendors' datasheets)
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

A fine-tuning run's time (:meth:`SpeedTable.finetune_run`) comes from a fine-tuning speed measured on
the GPU kind (``benchmarks/finetune_speed.py``'s record, scaled by steps, batch and parameters), else
is assumed (6 x N x steps x batch x input length at :data:`ASSUMED_FINETUNE_MFU` of the peak, plus
:data:`ASSUMED_FINETUNE_OVERHEAD_S` of loading and scoring).

A study's cost (its segments and its evaluation) is ``study/cost.py``'s; ``--calibrate``'s timings
are ``study/calibration.py``'s.

The committed measurements ship inside the package (``measured_speeds.packaged``), so a
clone and an installed package price a run alike; ``--results-dir`` (or
``$MEGATRON_EXT_RESULTS_DIR``) adds a folder of one's own.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megatron_ext.config_loading import UserError
from megatron_ext.model.config import EncoderModelConfig, layer_matmul_parameters, parameter_count
from megatron_ext.performance import measured_speeds
from megatron_ext.performance.devices import CPU, PEAK_TFLOPS, gpu_kind, known_kind, this_machine_kind

ASSUMED_MFU = 0.35
"""MFU assumed without a measurement: within this project's measured 27-42 % (610M and 1B, H100/H200,
``benchmarks/results/gpu_visits``) and below the 38-42 % of published Megatron/MPT runs at ~1B."""

NVLINK_BYTES_PER_S = 400e9
"""Per GPU within a node (docs/scaling.md, H100 NVLink)."""

INTERNODE_BYTES_PER_S = 45e9
"""Per GPU across nodes: 8 x 400 Gb/s InfiniBand per node of 8 GPUs (docs/scaling.md)."""

STUDY_SPEED_HINT = "--calibrate here, or --gpu KIND"
"""What gives a speed where none is known, in the study tools (``tools/plan_study.py``,
``tools/run_study.py``: their ``--calibrate`` times this machine)."""

TRAINER_SPEED_HINT = ("give --gpu KIND to price it on that GPU, or --results-dir DIR with a throughput measurement "
                      "of this machine (benchmarks/throughput.py)")
"""The same in ``pretrain_encoder.py --dry-run``, which has no ``--calibrate`` (timing needs a study's runs)."""

ASSUMED_STARTUP_S = {CPU: 10.0, "gpu": 120.0}
"""Seconds a trainer takes besides its steps (imports, model build, data index, checkpoint load, the
final save) where ``--calibrate`` did not measure them. On a CPU, measured: ``--calibrate`` timed
10-11 s per trainer on an idle 2-core machine (docs/cost.md), and the demo recipe's 60 steps took
23 s of which 14 s of steps (2026-12-06); 20 s, assumed before, put the CI-size miniature's 12 short
segments (113 s) below half their estimate. On a GPU node a guess."""

ASSUMED_FINETUNE_MFU = 0.2
"""MFU assumed for a fine-tuning run on a GPU (small batches, evaluation passes): an assumption."""

ASSUMED_FINETUNE_OVERHEAD_S = 30.0
"""Seconds per fine-tuning run assumed for loading the model and scoring (no GPU measurement yet)."""

BANDS: dict[str, tuple[float, float]] = {"calibrated": (0.75, 1.25), "measured": (0.5, 2.0), "assumed": (1 / 3, 3.0)}
"""The range the real wall time is expected in, as factors of the estimate, by the least certain
speed source used: calibrated on this machine (the start-up and pace of this very trainer),
measured elsewhere (same kind of device, another moment, start-up assumed), assumed from a peak."""

Source = Literal["calibrated", "measured", "assumed"]


def precision_of(config) -> str:
    """``fp8``, ``bf16`` or ``fp32``: the precision a throughput row is recorded under (``config``: a
    ``training.config.RunConfig``, as every ``config`` of this module)."""
    if config.training.fp8_recipe:
        return "fp8"
    return "bf16" if config.training.bf16 else "fp32"


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


RESULTS_DIR_VARIABLE = "MEGATRON_EXT_RESULTS_DIR"
"""A folder of one's own measurements (``--results-dir``'s default), read beside the packaged ones."""


def default_results_dir() -> Path | None:
    """``$MEGATRON_EXT_RESULTS_DIR`` when set (a folder of one's own measurements, added to the packaged
    ones), else None."""
    if os.environ.get(RESULTS_DIR_VARIABLE):
        path = Path(os.environ[RESULTS_DIR_VARIABLE])
        if not path.is_dir():
            raise UserError(f"{RESULTS_DIR_VARIABLE}={path}: not a directory (expected a benchmarks/results folder)")
        return path
    return None


class SpeedTable:
    """The training speed of any run config on one GPU kind: calibrated, measured, else assumed."""

    def __init__(self, *, kind: str, results_dir: Path | None = None, mfu: float = ASSUMED_MFU,
                 calibrated: dict[tuple, Speed] | None = None, measured: measured_speeds.MeasuredSpeeds | None = None,
                 unknown_hint: str = STUDY_SPEED_HINT):
        """``measured``: the measurements to price from (default: those shipped with the package,
        ``measured_speeds.packaged``); ``results_dir``: measurements of one's own, read beside them;
        ``unknown_hint``: what the tool offers where no speed is known (its own flags)."""
        self.kind = kind
        self.unknown_hint = unknown_hint
        self.mfu = mfu
        self.calibrated = dict(calibrated or {})
        self.results_dir = results_dir
        self.notices: list[str] = []
        self.measurements = measured_speeds.packaged() if measured is None else measured
        if results_dir is not None:
            if not results_dir.is_dir():
                raise UserError(f"--results-dir {results_dir}: no such directory")
            self.measurements = self.measurements + measured_speeds.read_results(results_dir)
        self.rows = self.measurements.throughput

    def speed(self, config, objective: str) -> Speed | None:
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
        where = "the measurements" + (f" or {self.results_dir}" if self.results_dir is not None else "")
        self.notice(f"no measurement for {self.kind} at {parameter_count(config.model):,} parameters, seq "
                    f"{config.data.seq_length}, {precision_of(config)} in {where}: assumed {100 * self.mfu:.0f} % MFU")
        startup = ASSUMED_STARTUP_S["gpu"]
        return Speed(flops_per_s=value * self.mfu, source="assumed", startup_s=startup,
                     detail=f"{self.kind} {'fp8' if fp8 else 'bf16'} dense peak {value / 1e12:,.0f} TFLOP/s "
                            f"(datasheet) x {100 * self.mfu:.0f} % MFU, an assumption; {startup:.0f} s start-up per "
                            "trainer assumed")

    def notice(self, line: str) -> None:
        if line not in self.notices:
            self.notices.append(line)

    def _measured(self, config) -> Speed | None:
        """The newest row of this kind, sequence length and precision for this model: the same
        parameter count, else the same layers (a row's preset) with another vocabulary."""
        parameters = parameter_count(config.model)
        found = [r for r in self.rows if known_kind(r.device) == self.kind and r.seq_length == config.data.seq_length
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

    def finetune_run(self, model: EncoderModelConfig, *, steps: int, batch_size: int, length: int
                     ) -> tuple[float, str]:
        """Seconds of one fine-tuning run of ``model`` (``steps`` of ``batch_size`` examples of
        ``length`` tokens) on this kind, and where the figure comes from (module docstring); NaN
        where no speed is known (a CPU without a measurement)."""
        measured = self._finetune_measurement()
        if measured is not None:
            scale = steps / measured.steps * batch_size / measured.batch_size * parameter_count(model) / measured.parameters
            return measured.seconds * scale, (f"measured, scaled by steps, batch and parameters "
                                              f"(x{scale:.3g}; every family as SC): {measured.describe()}")
        peak = PEAK_TFLOPS.get(self.kind)
        if peak is None:
            return math.nan, f"no fine-tuning speed for {self.kind}: {self.unknown_hint}"
        body = model.num_layers * layer_matmul_parameters(model)
        flops = 6 * body * steps * batch_size * length
        return (flops / (peak[0] * 1e12 * ASSUMED_FINETUNE_MFU) + ASSUMED_FINETUNE_OVERHEAD_S,
                f"assumed: 6 x {body / 1e6:,.0f}M x {steps} steps x {batch_size} x {length} tokens at "
                f"{100 * ASSUMED_FINETUNE_MFU:.0f} % of {self.kind}'s peak + {ASSUMED_FINETUNE_OVERHEAD_S:.0f} s")

    def _finetune_measurement(self) -> measured_speeds.FinetuneSpeed | None:
        """The fine-tuning speed measured on this kind (the first by file name)."""
        return next((speed for speed in sorted(self.measurements.finetune, key=lambda s: s.file)
                     if known_kind(speed.device) == self.kind), None)


def _same_layers(preset_name: str, config) -> bool:
    """Whether ``config``'s layers are those of the model preset ``preset_name``."""
    from megatron_ext.model.config import PRESETS

    preset = PRESETS.get(preset_name)
    fields = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups")
    return preset is not None and all(getattr(preset, f) == getattr(config.model, f) for f in fields)


def calibration_key(config, objective: str) -> tuple:
    """What sets a step's speed: the model, the batch shape, the precision and the objective."""
    m, d = config.model, config.data
    return (parameter_count(m), m.num_layers, m.hidden_size, m.transformer_impl, d.seq_length, d.micro_batch_size,
            d.global_batch_size, precision_of(config), config.training.lm_head_scored_only, objective)


# -- several GPUs -----------------------------------------------------------------------------------


def data_parallel_overhead(config, gpus: int, gpus_per_node: int) -> tuple[float, str]:
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
    startup_seconds: float = 0.0
    """The trainer's start-up, counted once in ``seconds``: a segment is one trainer's steps."""

    @property
    def gpu_hours(self) -> float | None:
        return None if self.seconds is None else self.seconds * self.gpus / 3600

    @property
    def steps_gpu_hours(self) -> float | None:
        """GPU-hours of the steps alone (``gpu_hours`` without the start-up)."""
        return None if self.seconds is None else (self.seconds - self.startup_seconds) * self.gpus / 3600

    @property
    def startup_gpu_hours(self) -> float | None:
        return None if self.seconds is None else self.startup_seconds * self.gpus / 3600

    @property
    def step_seconds(self) -> float | None:
        """Wall time of one step on average, the start-up left out; None: no speed known (or no step)."""
        if self.seconds is None or self.end <= self.start:
            return None
        return (self.seconds - self.startup_seconds) / (self.end - self.start)


def segment_cost(config, flops: Sequence[tuple[str, float]], *, run: str, start: int = 0, end: int | None = None,
                 gpus: int, gpus_per_node: int, speeds: SpeedTable) -> SegmentCost:
    """The cost of steps ``[start, end)`` of ``config`` (default: the whole run) that train ``flops``
    (``training.dry_run.phase_flops`` of those steps: per objective tag, its FLOPs)."""
    end = config.training.train_iters if end is None else end
    parts = list(flops)
    total = sum(f for _, f in parts)
    seconds, labels, startup, sources = 0.0, [], 0.0, []
    for objective, phase in parts:
        speed = speeds.speed(config, objective)
        if speed is None:
            return SegmentCost(run=run, start=start, end=end, flops=total, gpus=gpus, seconds=None,
                               speeds=(f"no speed known for {speeds.kind}: {speeds.unknown_hint}",))
        seconds += phase / (speed.flops_per_s * gpus)
        startup = max(startup, speed.startup_s)
        if speed.label() not in labels:
            labels.append(speed.label())
            sources.append(speed.source)
    extra, scaling = data_parallel_overhead(config, gpus, gpus_per_node)
    return SegmentCost(run=run, start=start, end=end, flops=total, gpus=gpus, speeds=tuple(labels), scaling=scaling,
                       seconds=seconds + (end - start) * extra + startup, sources=tuple(sources), startup_seconds=startup)


@dataclass(frozen=True, kw_only=True)
class RunPricing:
    """How ``pretrain_encoder.py --dry-run`` prices any steps of one run on ``gpus`` GPUs: the run,
    each phase, each data span (:meth:`steps`)."""

    config: object
    """The run's ``RunConfig``."""
    flops: Callable[[int, int], Sequence[tuple[str, float]]]
    """The FLOPs of steps ``[start, end)`` per objective tag (``training.dry_run.phase_flops`` of
    ``config``; given, not imported: this package does not import ``training``)."""
    gpus: int
    gpus_per_node: int
    speeds: SpeedTable

    def steps(self, start: int = 0, end: int | None = None, *, run: str) -> SegmentCost:
        """The cost of steps ``[start, end)`` (default: the whole run) as one trainer's, named ``run``."""
        end = self.config.training.train_iters if end is None else end
        return segment_cost(self.config, self.flops(start, end), run=run, start=start, end=end, gpus=self.gpus,
                            gpus_per_node=self.gpus_per_node, speeds=self.speeds)


def split_cost(parts: Iterable[tuple[SegmentCost, Mapping[str, float]]]) -> list[tuple[str, float, float | None]]:
    """``(name, FLOPs, GPU-hours or None)`` of each name: each part (some steps of one run: their cost,
    and each name's weight in them, e.g. the samples each source gives a data span) shares its FLOPs
    and its steps' GPU-hours by the weights. The trainer's start-up is in none of them (each part's
    ``SegmentCost`` counts one; the run has one, ``SegmentCost.startup_gpu_hours``): the names' FLOPs and
    GPU-hours add up to the parts' steps'. Names in the order they first come."""
    totals: dict[str, list] = {}
    for cost, weights in parts:
        whole = sum(weights.values())
        for name, weight in weights.items():
            entry = totals.setdefault(name, [0.0, 0.0])
            entry[0] += cost.flops * weight / whole
            hours = cost.steps_gpu_hours
            entry[1] = None if hours is None or entry[1] is None else entry[1] + hours * weight / whole
    return [(name, flops, hours) for name, (flops, hours) in totals.items()]


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


def check_budget(budget: float | None, total: float | None, items: list[tuple[str, float]], what: str, *,
                 unknown_hint: str = STUDY_SPEED_HINT) -> None:
    """Refuse (one line naming the biggest items) an estimate above ``budget`` GPU-hours; an unknown
    cost too, naming ``unknown_hint`` (``SpeedTable.unknown_hint``: the tool's own flags)."""
    if budget is None:
        return
    if total is None:
        raise UserError(f"--budget-gpu-hours {budget:g}: the cost of {what} is unknown (no speed for this machine): "
                        f"{unknown_hint}")
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
                       help="a folder of one's own measurements, read beside those the package ships")
    group.add_argument("--budget-gpu-hours", type=float, default=None, metavar="N",
                       help="refuse (exit 2) when the estimate is above N GPU-hours")


def speed_table(args: argparse.Namespace, calibrated: dict[tuple, Speed] | None = None) -> SpeedTable:
    """The speeds the cost flags ask for; where none is known they name the tool's own flags
    (``--calibrate`` exists only where :func:`add_cost_flags` added it: the study tools)."""
    if not 0 < args.mfu <= 1:
        raise UserError(f"--mfu: expected a share in (0, 1], got {args.mfu}")
    if args.gpus_per_node < 1:
        raise UserError(f"--gpus-per-node: expected at least 1, got {args.gpus_per_node}")
    kind = gpu_kind(args.gpu) if args.gpu else this_machine_kind()
    results = Path(args.results_dir) if args.results_dir else default_results_dir()
    hint = STUDY_SPEED_HINT if hasattr(args, "calibrate") else TRAINER_SPEED_HINT
    return SpeedTable(kind=kind, results_dir=results, mfu=args.mfu, calibrated=calibrated, unknown_hint=hint)
