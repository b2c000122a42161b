"""Whole-word masking (WWM): MLM that selects every token of a word or none of it (BERT's
whole-word release, transformers PR 39485 for byte-level BPE and SentencePiece vocabularies).

Words are BERT's (text split at whitespace, around punctuation and around CJK ideographs), read
from the tokenizer's vocabulary (``EncoderTokenizer.word_boundaries``: 'Ġ' / '▁' marks or WordPiece
'##' continuations, and tokens that begin or end with punctuation or whitespace). A word is a token
that starts one and the tokens after it up to the next start; anything not eligible (special
tokens, padding) ends a word. A vocabulary whose pieces carry none of those marks (a BPE trained
behind a whitespace pre-tokenizer) has no words to read from its ids: refused
(``EncoderTokenizer.word_mark``).

How many: MLM's exact count ``floor(mask_ratio * n + 0.5)`` per sequence, filled by BERT's rule
(``words.fill_budget``): words in a uniformly random order, each taken if it still fits and skipped
(not a stop) if it does not. A sequence therefore reaches its count exactly, unless every word it
leaves unmasked is longer than what is left of the count; then it falls short by less than its
shortest unmasked word (in practice never: a one-token word is nearly always left). Long words (URLs,
hashes, long numbers a vocabulary splits into many pieces) are masked a little less often than
short ones, as in BERT. Replacement then works per token, as in MLM.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from megatron_ext.objectives.base import Vocabulary
from megatron_ext.objectives.mlm import MLM, Selected, Selection, max_selected
from megatron_ext.objectives.words import check_word_marks, select_units, word_numbers


def select_whole_words(tokens: torch.Tensor, eligible: torch.Tensor, *, mask_ratio: float,
                       generator: torch.Generator, word_boundaries: torch.Tensor) -> Selected:
    """:data:`~megatron_ext.objectives.mlm.Selection` of whole words (module docstring);
    ``word_boundaries``: :func:`word_numbers`'s table."""
    word = word_numbers(tokens, eligible, word_boundaries)
    return Selected(positions=select_units(word, eligible, mask_ratio=mask_ratio, generator=generator),
                    bound=max_selected(tokens.shape[1], mask_ratio))


@dataclass(frozen=True, kw_only=True)
class WholeWordMLM(MLM):
    """MLM over whole words (module docstring); the settings are MLM's."""

    tag = "wwm"

    def select(self, vocabulary: Vocabulary, device: torch.device, document_ends: torch.Tensor | None) -> Selection:
        return functools.partial(select_whole_words, word_boundaries=vocabulary.word_boundaries(device))

    def check_tokenizer(self, tokenizer) -> None:
        super().check_tokenizer(tokenizer)
        check_word_marks(self.name, tokenizer)
