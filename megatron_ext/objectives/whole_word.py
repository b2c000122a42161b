"""Whole-word masking (WWM): MLM that selects every token of a word or none of it (BERT's
whole-word release, transformers PR 39485 for byte-level BPE and SentencePiece vocabularies).

Words are BERT's (text split at whitespace, around punctuation and around CJK ideographs), read
from the tokenizer's vocabulary (``EncoderTokenizer.word_boundaries``: 'Ġ' / '▁' marks or WordPiece
'##' continuations, and tokens that begin or end with punctuation or whitespace). A word is a token
that starts one and the tokens after it up to the next start; anything not eligible (special
tokens, padding) ends a word. Words are drawn in a uniformly random order and taken while the
selected tokens stay within MLM's exact count ``floor(mask_ratio * n + 0.5)`` (so the count is at
most that, short of it by less than the first word that would overshoot); replacement then works
per token, as in MLM.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from megatron_ext.objectives.base import Vocabulary
from megatron_ext.objectives.mlm import MLM, Selection, max_selected, selected_counts


def select_whole_words(tokens: torch.Tensor, eligible: torch.Tensor, *, mask_ratio: float,
                       generator: torch.Generator, word_boundaries: torch.Tensor) -> tuple[torch.Tensor, int]:
    """:data:`~megatron_ext.objectives.mlm.Selection` of whole words; ``word_boundaries`` is the
    bool ``[2, vocab]`` table of ``Vocabulary.word_boundaries`` (row 0: the id starts a word,
    row 1: it ends one)."""
    word_starts, word_ends = word_boundaries
    starts = word_starts[tokens] | ~eligible
    starts[:, 1:] |= ~eligible[:, :-1] | word_ends[tokens[:, :-1]]
    starts[:, 0] = True
    word = starts.long().cumsum(dim=1) - 1  # each position's word, numbered per row from 0
    size = torch.zeros_like(word).scatter_add_(1, word, eligible.long())  # eligible tokens per word
    scores = torch.rand(tokens.shape, generator=generator, device=tokens.device).masked_fill(size == 0, 2.0)
    order = scores.argsort(dim=1)  # the words of each row in random order, empty slots last
    taken_in_order = size.gather(1, order).cumsum(dim=1) <= selected_counts(eligible, mask_ratio).unsqueeze(1)
    taken = torch.zeros_like(eligible).scatter_(1, order, taken_in_order)
    return taken.gather(1, word) & eligible, max_selected(tokens.shape[1], mask_ratio)


@dataclass(frozen=True, kw_only=True)
class WholeWordMLM(MLM):
    """MLM over whole words (module docstring); the settings are MLM's."""

    tag = "wwm"

    def select(self, vocabulary: Vocabulary, device: torch.device) -> Selection:
        return functools.partial(select_whole_words, word_boundaries=vocabulary.word_boundaries(device))
