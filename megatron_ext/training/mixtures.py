"""Phases that read their own data: each source a stream that continues across phases.

A run any of whose phases sets ``data_path`` or ``temperature`` (``phases.Phase.DATA_KEYS``) reads
its training data here; a run none of whose phases does reads ``data.data_path`` as one Megatron
blend, as before (``training.context``).

- **A source** is one prefix of a blend (its train split, cut by ``data.split`` as Megatron cuts
  it). Its *stream* at sequence length ``L`` is its epochs one after the other, epoch ``e`` being
  Megatron's ``GPTDataset`` of the prefix over one epoch, shuffled with :func:`epoch_seed`: the
  run's ``training.seed`` for epoch 0, so that a source read within its first epoch reads what
  Megatron's ``GPTDataset`` of that prefix reads. Each document is read once per epoch of its
  source, in Megatron's shuffle, whatever the phases around it.
- **A data span** is consecutive phases of one length and one mixture (``context.DatasetSpan``).
  Its samples interleave its sources by Megatron's blending index (``helpers.build_blending_indices``,
  the greedy rule of ``BlendedDataset``, prefix-stable: a span's first ``n`` samples do not depend
  on its length) at the span's *shares*: each source's weight, or without weights its samples per
  epoch, to the power ``temperature`` (:func:`source_shares`).
- **Cursors.** Each source remembers the tokens read from it; a span at length ``L`` starts it at
  stream sample ``ceil(tokens / L)``. A source that stays, or comes back after phases without it,
  continues where the run left it; a source new to the run starts at its first sample. Everything is
  a pure function of the run config and the ``.idx`` files, so a resumed run reads exactly what the
  uninterrupted run reads, and the dry run prints what the trainer will read.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from megatron_ext.config_loading import UserError

EPOCHS_NAMED_ABOVE = 4.0
"""A source read for more epochs than this in a run is named by the dry run and the trainer's
start-up line (a small high-quality source repeated many times)."""


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_blend(data_path: Sequence[str], *, where: str) -> tuple[list[str], list[float] | None]:
    """A ``data_path`` (``data.data_path``, ``phases[i].data_path``) as Megatron's ``(prefixes,
    weights or None)``, the pair its ``datasets.utils.get_blend_from_list`` returns: ``weight
    prefix`` pairs when every other entry from the first is a number, prefixes alone otherwise; a
    mix, or a weight <= 0, refused naming ``where``."""
    entries = [str(entry).strip() for entry in data_path]
    if len(entries) % 2 == 0 and all(_is_number(weight) for weight in entries[::2]):
        prefixes, weights = entries[1::2], [float(weight) for weight in entries[::2]]
        if not all(w > 0 for w in weights):
            raise UserError(f"{where}: blend weights must be > 0, got {weights}")
        return prefixes, weights
    if any(_is_number(entry) for entry in entries):
        raise UserError(f"{where} {entries}: expected either only prefixes or alternating 'weight prefix' pairs, "
                        "got a mix")
    return entries, None


@dataclass(frozen=True, kw_only=True)
class Mixture:
    """What a phase's steps read from: a blend of sources and the temperature they are sampled at."""

    data_path: tuple[str, ...]
    """The blend (``data.data_path``'s forms)."""
    temperature: float | None = None
    """tau of :func:`source_shares` (None: 1)."""

    @property
    def prefixes(self) -> list[str]:
        return parse_blend(self.data_path, where="data_path")[0]

    @property
    def weights(self) -> list[float] | None:
        return parse_blend(self.data_path, where="data_path")[1]

    def summary(self) -> str:
        """``wiki 30% (weight), books 70% (weight), at temperature 0.5`` or the prefixes' file names
        (for the dry run's phase lines, which need no data)."""
        prefixes, weights = self.prefixes, self.weights
        names = source_names(prefixes)
        if weights is None:
            text = ", ".join(names) + " (shares by size)"
        else:
            total = sum(weights)
            text = ", ".join(f"{name} weight {100 * w / total:.0f}%" for name, w in zip(names, weights))
        return text + ("" if self.temperature is None else f", at temperature {self.temperature:g}")

    def describe(self) -> str:
        """``3 sources at temperature 0.5`` (for messages)."""
        n = len(self.prefixes)
        tau = "" if self.temperature is None else f" at temperature {self.temperature:g}"
        return f"{n} source{'s' * (n != 1)}{tau} ({' '.join(self.data_path)})"


def source_shares(mixture: Mixture, samples_per_epoch: Sequence[int]) -> list[float]:
    """Each source's share of a span's samples: its size ** tau, normalised, the size being its weight
    in the blend or, without weights, its samples per epoch at the span's length (tau 1 without
    weights: Megatron's unweighted blend, in proportion to the sources' sizes; tau 0: uniform)."""
    sizes = mixture.weights or [float(n) for n in samples_per_epoch]
    tau = 1.0 if mixture.temperature is None else float(mixture.temperature)
    powered = np.asarray(sizes, dtype=np.float64) ** tau
    return (powered / powered.sum()).tolist()


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of a source's epoch ``epoch``: the run's for epoch 0 (Megatron's own order),
    then a 32-bit seed drawn from ``(seed, epoch)`` (numpy's ``RandomState`` takes < 2**32)."""
    if epoch == 0:
        return seed
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1, dtype=np.uint32)[0])


@dataclass(frozen=True, kw_only=True)
class SourceRead:
    """One source in one data span: where the span starts it and how much it reads of it."""

    prefix: str
    share: float
    """Its share of the span's samples (:func:`source_shares`)."""
    samples_per_epoch: int
    """Samples of one epoch of it at the span's length."""
    first_sample: int
    """The stream sample the span reads first from it (epoch ``first_sample // samples_per_epoch``)."""
    samples: int
    """Samples the span reads from it."""

    @property
    def end_sample(self) -> int:
        """One past the last stream sample the span reads from it."""
        return self.first_sample + self.samples

    @property
    def epochs(self) -> range:
        """The epochs of the source the span reads from."""
        if self.samples == 0:
            return range(0)
        return range(self.first_sample // self.samples_per_epoch, (self.end_sample - 1) // self.samples_per_epoch + 1)


@dataclass(frozen=True, kw_only=True)
class SpanReads:
    """What one data span reads: its sources, in ``data_path`` order."""

    start: int
    """First step."""
    end: int
    """One past the last step."""
    seq_length: int
    mixture: Mixture
    samples: int
    """Samples the span reads (the sum of its steps' global batches)."""
    sources: tuple[SourceRead, ...]


BlendCounts = Callable[[Sequence[float], int], Sequence[int]]
"""``(shares, n)`` -> samples of each source among the first ``n`` of a span's blending index."""


def plan_reads(spans: Sequence, *, samples_per_epoch: Callable[[str, int], int], blend_counts: BlendCounts,
               sample_count: Callable[[object], int]) -> tuple[SpanReads, ...]:
    """Each data span's reads, cursors carried from span to span (module docstring).

    ``spans``: the run's ``context.DatasetSpan``s (each with its mixture); ``samples_per_epoch(prefix,
    L)``: one epoch of the prefix's train split at length ``L``; ``blend_counts``: the blending
    index's counts; ``sample_count(span)``: the samples a span reads."""
    tokens_read: dict[str, int] = {}
    out = []
    for span in spans:
        mixture, length = span.mixture, span.seq_length
        prefixes = mixture.prefixes
        per_epoch = [samples_per_epoch(prefix, length) for prefix in prefixes]
        shares = source_shares(mixture, per_epoch)
        n = sample_count(span)
        counts = blend_counts(shares, n)
        sources = []
        for prefix, share, epoch_samples, count in zip(prefixes, shares, per_epoch, counts):
            first = -(-tokens_read.get(prefix, 0) // length)
            sources.append(SourceRead(prefix=prefix, share=share, samples_per_epoch=epoch_samples,
                                      first_sample=first, samples=int(count)))
            tokens_read[prefix] = (first + int(count)) * length
        out.append(SpanReads(start=span.start, end=span.end, seq_length=length, mixture=mixture, samples=n,
                             sources=tuple(sources)))
    return tuple(out)


def epochs_read(plans: Sequence[SpanReads]) -> dict[str, float]:
    """Per source, the epochs of it the run reads (tokens read / tokens of one epoch, at each span's
    length), in the order the sources first appear."""
    out: dict[str, float] = {}
    for plan in plans:
        for source in plan.sources:
            out[source.prefix] = out.get(source.prefix, 0.0) + source.samples / source.samples_per_epoch
    return out


def repeated_sources(plans: Sequence[SpanReads], names: dict[str, str]) -> list[str]:
    """``name (N.N epochs)`` of each source read more than :data:`EPOCHS_NAMED_ABOVE` epochs."""
    return [f"{names[prefix]} ({epochs:.1f} epochs)" for prefix, epochs in epochs_read(plans).items()
            if epochs > EPOCHS_NAMED_ABOVE]


def format_span(plan: SpanReads, *, names: dict[str, str]) -> list[str]:
    """Lines of the dry run and the start-up log for one span: per source (by ``names``), its share,
    the samples and tokens read, and where in its stream (epochs)."""
    n = len(plan.sources)
    tau = "" if plan.mixture.temperature is None else f" at temperature {plan.mixture.temperature:g}"
    lines = [f"steps [{plan.start}, {plan.end}) at seq_length {plan.seq_length}: {plan.samples:,} samples from "
             f"{n} source{'s' * (n != 1)}{tau}"]
    for source in plan.sources:
        position = (f"epoch {source.first_sample / source.samples_per_epoch:.2f} -> "
                    f"{source.end_sample / source.samples_per_epoch:.2f}")
        lines.append(f"  {names[source.prefix]}: share {100 * source.share:.1f}% | {source.samples:,} samples, "
                     f"{source.samples * plan.seq_length:,} tokens | {position}")
    return lines


def check_enough_data(plans: Sequence[SpanReads]) -> None:
    """Every source of a span with a share has at least one sample per epoch (an empty epoch would
    never be read through), refused naming the prefix and the length."""
    for plan in plans:
        for source in plan.sources:
            if source.samples_per_epoch < 1:
                raise UserError(f"data_path {source.prefix!r}: its train split holds no whole sample of "
                                f"seq_length {plan.seq_length} (+1 token); steps [{plan.start}, {plan.end}) "
                                "read from it")


def format_source_plan(plans: Sequence[SpanReads]) -> str:
    """The start-up lines of a run whose phases set their own data: each span's sources
    (:func:`format_span`, by file name), then the sources read more than a few epochs."""
    prefixes = list(dict.fromkeys(source.prefix for plan in plans for source in plan.sources))
    names = dict(zip(prefixes, source_names(prefixes)))
    lines = ["sources read as streams (training.mixtures):"]
    for plan in plans:
        lines += ["  " + line for line in format_span(plan, names=names)]
    if repeated := repeated_sources(plans, names):
        lines.append(f"  read more than {EPOCHS_NAMED_ABOVE:g} epochs: {', '.join(repeated)}")
    return "\n".join(lines)


def source_names(prefixes: Sequence[str]) -> tuple[str, ...]:
    """Short names of a blend's prefixes for logs and records: their file names, with as many of
    their folders as it takes to tell them apart (``en/train_text_document``)."""
    parts = [os.path.normpath(prefix).split(os.sep) for prefix in prefixes]
    for depth in range(1, max((len(p) for p in parts), default=1) + 1):
        names = tuple("/".join(p[-depth:]) for p in parts)
        if len(set(names)) == len(set(prefixes)):
            return names
    return tuple(prefixes)
