"""What each phase's steps read: its sequence length, RoPE base and batch sizes (long context as a phase).

A phase may set ``seq_length``, ``rotary_base``, ``micro_batch_size`` and ``global_batch_size``
(``phases.Phase``); unset, they are the run's (``data.*``, ``model.rotary_base``), and a phase
with another length scales the run's batch sizes by ``data.seq_length / seq_length``, so that its
steps hold the same tokens (a global batch that does not scale to a whole number must be given).
Everything here is a pure function of the run config, so a resumed run reads what an uninterrupted
run reads at every step.

Data positions: the run counts Megatron's ``consumed_samples`` (the sum of the global batches of the
steps done). Each *dataset span* (``DatasetSpan``: consecutive phases of one length) reads
Megatron's ``GPTDataset`` of the same prefixes built at its length, from the sample that covers the
tokens the run has read before it (``ceil(tokens / length)``): a long final phase continues through
the corpus where the short phases stopped, as a run that had been at that length from the start
would be there, instead of reading its first documents again. Each length's dataset is built once
for all the samples its spans read, so its shuffle (Megatron's epochs) is a function of the run
only.

A run any of whose phases sets its own data (``data_path``, ``temperature``) gives each phase a
``Mixture``, and a span is also one mixture: each span then reads its sources as streams continued
across spans (``training.mixtures``), not one dataset per length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_ext.config_loading import UserError
from megatron_ext.phases import Phase, ResolvedPhase
from megatron_ext.training.mixtures import Mixture, parse_blend

DataConfig = Any
"""``training.config.DataConfig`` (not imported: the config module resolves contexts with this one)."""


@dataclass(frozen=True, kw_only=True)
class PhaseContext:
    """One phase with what its steps read, resolved."""

    phase: ResolvedPhase
    seq_length: int
    rotary_base: float
    micro_batch_size: int
    global_batch_size: int
    mixture: Mixture | None = None
    """The sources the phase reads from (``training.mixtures``) when any phase of the run sets its own
    data (``phases.Phase.DATA_KEYS``); None: the run reads ``data.data_path`` as one Megatron blend."""

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step (all data-parallel ranks)."""
        return self.seq_length * self.global_batch_size

    def data_config(self, data: DataConfig) -> DataConfig:
        """``data`` with this phase's length and batch sizes: what Megatron's dataset and the
        sampler of this phase are built from."""
        return dataclasses.replace(data, seq_length=self.seq_length, micro_batch_size=self.micro_batch_size,
                                   global_batch_size=self.global_batch_size)


def _scaled(value: int, data_length: int, length: int) -> int | None:
    """``value`` x ``data_length / length`` when that is a whole number >= 1, else None."""
    scaled, rest = divmod(value * data_length, length)
    return scaled if scaled >= 1 and rest == 0 else None


def phase_contexts(phases: Sequence[ResolvedPhase], *, data: DataConfig, rotary_base: float) -> tuple[PhaseContext, ...]:
    """Each phase's :class:`PhaseContext`, raising ``UserError`` naming ``phases[i].key`` when a
    default cannot be derived (module docstring)."""
    out = []
    streams = any(getattr(phase, key) is not None for phase in phases for key in Phase.DATA_KEYS)
    for phase in phases:
        where = f"phases[{phase.index}]"
        length = phase.seq_length or data.seq_length
        gbs = phase.global_batch_size
        if gbs is None:
            gbs = _scaled(data.global_batch_size, data.seq_length, length)
            if gbs is None:
                raise UserError(
                    f"{where}.seq_length={length}: keeping the run's {data.global_batch_size * data.seq_length:,} "
                    f"tokens per step needs a global batch of {data.global_batch_size} x {data.seq_length} / {length}, "
                    f"not a whole number; give {where}.global_batch_size")
        mbs = phase.micro_batch_size
        if mbs is None:
            # No more tokens per micro-batch than the run's (activation memory grows with them), and a
            # divisor of the global batch: the largest such micro-batch, 1 at least.
            limit = max(1, data.micro_batch_size * data.seq_length // length)
            mbs = max(m for m in range(1, min(limit, gbs) + 1) if gbs % m == 0)
        if gbs % mbs:
            raise UserError(f"{where}: global_batch_size {gbs} is not divisible by micro_batch_size {mbs}")
        mixture = None
        if streams:
            data_path = phase.data_path or data.training_entries  # the run's training blend
            parse_blend(data_path, where=f"{where}.data_path" if phase.data_path else "data")
            mixture = Mixture(data_path=tuple(data_path), temperature=phase.temperature)
        out.append(PhaseContext(phase=phase, seq_length=length, rotary_base=float(phase.rotary_base or rotary_base),
                                micro_batch_size=mbs, global_batch_size=gbs, mixture=mixture))
    return tuple(out)


def varies(contexts: Sequence[PhaseContext]) -> bool:
    """Whether any phase reads another length or batch than the first (one dataset and sampler
    serve the whole run otherwise, as before phases could change them)."""
    first = contexts[0]
    return any((c.seq_length, c.micro_batch_size, c.global_batch_size)
               != (first.seq_length, first.micro_batch_size, first.global_batch_size) for c in contexts)


def reads_sources(contexts: Sequence[PhaseContext]) -> bool:
    """Whether the run reads its sources as streams (``training.mixtures``): some phase sets its own data."""
    return contexts[0].mixture is not None


def context_at(contexts: Sequence[PhaseContext], step: int) -> PhaseContext:
    """The context of the phase that contains ``step``."""
    for context in contexts:
        if context.phase.start <= step < context.phase.end:
            return context
    raise ValueError(f"step {step} is outside the phases' range [0, {contexts[-1].phase.end})")


def consumed_samples(contexts: Sequence[PhaseContext], step: int) -> int:
    """Megatron's ``consumed_samples`` after ``step`` steps: the sum of their global batches."""
    return sum(c.global_batch_size * max(0, min(step, c.phase.end) - c.phase.start) for c in contexts)


def consumed_tokens(contexts: Sequence[PhaseContext], step: int) -> int:
    """Tokens the run has read after ``step`` steps."""
    return sum(c.tokens_per_step * max(0, min(step, c.phase.end) - c.phase.start) for c in contexts)


@dataclass(frozen=True, kw_only=True)
class DatasetSpan:
    """Consecutive phases of one sequence length (and, in a run whose phases set their own data, one
    mixture): one dataset, read from ``first_sample`` on."""

    seq_length: int
    start: int
    """First step."""
    end: int
    """One past the last step."""
    first_sample: int
    """The dataset sample its first step reads first."""
    contexts: tuple[PhaseContext, ...]
    mixture: Mixture | None = None
    """The span's sources (``training.mixtures``); None: ``data.data_path`` as one Megatron blend."""

    def sample_at(self, step: int) -> int:
        """The first dataset sample step ``step`` (in this segment) reads."""
        return self.first_sample + consumed_samples(self.contexts, step) - consumed_samples(self.contexts, self.start)

    @property
    def last_sample(self) -> int:
        """One past the last sample the segment reads."""
        return self.sample_at(self.end)


def dataset_spans(contexts: Sequence[PhaseContext]) -> tuple[DatasetSpan, ...]:
    """The run's dataset spans (module docstring)."""
    groups: list[list[PhaseContext]] = []
    for context in contexts:
        if groups and (groups[-1][-1].seq_length, groups[-1][-1].mixture) == (context.seq_length, context.mixture):
            groups[-1].append(context)
        else:
            groups.append([context])
    out = []
    for group in groups:
        start, length = group[0].phase.start, group[0].seq_length
        first = -(-consumed_tokens(contexts, start) // length)
        out.append(DatasetSpan(seq_length=length, start=start, end=group[-1].phase.end, first_sample=first,
                               contexts=tuple(group), mixture=group[0].mixture))
    return tuple(out)


def span_at(all_segments: Sequence[DatasetSpan], step: int) -> DatasetSpan:
    """The segment that contains ``step``."""
    for segment in all_segments:
        if segment.start <= step < segment.end:
            return segment
    raise ValueError(f"step {step} is outside the spans' range [0, {all_segments[-1].end})")


def dataset_samples(all_segments: Sequence[DatasetSpan], seq_length: int) -> int:
    """Samples the dataset at ``seq_length`` is built with: all its spans read."""
    return max(s.last_sample for s in all_segments if s.seq_length == seq_length)


def describe(context: PhaseContext) -> str:
    """``seq_length 256 x global batch 2, RoPE base 160000`` (the phase's context, for messages)."""
    text = (f"seq_length {context.seq_length} x global batch {context.global_batch_size}, "
            f"RoPE base {context.rotary_base:g}")
    if context.mixture is not None:
        text += f", {context.mixture.describe()}"
    return text


def first_context_change(a: Sequence[PhaseContext], b: Sequence[PhaseContext], *,
                         micro_batches: bool = False) -> tuple[int, str] | None:
    """The first step both runs train at which their sequence length, global batch, RoPE base or
    mixture (and, with ``micro_batches``, micro-batch size: it names the masking streams) differ,
    with both contexts described (``a``'s first); None when they agree on every such step."""
    def key(c: PhaseContext) -> tuple:
        return ((c.seq_length, c.global_batch_size, c.rotary_base, c.mixture)
                + ((c.micro_batch_size,) if micro_batches else ()))

    shared = min(a[-1].phase.end, b[-1].phase.end)  # the steps both runs train
    for step in sorted({c.phase.start for c in (*a, *b) if c.phase.start < shared}):  # constant in between
        ca, cb = context_at(a, step), context_at(b, step)
        if key(ca) != key(cb):
            extra = (f", micro batch {ca.micro_batch_size} vs {cb.micro_batch_size}"
                     if micro_batches and ca.micro_batch_size != cb.micro_batch_size else "")
            return step, (f"step {step} reads {describe(ca)} (phases[{ca.phase.index}]) vs {describe(cb)} "
                          f"(phases[{cb.phase.index}]){extra}")
    return None


# --- batch-size ramp-up (``data.rampup_batch_size``) ---------------------------------------------


def rampup_schedule(data: DataConfig) -> tuple[tuple[int, int], ...] | None:
    """``data.rampup_batch_size`` (Megatron-LM's ``start increment samples``) as the
    ``(first consumed sample, global batch)`` thresholds of Megatron-Core's step batch-size
    calculator (``StepBatchsizeNumMicroBatchesCalculator``, which replaced its ramp-up calculator):
    the old calculator's batch ``start + increment x floor(consumed / (samples / increments))``
    reaches increment ``i`` at the first whole sample >= ``i x samples / increments``."""
    if data.rampup_batch_size is None:
        return None
    start, increment, samples = data.rampup_batch_size
    increments = (data.global_batch_size - start) // increment
    return tuple((-(-i * samples // increments), start + i * increment) for i in range(increments + 1))


def rampup_schedule_text(schedule: Sequence[tuple[int, int]]) -> str:
    """The schedule as Megatron-Core's ``step_batch_size_schedule`` string (thresholds in samples)."""
    return " ".join(f"{threshold}:{batch}" for threshold, batch in schedule)


def step_global_batches(data: DataConfig, total_steps: int) -> tuple[int, ...]:
    """The global batch of each step under ``data.rampup_batch_size`` (the last threshold reached by
    the samples consumed before the step; ``data.global_batch_size`` throughout without one)."""
    schedule = rampup_schedule(data)
    if schedule is None:
        return (data.global_batch_size,) * total_steps
    out, consumed = [], 0
    for _ in range(total_steps):
        batch = next(b for threshold, b in reversed(schedule) if consumed >= threshold)
        out.append(batch)
        consumed += batch
    return tuple(out)
