"""Whether a run fits in memory, from the memory model (``performance.memory``): ``--dry-run``'s memory
lines (judged against a GPU of ``--gpu KIND``, else against this machine where it runs the plan's
processes: ``hardware.runs_elsewhere``; a 64-process plan made on a CPU login node is not judged by the
login node's memory: the dry run says memory was not checked and names ``--gpu KIND``), ``pretrain``'s
refusal of a config whose estimate exceeds the memory this process can use
(``hardware.usable_memory_bytes``), naming the estimate and the settings that reduce it, instead of
hanging or dying in the allocator an hour in, and the largest micro-batch that fits.

The estimate is of every phase at its own sequence length and micro-batch (``training.context``); the
refusal only triggers when the estimate alone exceeds the usable memory (the model leaves out the CUDA
context and the allocator's fragmentation), and the plan says how close a config comes.
"""

from __future__ import annotations

from dataclasses import replace

from megatron_ext import hardware
from megatron_ext.config_loading import UserError
from megatron_ext.performance.devices import GPU_MEMORY_GIB
from megatron_ext.performance.memory import GiB, MemoryEstimate, rank_memory
from megatron_ext.training.config import RunConfig
from megatron_ext.training.context import varies
from megatron_ext.training.layout import check_layout, layout_problem


def estimate_memory(config: RunConfig, *, world_size: int) -> MemoryEstimate:
    """Peak bytes per rank of ``config`` at ``world_size`` processes (``performance.memory``): of its
    most demanding phase when phases read other lengths or batches (``training.context``)."""
    return max(phase_memory(config, world_size=world_size), key=lambda estimate: estimate.total)


def phase_memory(config: RunConfig, *, world_size: int) -> list[MemoryEstimate]:
    """Peak bytes per rank of each phase at its own sequence length and micro-batch
    (``training.context``); one estimate for all when no phase changes them."""
    data_parallel = check_layout(config, world_size)
    contexts = config.phase_contexts
    if not varies(contexts):
        return [rank_memory(config, data_parallel=data_parallel, data=config.data, phases=config.resolved_phases)] * len(contexts)
    return [rank_memory(config, data_parallel=data_parallel, data=c.data_config(config.data), phases=(c.phase,))
            for c in contexts]


def reduce_memory_advice(config: RunConfig, *, on_gpu: bool = True, phase: int | None = None) -> str:
    """What reduces the memory of ``config``: only the settings it does not have already (recomputation
    and CUDA graphs only where they apply: on a GPU). For phase ``phase`` of a run whose phases read
    other lengths or batches, its own keys (``phases[i].micro_batch_size``, and ``phases[i].seq_length``
    where it sets one): the run's ``data.*`` would change every phase, or none where it sets its own."""
    t, p = config.training, config.parallel
    if phase is None:
        micro, length = config.data.micro_batch_size, "data.seq_length"
        keys = [f"data.micro_batch_size (now {micro})"] if micro > 1 else []
    else:
        micro = config.phase_contexts[phase].micro_batch_size
        keys = [f"phases[{phase}].micro_batch_size (now {micro})"] if micro > 1 else []
        length = f"phases[{phase}].seq_length" if config.phases[phase].seq_length is not None else "data.seq_length"
    advice = ["lower " + " or ".join(keys + [length])]  # a micro-batch of 1 cannot be lowered
    if t.recompute_granularity != "full" and on_gpu:
        advice.append("set training.recompute_granularity: full")
    if not t.lm_head_scored_only:
        advice.append("set training.lm_head_scored_only: true")
    if not p.use_distributed_optimizer:
        advice.append("use parallel.use_distributed_optimizer")
    advice.append("raise tensor/pipeline_model_parallel_size")
    if t.cuda_graphs != "none":
        advice.append("set training.cuda_graphs: none")
    return ", ".join(advice[:-1]) + ", or " + advice[-1]


def check_fits(estimate: MemoryEstimate, usable_bytes: int, where: str, *, advice: str) -> None:
    """Raise ``UserError`` when ``estimate`` exceeds ``usable_bytes``, naming what reduces it."""

    if estimate.total > usable_bytes:
        raise UserError(f"this run needs about {estimate.total / GiB:.1f} GiB per rank but {where} has "
                        f"{usable_bytes / GiB:.1f} GiB usable ({estimate.describe()}); {advice}")


def memory_report(config: RunConfig, *, world_size: int, gpu_kind: str | None = None) -> str:
    """``--dry-run``'s memory lines: the estimate and whether it fits a GPU of ``gpu_kind`` (``--gpu``:
    a plan made on a login node is for the compute nodes' GPUs), else this machine's device where this
    machine runs the plan's processes (``hardware.runs_elsewhere``); elsewhere the estimate alone, saying
    that memory was not checked and how to check it (a verdict about this machine would be about the
    wrong one)."""

    if gpu_kind in GPU_MEMORY_GIB:
        usable, where, on = GPU_MEMORY_GIB[gpu_kind] * GiB, f"a {gpu_kind} ({GPU_MEMORY_GIB[gpu_kind]} GiB)", f"on a {gpu_kind}"
        gpu, run_there = True, f"a run on a {gpu_kind}"
    elif (reason := hardware.runs_elsewhere(world_size)) is not None:
        return _unchecked_memory_report(config, world_size=world_size, reason=reason)
    else:
        (usable, where), gpu = hardware.usable_memory_bytes(), hardware.on_gpu()
        on, run_there = "on this machine", "a run here"
    if varies(config.phase_contexts):
        return _phase_memory_report(config, world_size=world_size, usable=usable, where=where, on=on, on_gpu=gpu)
    estimate = estimate_memory(config, world_size=world_size)
    if estimate.total <= usable:
        verdict = f"fits {where}: {usable / GiB:.1f} GiB usable"
    else:
        verdict = (f"NOT READY, {run_there} would stop: {usable / GiB:.1f} GiB usable in {where}; "
                   f"{reduce_memory_advice(config, on_gpu=gpu)}")
    largest = largest_micro_batch(config, world_size=world_size, usable_bytes=usable)
    choice = (f"{largest} (data.micro_batch_size; {config.data.micro_batch_size} in this config)" if largest
              else "none, even 1 exceeds it")
    same = "same global batch" + (" and ramp-up batches" if config.data.rampup_batch_size is not None else "")
    return (f"memory/rank       {estimate.describe()}\n                  {on}: {verdict}\n"
            f"                  largest micro-batch within {100 * (1 - MICRO_BATCH_HEADROOM):.0f} % of that memory, "
            f"{same}: {choice}")


def _unchecked_memory_report(config: RunConfig, *, world_size: int, reason: str) -> str:
    """The memory lines of a plan this machine does not run (``hardware.runs_elsewhere``): the estimate,
    and the flag that checks it."""

    check = (f"memory not checked ({reason}): give --gpu KIND ({', '.join(GPU_MEMORY_GIB)}) to check it "
             "against that GPU's memory")
    if not varies(config.phase_contexts):
        estimate = estimate_memory(config, world_size=world_size)
        return f"memory/rank       {estimate.describe()}\n                  {check}"
    lines = [f"memory/rank       per phase; {check}:"]
    for context, estimate in zip(config.phase_contexts, phase_memory(config, world_size=world_size)):
        lines.append(f"  phases[{context.phase.index}] {context.phase.name:<8} seq {context.seq_length} x micro "
                     f"{context.micro_batch_size}: {estimate.describe()}")
    return "\n".join(lines)


MICRO_BATCH_HEADROOM = 0.25
"""Share of the usable memory a chosen micro-batch leaves free: the CUDA context, the allocator's
fragmentation and the estimate's own error (about 6 % high at 1B on an H100, 5 % on an H200) live
there, and a longer validation batch or a new phase's larger LM head must not end a run days in."""


def largest_micro_batch(config: RunConfig, *, world_size: int, usable_bytes: int,
                        headroom: float = MICRO_BATCH_HEADROOM, sequences_per_rank: int | None = None) -> int | None:
    """The largest ``data.micro_batch_size`` whose estimate at ``world_size`` processes stays within
    ``(1 - headroom) * usable_bytes``, among the sizes that split ``sequences_per_rank`` evenly (by
    default one data-parallel rank's share of the global batch at ``world_size``: the global batch,
    and with it the training, is unchanged, only the number of micro-batches per step changes) and
    that the run accepts (:func:`_candidate`: a batch-size ramp-up's smaller batches must split into
    whole micro-batches too); ``None`` when even one sequence does not fit. Never raises for a config
    that ``layout.check_layout`` accepts. Larger
    micro-batches mean fewer, bigger kernels per step and fewer host calls per token, which is what a
    host-bound step (Transformer Engine at small micro-batches) lacks."""

    per_rank = sequences_per_rank or config.data.global_batch_size // check_layout(config, world_size)
    for micro in sorted((n for n in range(1, per_rank + 1) if per_rank % n == 0), reverse=True):
        candidate = _candidate(config, world_size, lambda c: replace(c, data=replace(c.data, micro_batch_size=micro)))
        if candidate is not None and \
                estimate_memory(candidate, world_size=world_size).total <= (1 - headroom) * usable_bytes:
            return micro
    return None


def _candidate(config: RunConfig, world_size: int, change) -> RunConfig | None:
    """``change(config)`` when the run could train with it (the config's own checks and
    ``layout.check_layout``'s: every global batch of the run, a batch-size ramp-up's included,
    divisible by micro-batch x data-parallel size), else None: a micro-batch search proposes only
    settings the run accepts."""

    try:
        candidate = change(config)
    except UserError:
        return None
    return candidate if layout_problem(candidate, world_size) is None else None


def check_run_fits(config: RunConfig, *, world_size: int, usable_bytes: int, where: str) -> None:
    """:func:`check_fits` of every phase; a phase at another length or batch that does not fit is
    named, with the largest micro-batch that does (``phases[i].micro_batch_size``)."""

    contexts = config.phase_contexts
    if not varies(contexts):
        return check_fits(estimate_memory(config, world_size=world_size), usable_bytes, where,
                          advice=reduce_memory_advice(config, on_gpu=hardware.on_gpu()))
    for context, estimate in zip(contexts, phase_memory(config, world_size=world_size)):
        if estimate.total > usable_bytes:
            i = context.phase.index
            largest = largest_phase_micro_batch(config, i, world_size=world_size, usable_bytes=usable_bytes)
            fix = (f"set phases[{i}].micro_batch_size: {largest}" if largest
                   else reduce_memory_advice(config, on_gpu=hardware.on_gpu(), phase=i))
            raise UserError(f"phases[{i}] ({context.seq_length} tokens x micro-batch {context.micro_batch_size}) needs "
                            f"about {estimate.total / GiB:.1f} GiB per rank but {where} has {usable_bytes / GiB:.1f} "
                            f"GiB usable ({estimate.describe()}); {fix}")


def _phase_memory_report(config: RunConfig, *, world_size: int, usable: int, where: str, on: str,
                         on_gpu: bool) -> str:
    """``--dry-run``'s memory lines of a run whose phases read other lengths or batches: each
    phase's estimate, and for one that does not fit, the largest micro-batch that does (``on``: on
    this machine, or on the GPU kind of ``--gpu``)."""
    lines = [f"memory/rank       per phase, {on} ({where}: {usable / GiB:.1f} GiB usable):"]
    for context, estimate in zip(config.phase_contexts, phase_memory(config, world_size=world_size)):
        i = context.phase.index
        line = (f"  phases[{i}] {context.phase.name:<8} seq {context.seq_length} x micro {context.micro_batch_size}: "
                f"{estimate.describe()}")
        if estimate.total > usable:
            largest = largest_phase_micro_batch(config, i, world_size=world_size, usable_bytes=usable)
            line += (f"; NOT READY, this phase would not fit: set phases[{i}].micro_batch_size: {largest}"
                     if largest else f"; NOT READY, this phase would not fit, and no micro-batch fits within "
                     f"{100 * (1 - MICRO_BATCH_HEADROOM):.0f} % of that memory: "
                     f"{reduce_memory_advice(config, on_gpu=on_gpu, phase=i)}")
        lines.append(line)
    return "\n".join(lines)


def largest_phase_micro_batch(config: RunConfig, index: int, *, world_size: int, usable_bytes: int,
                              headroom: float = MICRO_BATCH_HEADROOM) -> int | None:
    """:func:`largest_micro_batch` for phase ``index`` (its ``micro_batch_size``, same global batch)."""

    context = config.phase_contexts[index]
    per_rank = context.global_batch_size // check_layout(config, world_size)
    for micro in sorted((n for n in range(1, per_rank + 1) if per_rank % n == 0), reverse=True):
        candidate = _candidate(config, world_size, lambda c: replace(c, phases=tuple(
            replace(phase, micro_batch_size=micro) if i == index else phase for i, phase in enumerate(c.phases))))
        if candidate is not None and \
                phase_memory(candidate, world_size=world_size)[index].total <= (1 - headroom) * usable_bytes:
            return micro
    return None
