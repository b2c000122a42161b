"""Masked next-token prediction (MNTP, LLM2Vec, BehnamGhader et al. 2024): MLM's corruption with
bidirectional attention, but a masked token at position ``i`` is predicted from the output at
position ``i - 1``, as a decoder's LM head is trained to: the usual way to turn a decoder into an
encoder. Position 0 has no previous position and is never selected; the count per sequence is
MLM's over the remaining eligible positions.

Validation measures it as it trains: a run with an MNTP phase reports an ``mntp`` loss (MNTP at
``training.eval_mask_ratio``) beside the ``clm`` and same-position ``mlm`` ones; its export records
the offset (``hf.exporter``), and ``tools/fill_mask.py`` reads each mask one position earlier.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megatron_ext.objectives.base import IGNORE_INDEX, ObjectiveBatch, PhaseProgress, Vocabulary
from megatron_ext.objectives.mlm import MLM, Selected, Selection


def _after_first(select: Selection, document_ends: torch.Tensor | None = None) -> Selection:
    """``select`` never at position 0 (nothing precedes it) nor, with isolated documents
    (``document_ends``), at a document's first token (what precedes it is the previous
    document's end, which does not see it)."""
    def select_after_first(tokens: torch.Tensor, eligible: torch.Tensor, **kwargs) -> Selected:
        eligible = eligible.clone()
        eligible[:, 0] = False
        if document_ends is not None:
            eligible[:, 1:] &= ~document_ends[:, :-1]
        return select(tokens, eligible, **kwargs)

    return select_after_first


def shift_targets_left(batch: ObjectiveBatch) -> ObjectiveBatch:
    """Move each target from its position to the one before it (the last position scores nothing)."""
    ignored = torch.full_like(batch.labels[:, :1], IGNORE_INDEX)
    return dataclasses.replace(
        batch, labels=torch.cat([batch.labels[:, 1:], ignored], dim=1),
        loss_mask=torch.cat([batch.loss_mask[:, 1:], torch.zeros_like(batch.loss_mask[:, :1])], dim=1))


@dataclass(frozen=True, kw_only=True)
class MNTP(MLM):
    """Masked next-token prediction (module docstring); the settings are MLM's (LLM2Vec trains
    Llama-class models at ``mask_ratio`` 0.2 with BERT's 80/10/10 replacement)."""

    tag = "mntp"

    prediction_offset = -1

    def selectable_positions(self, seq_length: int) -> int:
        return seq_length - 1  # never position 0

    def select(self, vocabulary: Vocabulary, device: torch.device, document_ends: torch.Tensor | None) -> Selection:
        return _after_first(super().select(vocabulary, device, document_ends), document_ends)

    def make_batch(self, batch: Mapping[str, torch.Tensor], *, progress: PhaseProgress, vocabulary: Vocabulary,
                   generator: torch.Generator) -> ObjectiveBatch:
        return shift_targets_left(super().make_batch(batch, progress=progress, vocabulary=vocabulary,
                                                     generator=generator))
