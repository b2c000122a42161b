"""Words and units, shared by the objectives that mask whole words or spans of them
(``whole_word``, ``span``): each position's word from the tokenizer's word-boundary table, the
selection of whole units filling MLM's exact count by BERT's rule, and the refusal of a vocabulary
whose ids do not say where words begin."""

from __future__ import annotations

import torch

from megatron_ext.config_loading import UserError
from megatron_ext.objectives.mlm import selected_counts

FILL_ROUNDS = 8
"""Passes of :func:`fill_budget`. Each pass after the first starts with less of the count left than
the length of the word that ended the pass before, so BERT's rule is complete once a pass ends on
a one-token word; eight passes reach it on every row of the tests' long-word text (a row short of
its count after them would need eight words in a row to overshoot, each shorter than the last)."""


def fill_budget(sizes: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """BERT's rule for units (words, spans) of ``sizes`` ``[b, u]`` (tokens each, 0 for an empty
    slot), already in a random order: walk them in that order and take each one that still fits
    in what is left of ``budget`` ``[b]``, skipping (not stopping at) one that does not. Returns
    the bool ``[b, u]`` of the units taken.

    As tensor passes: each takes, among the units not yet taken that fit what is left, the longest
    run (in order) whose total fits; the unit that ends that run does not fit what then remains,
    nor does any unit skipped before it, which is exactly what the sequential walk skips."""
    taken = torch.zeros_like(sizes, dtype=torch.bool)
    left = budget.unsqueeze(1).clone()
    for _ in range(FILL_ROUNDS):
        fits = ~taken & (sizes > 0) & (sizes <= left)
        running = torch.where(fits, sizes, 0).cumsum(dim=1)
        take = fits & (running <= left)
        if sizes.device.type == "cpu" and not take.any():
            break  # settled (later passes take nothing); asking costs a GPU a wait for the device
        taken |= take
        left -= torch.where(take, sizes, 0).sum(dim=1, keepdim=True)
    return taken


def word_numbers(tokens: torch.Tensor, eligible: torch.Tensor, word_boundaries: torch.Tensor) -> torch.Tensor:
    """Each position's word, numbered per row from 0 (long ``[b, s]``), from the ``[2, vocab]`` table
    of ``Vocabulary.word_boundaries`` (row 0: the id starts a word, row 1: it ends one); a
    position that is not ``eligible`` is a word of its own and ends the one before it."""
    word_starts, word_ends = word_boundaries
    starts = word_starts[tokens] | ~eligible
    starts[:, 1:] |= ~eligible[:, :-1] | word_ends[tokens[:, :-1]]
    starts[:, 0] = True
    return starts.long().cumsum(dim=1) - 1


def select_units(unit: torch.Tensor, eligible: torch.Tensor, *, mask_ratio: float,
                 generator: torch.Generator) -> torch.Tensor:
    """Selected positions (bool ``[b, s]``) when the positions form units numbered per row by
    ``unit`` (long ``[b, s]`` in ``[0, s]``; ``s`` for a position in no unit): the units' eligible
    positions are taken whole, units in a random order filling MLM's exact count
    (:func:`fill_budget`)."""
    b, s = unit.shape
    in_unit = eligible & (unit < s)
    sizes = torch.zeros((b, s + 1), dtype=torch.long, device=unit.device)
    sizes.scatter_add_(1, unit, in_unit.long())
    sizes = sizes[:, :s]
    scores = torch.rand((b, s), generator=generator, device=unit.device).masked_fill(sizes == 0, 2.0)
    order = scores.argsort(dim=1)  # the units of each row in random order, empty slots last
    taken_in_order = fill_budget(sizes.gather(1, order), selected_counts(eligible, mask_ratio))
    taken = torch.zeros((b, s + 1), dtype=torch.bool, device=unit.device)
    taken[:, :s].scatter_(1, order, taken_in_order)
    return taken.gather(1, unit) & in_unit


def check_word_marks(objective_name: str, tokenizer) -> None:
    """Refuse a tokenizer whose ids say nothing of where words begin (``EncoderTokenizer.word_mark``),
    naming the objective and the tokenizer."""
    if tokenizer.word_mark() is None:
        raise UserError(
            f"objective {objective_name} masks whole words, but the pieces of tokenizer {tokenizer.name} carry no "
            "word mark ('Ġ', '▁' or '##'), so its ids do not say where words begin (a BPE trained behind a "
            "whitespace pre-tokenizer); use objective mlm, or a tokenizer that marks words (tools/train_tokenizer.py "
            "writes a byte-level BPE that does)")
