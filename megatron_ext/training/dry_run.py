"""``--dry-run``: validate a run configuration for a world size and print its plan, on any machine."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_ext.model.config import parameter_count
from megatron_ext.schedule import lr_at
from megatron_ext.training.config import PER_SPLIT_PATHS, RunConfig
from megatron_ext.training.context import PhaseContext, rampup_schedule, reads_sources, varies
from megatron_ext.training.mixtures import SpanReads, format_source_plan, source_names
from megatron_ext.performance.flops import (ISOLATED_DOCUMENTS_CONVENTION, MFU_CONVENTION, flops_per_token,
                                            mean_lm_head_share, packed_attention)
from megatron_ext.training.layout import check_layout


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """The numbers a launch implies; every field is derived from the config and world size."""

    world_size: int
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    micro_batches_per_step: int
    tokens_per_step: int
    total_tokens: int
    parameters: int
    total_flops: float
    """Training FLOPs of the whole run (``flops.MFU_CONVENTION``)."""
    phases: tuple[tuple[str, int, int], ...]
    """(name, first step, end step) per phase."""


def make_plan(config: RunConfig, world_size: int) -> RunPlan:
    """The numbers a launch implies, after ``layout.check_layout`` (which raises a ``UserError``
    naming what does not divide)."""
    dp = check_layout(config, world_size)
    tp, pp = config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size
    d = config.data
    phases = config.resolved_phases
    names = tuple((p.name, p.start, p.end) for p in phases)
    tokens_per_step = d.global_batch_size * d.seq_length
    total_flops = training_flops(config)
    return RunPlan(
        world_size=world_size, tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp,
        micro_batches_per_step=d.global_batch_size // (d.micro_batch_size * dp),
        tokens_per_step=tokens_per_step,
        total_tokens=sum(steps_tokens(config, c, c.phase.start, c.phase.end) for c in config.phase_contexts),
        parameters=parameter_count(config.model), total_flops=total_flops, phases=names,
    )


def steps_tokens(config: RunConfig, context: PhaseContext, start: int, end: int) -> int:
    """Tokens of steps ``[start, end)`` of ``context``'s phase: its tokens per step, or under a
    batch-size ramp-up (``data.rampup_batch_size``) each step's own global batch at its length."""
    if config.data.rampup_batch_size is None:
        return context.tokens_per_step * (end - start)
    return context.seq_length * sum(config.global_batch_size_at(step) for step in range(start, end))


def phase_flops(config: RunConfig, start: int = 0, end: int | None = None) -> list[tuple[str, float]]:
    """``(objective tag, training FLOPs)`` of each phase's steps within ``[start, end)`` (default:
    the whole run), in the convention of ``flops.MFU_CONVENTION``, with attention counted within
    documents where they are isolated (``data.reset_attention_mask``: ``document_attention``,
    ``flops.ISOLATED_DOCUMENTS_CONVENTION``): what a segment of a study trains, per objective."""
    end = config.training.train_iters if end is None else end
    found = []
    for p, c in zip(config.resolved_phases, config.phase_contexts):  # each phase at its own length (attention)
        lo, hi = max(start, p.start), min(end, p.end)
        if hi <= lo:
            continue
        share = mean_lm_head_share(p, seq_length=c.seq_length, scored_only=config.training.lm_head_scored_only,
                                   steps=None if (lo, hi) == (p.start, p.end) else range(lo, hi))
        documents = document_attention(config, c.seq_length)
        attended = documents.attended if documents is not None else None
        found.append((p.objective.tag, steps_tokens(config, c, lo, hi)
                      * flops_per_token(config.model, c.seq_length, lm_head_share=share, attended=attended)))
    return found


def training_flops(config: RunConfig, start: int = 0, end: int | None = None) -> float:
    """Training FLOPs of steps ``[start, end)`` of a run (default: all of them)."""
    return sum(flops for _, flops in phase_flops(config, start, end))


# --- isolated documents' attention (``data.reset_attention_mask``) -----------------------------

SIMULATED_TOKENS = 4 * 2**20
"""Tokens of the first prefix packed into rows to estimate isolated documents' attention: a few
million, the first entries of its ``.idx`` (read with numpy, not Megatron: milliseconds), enough
for a mean that moves by well under a percent."""


@dataclass(frozen=True, kw_only=True)
class DocumentAttention:
    """The attention of rows of ``seq_length`` whose documents attend only within themselves,
    estimated from the data, or counted for full rows where the data cannot be read here."""

    seq_length: int
    attended: float | None
    """Keys per query on average, ``sum(d^2) / tokens`` over the packed rows (``flops.flops_per_token``'s
    ``attended``); None: counted for full rows (``seq_length``)."""
    mean_segment: float | None
    """Tokens per document piece in a row (documents, and the pieces a row edge cuts)."""
    source: str
    """The prefix read, or why none could be."""
    tokens: int = 0
    """Tokens packed."""

    def describe(self) -> str:
        if self.attended is None:
            return (f"attention FLOPs at seq {self.seq_length} counted for full rows: data not readable here "
                    f"({self.source})")
        return (f"attention FLOPs for isolated documents at seq {self.seq_length}, mean segment "
                f"{self.mean_segment:,.0f} tokens ({100 * self.attended / self.seq_length:.1f} % of full rows' "
                f"attention) from {self.source} (its first {token_count(self.tokens)} tokens packed)")


def document_attention(config: RunConfig, seq_length: int) -> DocumentAttention | None:
    """The attention of ``config``'s rows of ``seq_length`` with isolated documents
    (``data.reset_attention_mask``; None without): GPTDataset's packing simulated over the first
    :data:`SIMULATED_TOKENS` of the first prefix (in file order; the run shuffles documents, which
    moves where rows cut them, not how long they are). Documents are the ``.idx``'s: each ends with
    the EOD the model splits at when the data was made with ``--append-eod``. A prefix that cannot
    be read here (a login node without the compute nodes' mounts) counts full rows, and says so."""
    if not config.data.reset_attention_mask:
        return None
    prefix = config.data.blend[0][0]
    try:
        stat = os.stat(prefix + ".idx")
        return _packed_prefix(prefix, seq_length, stat.st_size, stat.st_mtime_ns)
    except (OSError, ValueError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        return DocumentAttention(seq_length=seq_length, attended=None, mean_segment=None,
                                 source=f"{prefix}.idx: {reason}")


@functools.lru_cache(maxsize=64)
def _packed_prefix(prefix: str, seq_length: int, size: int, mtime_ns: int) -> DocumentAttention:
    """:func:`document_attention` of one prefix's index as it is on disk (its size and time key the cache:
    a study prices many segments of the same data)."""
    lengths = index_document_lengths(prefix, SIMULATED_TOKENS)
    attended, mean_segment, tokens = packed_attention(lengths, seq_length, SIMULATED_TOKENS)
    return DocumentAttention(seq_length=seq_length, attended=attended, mean_segment=mean_segment, source=prefix,
                             tokens=tokens)


def index_document_lengths(prefix: str, tokens: int) -> np.ndarray:
    """Token counts of the first documents of ``prefix``'s ``.idx`` (Megatron's indexed dataset:
    the header, then ``int32`` sequence lengths, ``int64`` pointers and ``int64`` document starts in
    sequences), enough to cover ``tokens`` (fewer when the dataset holds fewer); memory-mapped, so
    only that much is read. ``ValueError`` when the file is not such an index."""
    from megatron_ext.data.index_checks import INDEX_ARRAYS_OFFSET, read_index_header

    path = prefix + ".idx"
    _, n_sequences, n_documents = read_index_header(path)  # UserError (a ValueError) naming the file
    if n_documents < 1:
        raise ValueError("no documents")
    take = min(n_sequences, tokens)  # no sequence is empty in ours; Megatron's may be, then fewer tokens
    if take == 0:
        raise ValueError("no sequences")
    lengths = np.memmap(path, dtype=np.int32, mode="r", offset=INDEX_ARRAYS_OFFSET, shape=(take,))
    starts = np.memmap(path, dtype=np.int64, mode="r", offset=INDEX_ARRAYS_OFFSET + 12 * n_sequences,
                       shape=(min(n_documents, take + 1),))
    before = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    starts = np.asarray(starts[starts < take])
    if starts.size == 0 or starts[0] != 0 or np.any(np.diff(starts) < 0):
        raise ValueError("corrupt document index")
    return np.diff(before[np.append(starts, take)])  # the last document up to the sequences read


def token_count(tokens: int) -> str:
    """``tokens`` with the unit that fits: ``512``, ``20.5K``, ``1.31M``, ``2.10B``, ``1.50T``."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if tokens >= size:
            value = tokens / size
            return f"{value:.3g}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return f"{tokens}"


def format_dry_run(config: RunConfig, plan: RunPlan, *, source_plan: Sequence[SpanReads] | None = None) -> str:
    """The plan ``--dry-run`` prints; ``source_plan``: what each data span reads from each source
    (``Preflight.source_plan``), in a run whose phases set their own data."""
    d, s, o, m = config.data, config.schedule, config.optimizer, config.model
    lines = [
        f"world size        {plan.world_size} = TP {plan.tensor_parallel} x PP {plan.pipeline_parallel} x DP {plan.data_parallel}",
        f"model             {config.model.num_layers} layers, hidden {config.model.hidden_size}, FFN "
        f"{config.model.ffn_hidden_size}, heads {config.model.num_attention_heads}/{config.model.num_query_groups} KV, "
        f"vocab {config.model.vocab_size:,}, {plan.parameters:,} parameters ({config.model.transformer_impl} layers)",
        f"batch             global {d.global_batch_size} = micro {d.micro_batch_size} x DP {plan.data_parallel} x "
        f"{plan.micro_batches_per_step} micro-batches/step, sequence {d.seq_length}",
        *_rampup_lines(config, plan),
        f"tokens            {plan.tokens_per_step:,}/step, {plan.total_tokens:,} in total ({token_count(plan.total_tokens)})",
        f"compute           {plan.total_flops / plan.total_tokens:.3e} FLOPs/token on average, "
        f"{plan.total_flops:.3e} FLOPs in total "
        f"[{ISOLATED_DOCUMENTS_CONVENTION if d.reset_attention_mask else MFU_CONVENTION}]",
        *_document_lines(config),
        f"optimizer         AdamW ({o.adam_beta1:g}, {o.adam_beta2:g}), eps {o.adam_eps:g}, weight decay "
        f"{o.weight_decay:g} on {'every parameter' if o.decay_norms_and_biases else 'matrices only'}, clip "
        f"{o.clip_grad:g}; init N(0, {m.init_method_std:g})"
        + (", output projections / sqrt(2 x layers)" if m.depth_scaled_init else " for every matrix"),
        f"learning rate     {s.lr_decay_style}, peak {s.lr:g}, warmup {s.lr_warmup_iters}"
        + (f", decay {s.lr_wsd_decay_iters} ({s.lr_wsd_decay_style})" if s.lr_decay_style == "wsd" else "")
        + f", min {s.min_lr:g}",
        "phases:",
        *_phase_lines(config, plan),
        _step_line(config),
        _checkpoint_line(config),
        _data_line(config),
        *_source_lines(config, source_plan),
    ]
    return "\n".join(lines)


def _phase_lines(config: RunConfig, plan: RunPlan) -> list[str]:
    """One line per phase (steps, tokens, learning rate), its notes, and its own context where
    phases differ in length, batch or RoPE base."""
    s, total, phases = config.schedule, config.training.train_iters, config.resolved_phases
    lines: list[str] = []
    contexts = config.phase_contexts
    first_tokens = contexts[0].tokens_per_step
    flops = phase_flops(config)
    for (name, start, end), phase, context, (_, phase_total) in zip(plan.phases, phases, contexts, flops):
        lr_start = lr_at(start, config=s, total_steps=total, phases=phases)
        lr_end = lr_at(end - 1, config=s, total_steps=total, phases=phases)
        lines.append(
            f"  {name:<9} steps [{start:>6}, {end:>6})  {end - start:>6} steps  "
            f"{token_count(steps_tokens(config, context, start, end)):>8} tokens  lr {lr_start:.2e} -> {lr_end:.2e}"
            + ("  (warmup restarts)" if phase.restart_warmup else "")
        )
        if notes := _phase_notes(config, context):
            lines.append("            " + "; ".join(notes))
        if varies(contexts) or len({c.rotary_base for c in contexts}) > 1:
            # Each phase's own length: attention's FLOPs per token grow with it.
            kept = ("same tokens/step" if context.tokens_per_step == first_tokens
                    else f"tokens/step {context.tokens_per_step:,} vs {first_tokens:,} in phases[0]")
            lines.append(
                f"            sequence {context.seq_length}, global {context.global_batch_size} = micro "
                f"{context.micro_batch_size} x DP {plan.data_parallel} x "
                f"{context.global_batch_size // (context.micro_batch_size * plan.data_parallel)}, RoPE base "
                f"{context.rotary_base:g}; {kept}; {phase_total / steps_tokens(config, context, start, end):.3e} "
                f"FLOPs/token, {phase_total:.3e} FLOPs")
    return lines


def _step_line(config: RunConfig) -> str:
    """What one step runs: precision, the parallel options and fusions, recomputation, the LM head."""
    t = config.training
    p = config.parallel
    params = {"bfloat16": "bf16 parameters (fp32 main parameters)", "float32": "fp32 parameters"}.get(
        config.model.params_dtype, f"{config.model.params_dtype} parameters")
    precision = (params + (", bf16 autocast" if t.bf16 else "")
                 + (f" + FP8 ({t.fp8_recipe}, {t.fp8_format})" if t.fp8_recipe else ""))
    options = [name for name, on in (("distributed optimizer", p.use_distributed_optimizer),
                                      ("overlapped grad reduce", p.overlap_grad_reduce),
                                      ("overlapped param gather", p.overlap_param_gather)) if on]
    options += [name for name, on in (("fused SwiGLU", t.bias_activation_fusion),
                                      (f"fused cross entropy ({t.cross_entropy_fusion_impl})", t.cross_entropy_loss_fusion),
                                      ("fused RoPE", t.rope_fusion),
                                      ("fused weight-gradient accumulation", t.gradient_accumulation_fusion)) if on]
    if t.recompute_granularity:
        options.append(f"{t.recompute_granularity} recomputation")
    options.append("LM head at scored positions only" if t.lm_head_scored_only else "LM head at every position")
    return f"step              {precision}" + (f"; {', '.join(options)}" if options else "")


def _checkpoint_line(config: RunConfig) -> str:
    """Where the run saves and loads, how often, what it keeps, and a branch."""
    c = config.checkpoint
    return (
        f"checkpoints       save={c.save or '-'} every {c.save_interval} steps, keep {c.keep_last}; "
        f"load={c.load or '-'}{' (weights only: continued pretraining)' if c.finetune else ''}"
        + (f"; branch from {c.branch_from} at step {c.branch_step}" if c.branch_from else "")
        + (f"; keeps steps {' '.join(map(str, c.keep_steps))}" if c.keep_steps else "")
    )


def _data_line(config: RunConfig) -> str:
    """What the run reads: per-split paths, a data_args_path file, or data_path, with the split."""
    d = config.data
    if d.per_split:
        return ("data              " + "; ".join(f"{name} {' '.join(map(str, paths))}" for name in PER_SPLIT_PATHS
                                               if (paths := getattr(d, name))) + " (each read whole)")
    if d.data_args_path is not None:
        prefixes = d.blend[0]
        return (f"data              {len(prefixes)} datasets from data_args_path {d.data_args_path} (first "
                f"{prefixes[0]}) (split {d.split})")
    return f"data              {' '.join(map(str, d.data_path))} (split {d.split})"


def _source_lines(config: RunConfig, source_plan: Sequence[SpanReads] | None) -> list[str]:
    """What each data span reads from each source, in a run whose phases set their own data
    (``training.mixtures``: shares after temperature, samples and tokens, epochs), as the trainer
    will read it (``source_plan``: the pre-flight's); said, not judged, where the pre-flight could not
    plan it here (its last lines say why)."""
    if not reads_sources(config.phase_contexts):
        return []
    if source_plan is None:
        return ["sources           per-source shares not computed here: the data is not at hand, or a run "
                "would refuse it (the last lines say which)"]
    return format_source_plan(source_plan).splitlines()


def source_samples(source_plan: Sequence[SpanReads]) -> list[tuple[int, int, dict[str, int]]]:
    """Per data span of a run whose phases set their own data: its steps ``[start, end)`` and the
    samples each source gives it, by the sources' names (``mixtures.source_names``): what
    ``performance.cost.split_cost`` shares the spans' costs by."""
    prefixes = list(dict.fromkeys(source.prefix for span in source_plan for source in span.sources))
    names = dict(zip(prefixes, source_names(prefixes)))
    return [(span.start, span.end, {names[source.prefix]: source.samples for source in span.sources})
            for span in source_plan]


def _phase_notes(config: RunConfig, context: PhaseContext) -> list[str]:
    """What sets a phase apart, on its own line under it: a length of its own (the long-context
    phase), the part of the batch-size ramp-up its steps run, isolated documents."""
    d, phase, i = config.data, context.phase, context.phase.index
    notes = []
    if phase.seq_length is not None and context.seq_length != d.seq_length:
        kind = "long" if context.seq_length > d.seq_length else "short"
        notes.append(f"{kind} context: phases[{i}].seq_length {context.seq_length} (data.seq_length {d.seq_length})")
    if d.rampup_batch_size is not None:
        ramp_end = next((step for step in range(config.training.train_iters)
                         if config.global_batch_size_at(step) == d.global_batch_size), config.training.train_iters)
        lo, hi = phase.start, min(phase.end, ramp_end)
        if hi > lo:
            first, last = config.global_batch_size_at(lo), config.global_batch_size_at(hi - 1)
            notes.append(f"batch ramp-up in steps [{lo}, {hi}): global {first}"
                         + (f" -> {last}" if last != first else "")
                         + f", {d.global_batch_size} from step {ramp_end} (data.rampup_batch_size)")
    if d.reset_attention_mask:
        notes.append("documents isolated: each attends only within itself (data.reset_attention_mask)")
    if context.mixture is not None:
        own = "its own" if phase.data_path is not None else "the run's"
        notes.append(f"data: {own} blend: {context.mixture.summary()}")
    if phase.valid_data_path is not None:
        notes.append(f"validation: its own blend ({len(phase.valid_data_path)} entries of phases[{i}].valid_data_path)")
    return notes


def _document_lines(config: RunConfig) -> list[str]:
    """Where isolated documents' attention FLOPs come from (``document_attention``), per length."""
    lengths = sorted({c.seq_length for c in config.phase_contexts})
    found = [document_attention(config, length) for length in lengths]
    return [f"documents         isolated (data.reset_attention_mask): {a.describe()}" for a in found if a is not None]


def _rampup_lines(config: RunConfig, plan: RunPlan) -> list[str]:
    """The batch-size ramp-up (``data.rampup_batch_size``): its sizes and the steps at each."""
    schedule = rampup_schedule(config.data)
    if schedule is None:
        return []
    start, increment, samples = config.data.rampup_batch_size
    total = config.training.train_iters
    first_step = {}
    for step in range(total):
        first_step.setdefault(config.global_batch_size_at(step), step)
    reached = ", ".join(f"{batch} from step {first_step[batch]}" for _, batch in schedule if batch in first_step)
    return [f"batch ramp-up     {start} + {increment} per {samples / (len(schedule) - 1):,.0f} samples to "
            f"{config.data.global_batch_size} over the first {samples:,} samples (Megatron-LM --rampup-batch-size): "
            f"{reached}"]


def save_cadence(config: RunConfig, seconds_per_step: float | None) -> str | None:
    """What a failure costs at the run's checkpoint cadence: the steps (and, at the estimated speed,
    ``seconds_per_step``: ``SegmentCost.step_seconds``, without the trainer's start-up, the time)
    between saves, ``checkpoint.save_interval_minutes`` bounding it; None without a save directory."""
    from megatron_ext.performance.cost import hours

    c = config.checkpoint
    if not c.save:
        return None
    every = f"every {c.save_interval} steps"
    if seconds_per_step is None:
        bound = "unknown time (no speed known)"
    else:
        bound = hours(c.save_interval * seconds_per_step)
    if c.save_interval_minutes is not None:
        every += f" or {c.save_interval_minutes:g} min"
        bound = (hours(60 * c.save_interval_minutes) if seconds_per_step is None
                 else hours(min(c.save_interval * seconds_per_step, 60 * c.save_interval_minutes)))
    return (f"save cadence      {every}: a failure loses at most {bound} of steps, plus the restart "
            "(checkpoint.save_interval, checkpoint.save_interval_minutes)")
