"""What a study costs before it is launched: its runs' training (the run cost model,
``performance/cost.py``, per segment of the branching tree) and its evaluation's fine-tuning runs.

Evaluation: the study's fine-tuning runs (models x tasks x LRs x seeds; a zero-shot task once per
model) times the time of one run per family and size: calibrated (one run per family on this
machine, ``study/calibration.py``), else the cost model's (``SpeedTable.finetune_run``: measured on
this device, scaled by steps and parameters, or assumed from its peak), over the workers. Pure: no
process is started and nothing is written here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from megatron_ext.config_loading import UserError
from megatron_ext.model.config import parameter_count
from megatron_ext.performance.cost import (Speed, SpeedTable, SegmentCost, default_results_dir, format_band, hours,
                                           segment_cost)
from megatron_ext.performance.devices import this_machine_kind
from megatron_ext.performance.flops import MFU_CONVENTION
from megatron_ext.training.config import RunConfig
from megatron_ext.training.dry_run import phase_flops

ASSUMED_FINETUNE_TOKENS = 256
"""Tokens per fine-tuning example assumed where the study sets no ``max_length``."""


# -- what a calibration measured (megatron_ext.study.calibration measures it) -----------------------


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """What ``--calibrate`` measured on this machine."""

    training: dict[tuple, Speed] = field(default_factory=dict)
    finetuning: dict[tuple[str, str], float] = field(default_factory=dict)
    """``(size, family)`` -> seconds of one fine-tuning run at the study's settings."""


# -- a study ----------------------------------------------------------------------------------------


_VOCABULARIES: dict[str, int | None] = {}


def costed_config(run, notice: Callable[[str], None] = lambda line: None) -> RunConfig:
    """``run``'s config with its tokenizer's vocabulary (a plan reads no tokenizer and validates
    ``vocab_size: from_tokenizer`` with a placeholder; the LM head's FLOPs need the real one). A
    tokenizer that cannot be read here leaves the placeholder, and ``notice`` says so."""
    from megatron_ext.config_loading import build_dataclass
    from megatron_ext.study.plan import VOCAB_NOT_READ
    from megatron_ext.tokenizer import TokenizerConfig, build_tokenizer
    from megatron_ext.training.recipe import needs_tokenizer_vocab, run_config_from_dict

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
    seeds = len(spec.seeds or PAPER_SEEDS)

    def one_run(size: str, config: RunConfig, family: str) -> tuple[float, str]:
        if (size, family) in calibrated:
            return calibrated[size, family], f"calibrated: one {family} run of {size} timed here"
        return speeds.finetune_run(config.model, steps=steps, batch_size=batch, length=length)

    items = []
    for size in plan.study.sizes:
        runs = [r for r in plan.runs if r.size == size.name]
        checkpoints = sum(1 + (len(plan.segment(r.name).saves) if r.kind in spec.all_checkpoints else 0) for r in runs)
        checkpoints += sum(1 for merge in plan.merges if merge.size == size.name)  # evaluated beside the runs
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
        segments.append(segment_cost(config, phase_flops(config, segment.start, segment.end), run=run.name,
                                     start=segment.start, end=segment.end, gpus=n, gpus_per_node=gpus_per_node,
                                     speeds=speeds))
        separate.append(segment_cost(config, phase_flops(config), run=run.name, gpus=n, gpus_per_node=gpus_per_node,
                                     speeds=speeds))
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
    from megatron_ext.study.plan_text import tree_rows

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
    if plan.merges:
        out.append(f"  merges: {len(plan.merges)} job(s) of one CPU process after their runs (seconds to minutes "
                   "each: the parents' weights read and averaged once), not counted")
    total = cost.total_gpu_hours
    line = f"  whole study: {_gh(total)} GPU-hours"
    if cost.sequential_s is not None and (evaluation is None or not math.isnan(evaluation.wall_s)):
        after = evaluation.wall_s if evaluation is not None else 0.0
        line += (f"; wall time {hours(cost.sequential_s + after)} (local launcher) or "
                 f"{hours(cost.parallel_s + after)} (slurm launcher), the evaluation after the training")
    out.append(line)
    return "\n".join(out)


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
        config, start = costed_config(run), min(start, segment.end)
        cost = segment_cost(config, phase_flops(config, start, segment.end), run=run.name, start=start,
                            end=segment.end, gpus=n, gpus_per_node=8, speeds=speeds)
        if cost.seconds is None:
            say(f"ETA: at the pace so far ({cost.speeds[0]})")
            return None
        found[run.name] = cost.seconds
    return found
