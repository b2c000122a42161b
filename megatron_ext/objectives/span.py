"""Span masking (SpanBERT, Joshi et al. 2020): MLM that selects contiguous spans of whole words
whose lengths follow SpanBERT's distribution, a geometric law of parameter ``span_p`` (0.2)
truncated to ``[1, max_span_length]`` (10): SpanBERT's ``len_distrib``, mean 3.8 at the defaults.
As in SpanBERT, lengths count words (``span_unit: word``, the default: BERT's words as whole-word
masking reads them from the vocabulary, ``objectives.whole_word``); ``span_unit: token`` counts
tokens instead, for a vocabulary whose pieces carry no word mark (word spans refuse one).

Each sequence's words are cut into units, each a span (its length drawn from that law) followed by
one separating word, so that two spans never touch (their lengths stay the law's), starting at a
random offset; units are then taken whole in a random order by BERT's rule
(``words.fill_budget``) up to MLM's exact count ``floor(mask_ratio * n + 0.5)``: a sequence
reaches it unless every span it leaves is longer than what is left (then short by less than its
shortest one). The share of words a sequence can hold in spans is ``mean / (mean + 1)`` (0.79 at
the defaults); a higher ratio is refused. Non-eligible positions (special tokens, padding) are
words of their own and stay unselected inside a span; a unit that holds an end of document is cut
there, so no span covers two documents.

Replacement is decided per span, as SpanBERT does (its paper, section 3.1, and ``span_masking`` in
its code, one draw per span): a span becomes mask tokens, random tokens or stays as it was as a
whole, with MLM's probabilities.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import torch

from megatron_ext.config_loading import UserError
from megatron_ext.objectives.base import Vocabulary
from megatron_ext.objectives.mlm import MLM, Selected, Selection, max_selected
from megatron_ext.objectives.words import check_word_marks, select_units, word_numbers


def mean_span_length(span_p: float, max_span_length: int) -> float:
    """Mean of the geometric law of ``span_p`` truncated to ``[1, max_span_length]``."""
    weights = [span_p * (1 - span_p) ** (length - 1) for length in range(1, max_span_length + 1)]
    return sum(length * w for length, w in enumerate(weights, start=1)) / sum(weights)


def span_units(word: torch.Tensor, *, generator: torch.Generator, span_p: float,
               max_span_length: int) -> torch.Tensor:
    """Each position's unit (long ``[b, s]``: its span's number, ``s`` for a separating word), the
    positions numbered by ``word`` (module docstring)."""
    b, s = word.shape
    units = s // 2 + max_span_length  # each unit holds >= 2 words: they cover the row and its offset
    draws = torch.rand((b, units + 1), generator=generator, device=word.device, dtype=torch.float64)
    # The inverse CDF of the geometric law of span_p truncated at max_span_length.
    truncated_mass = 1.0 - (1.0 - span_p) ** max_span_length
    lengths = 1 + torch.floor(torch.log1p(-draws[:, :units] * truncated_mass) / math.log1p(-span_p)).long()
    offset = torch.floor(draws[:, units:] * (lengths[:, :1] + 1)).long()  # the row starts inside unit 0
    ends = (lengths + 1).cumsum(dim=1) - offset  # each unit's end (exclusive) on the word axis, >= 1
    edges = torch.zeros((b, s + 2), dtype=torch.long, device=word.device)
    edges.scatter_add_(1, ends.clamp(max=s + 1), torch.ones_like(ends))  # 1 where a unit ends (past the row: s + 1)
    unit_of_word = edges[:, :s].cumsum(dim=1)  # the units ended at or before each word
    separator_of_word = edges[:, 1:s + 1] > 0  # the last word of its unit
    return torch.where(separator_of_word.gather(1, word), s, unit_of_word.gather(1, word))


def split_at_document_ends(unit: torch.Tensor, is_end: torch.Tensor) -> torch.Tensor:
    """``unit`` (:func:`span_units`) with every unit that holds a document end (``is_end``, bool
    ``[b, s]``: the EOD belongs to the document it ends) cut there, so that no span covers two
    documents. Rows without a document boundary keep their numbers (and so their draws)."""
    s = unit.shape[1]
    ends = is_end.long()
    document = ends.cumsum(dim=1) - ends
    starts = torch.ones_like(unit, dtype=torch.bool)
    starts[:, 1:] = (unit[:, 1:] != unit[:, :-1]) | (document[:, 1:] != document[:, :-1])
    renumbered = torch.where(unit == s, s, starts.long().cumsum(dim=1) - 1)
    crosses = (document[:, -1] != document[:, 0]).unsqueeze(1)
    return torch.where(crosses, renumbered, unit)


def select_spans(tokens: torch.Tensor, eligible: torch.Tensor, *, mask_ratio: float, generator: torch.Generator,
                 span_p: float, max_span_length: int, word_boundaries: torch.Tensor | None,
                 document_end_id: int | None = None) -> Selected:
    """:data:`~megatron_ext.objectives.mlm.Selection` of spans (module docstring); spans count the
    words of ``word_boundaries`` (``words.word_numbers``'s table), or tokens when None; with
    ``document_end_id`` they end at each document end (:func:`split_at_document_ends`)."""
    b, s = tokens.shape
    word = (word_numbers(tokens, eligible, word_boundaries) if word_boundaries is not None
            else torch.arange(s, device=tokens.device).expand(b, s))
    unit = span_units(word, generator=generator, span_p=span_p, max_span_length=max_span_length)
    if document_end_id is not None:
        unit = split_at_document_ends(unit, tokens == document_end_id)
    return Selected(positions=select_units(unit, eligible, mask_ratio=mask_ratio, generator=generator),
                    bound=max_selected(s, mask_ratio), replaced_together=unit)


@dataclass(frozen=True, kw_only=True)
class SpanMLM(MLM):
    """MLM over spans (module docstring): MLM's settings plus the span-length law."""

    tag = "span"

    span_p: float = 0.2
    """Parameter of the geometric span-length law (SpanBERT: 0.2)."""

    max_span_length: int = 10
    """Longest span; the law is truncated there (SpanBERT: 10)."""

    span_unit: Literal["word", "token"] = "word"
    """What span lengths count: ``word`` (SpanBERT; needs a vocabulary that marks words) or
    ``token``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.span_p < 1.0:
            raise UserError(f"span_p must be in (0, 1), got {self.span_p}")
        if self.max_span_length < 1:
            raise UserError(f"max_span_length must be >= 1, got {self.max_span_length}")
        if self.span_unit not in ("word", "token"):
            raise UserError(f"span_unit must be word or token, got {self.span_unit!r}")
        mean = mean_span_length(self.span_p, self.max_span_length)
        highest = mean / (mean + 1.0)  # at least one unmasked word between spans
        for field, ratio in self.ratio_fields():
            if ratio > highest:
                raise UserError(f"{field} {ratio} is above {highest:.3f}, the most span masking reaches with "
                                f"mean span length {mean:.2f} and a {self.span_unit} between spans")

    def select(self, vocabulary: Vocabulary, device: torch.device, document_ends: torch.Tensor | None) -> Selection:
        return functools.partial(select_spans, span_p=self.span_p, max_span_length=self.max_span_length,
                                 word_boundaries=vocabulary.word_boundaries(device) if self.span_unit == "word"
                                 else None, document_end_id=vocabulary.eod_id)

    def check_tokenizer(self, tokenizer) -> None:
        super().check_tokenizer(tokenizer)
        if self.span_unit == "word":
            check_word_marks(f"{self.name} (span_unit: word)", tokenizer)
