"""Span masking (SpanBERT, Joshi et al. 2020): MLM that selects contiguous spans of tokens whose
lengths follow SpanBERT's distribution, a geometric law of parameter ``span_p`` (0.2) truncated to
``[1, max_span_length]`` (10): SpanBERT's ``len_distrib``, mean 3.8 at the defaults. SpanBERT
measures spans in words; here they are tokens.

Each sequence is walked as alternating gaps and spans: span lengths drawn from that law, gaps of
unmasked tokens (at least one, so spans never merge) from a geometric law whose mean
``mean_span * (1 - r) / r`` makes the expected selected share the ratio ``r`` (so a ratio above
``mean_span / (mean_span + 1)``, 0.79 at the defaults, is refused). Non-eligible positions
(special tokens, padding) inside a span stay unselected. The count varies per sequence around
``r * s``; the LM head at the scored positions needs a bound known on the host, so a sequence
keeps at most :func:`span_cap` selected positions (its first ones; more than five standard
deviations above the mean at the paper's sizes, so practically never cut).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from megatron_ext.config_loading import UserError
from megatron_ext.objectives.base import PhaseProgress, Vocabulary
from megatron_ext.objectives.mlm import MLM, Selection


def mean_span_length(span_p: float, max_span_length: int) -> float:
    """Mean of the geometric law of ``span_p`` truncated to ``[1, max_span_length]``."""
    weights = [span_p * (1 - span_p) ** (length - 1) for length in range(1, max_span_length + 1)]
    return sum(length * w for length, w in enumerate(weights, start=1)) / sum(weights)


def span_cap(seq_length: int, mask_ratio: float, max_span_length: int) -> int:
    """Most positions a sequence of ``seq_length`` keeps selected (module docstring)."""
    return min(seq_length, math.ceil(1.5 * mask_ratio * seq_length) + max_span_length)


def select_spans(tokens: torch.Tensor, eligible: torch.Tensor, *, mask_ratio: float, generator: torch.Generator,
                 span_p: float, max_span_length: int) -> tuple[torch.Tensor, int]:
    """:data:`~megatron_ext.objectives.mlm.Selection` of spans (module docstring)."""
    b, s = tokens.shape
    pairs = s // 2 + 1  # every gap and span is at least one position: enough to cover the row
    draws = torch.rand((b, pairs, 2), generator=generator, device=tokens.device, dtype=torch.float64)
    # Inverse CDFs: a geometric law of span_p truncated at max_span_length, and gaps on {1, 2, ...}.
    truncated_mass = 1.0 - (1.0 - span_p) ** max_span_length
    lengths = 1 + torch.floor(torch.log1p(-draws[..., 0] * truncated_mass) / math.log1p(-span_p)).long()
    mean_gap = mean_span_length(span_p, max_span_length) * (1.0 - mask_ratio) / mask_ratio
    gaps = 1 + torch.floor(torch.log1p(-draws[..., 1]) / math.log1p(-1.0 / mean_gap)).long() if mean_gap > 1 \
        else torch.ones_like(lengths)
    # Span k starts after the gaps and spans before it and its own gap (the first may start at 0).
    starts = (gaps + lengths).cumsum(dim=1) - lengths - 1
    ends = starts + lengths
    edges = torch.zeros((b, s + 1), dtype=torch.long, device=tokens.device)
    edges.scatter_add_(1, starts.clamp(max=s), torch.ones_like(starts))
    edges.scatter_add_(1, ends.clamp(max=s), -torch.ones_like(ends))
    selected = (edges[:, :s].cumsum(dim=1) > 0) & eligible
    cap = span_cap(s, mask_ratio, max_span_length)
    return selected & (selected.long().cumsum(dim=1) <= cap), cap


@dataclass(frozen=True, kw_only=True)
class SpanMLM(MLM):
    """MLM over spans (module docstring): MLM's settings plus the span-length law."""

    tag = "span"

    span_p: float = 0.2
    """Parameter of the geometric span-length law (SpanBERT: 0.2)."""

    max_span_length: int = 10
    """Longest span; the law is truncated there (SpanBERT: 10)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.span_p < 1.0:
            raise UserError(f"span_p must be in (0, 1), got {self.span_p}")
        if self.max_span_length < 1:
            raise UserError(f"max_span_length must be >= 1, got {self.max_span_length}")
        mean = mean_span_length(self.span_p, self.max_span_length)
        highest = mean / (mean + 1.0)  # at least one unmasked token between spans
        for ratio in self.ratio_ends():
            if ratio > highest:
                raise UserError(f"mask_ratio {ratio} is above {highest:.3f}, the most span masking reaches with "
                                f"mean span length {mean:.2f} and a token between spans")

    def select(self, vocabulary: Vocabulary, device: torch.device) -> Selection:
        return functools.partial(select_spans, span_p=self.span_p, max_span_length=self.max_span_length)

    def lm_head_share(self, progress: PhaseProgress, *, seq_length: int) -> float:
        return span_cap(seq_length, self.mask_ratio_at(progress), self.max_span_length) / seq_length

    def peak_lm_head_share(self, *, seq_length: int) -> float:
        return max(span_cap(seq_length, ratio, self.max_span_length) / seq_length
                   for ratio in self.ratio_ends())
