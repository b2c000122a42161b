"""Causal language modeling (CLM): next-token prediction with causal attention, on the dataset's
own shifted labels and loss mask."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megatron_ext.objectives.base import IGNORE_INDEX, Objective, ObjectiveBatch, PhaseProgress, Vocabulary


@dataclass(frozen=True, kw_only=True)
class CLM(Objective):
    """Next-token prediction at every position the dataset scores; no settings."""

    tag = "clm"
    causal = True
    needs_mask_token = False

    @property
    def name(self) -> str:
        return "clm"

    def make_batch(self, batch: Mapping[str, torch.Tensor], *, progress: PhaseProgress, vocabulary: Vocabulary,
                   generator: torch.Generator) -> ObjectiveBatch:
        return apply_clm(batch["tokens"], batch["labels"], loss_mask=batch["loss_mask"],
                         document_ends=batch.get("document_ends"))

    def lm_head_share(self, progress: PhaseProgress, *, seq_length: int) -> float:
        return 1.0

    def peak_lm_head_share(self, *, seq_length: int) -> float:
        return 1.0


def apply_clm(
    tokens: torch.Tensor, labels: torch.Tensor, *, loss_mask: torch.Tensor, document_ends: torch.Tensor | None = None
) -> ObjectiveBatch:
    """Next-token prediction on ``GPTDataset`` output: ``labels`` is ``tokens`` shifted by one.

    ``document_ends`` (isolated documents, ``ObjectiveBatch.document_ends``): a position whose input
    ends a document sees only that document, and its label is the next one's first token: it is not
    scored."""
    if tokens.dim() != 2 or tokens.shape != labels.shape or tokens.shape != loss_mask.shape:
        raise ValueError(
            "tokens, labels and loss_mask must share one [b, s] shape, got "
            f"{tuple(tokens.shape)}, {tuple(labels.shape)}, {tuple(loss_mask.shape)}"
        )
    scored = loss_mask > 0
    if document_ends is not None:
        scored = scored & ~document_ends
        loss_mask = loss_mask * scored
    return ObjectiveBatch(
        input_ids=tokens,
        labels=labels.masked_fill(~scored, IGNORE_INDEX),
        loss_mask=loss_mask.float(),
        causal=True,
        max_scored_per_sequence=tokens.shape[1],
        document_ends=document_ends,
    )
