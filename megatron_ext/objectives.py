"""Training objectives as pure tensor functions: masked (MLM) and causal (CLM) language modeling.

Both objectives turn what Megatron-Core's ``GPTDataset`` yields into an :class:`ObjectiveBatch`
(model inputs, labels, loss mask, attention direction). Nothing here touches the model,
distributed state or Megatron; only torch.

Data contract (``megatron.core.datasets.gpt_dataset.GPTDataset.__getitem__``, collated to
``[b, s]``). With ``add_extra_token_to_sequence=True`` (the default) a sample reads ``s + 1``
tokens ``text`` and yields:

- ``tokens = text[:-1]`` and ``labels = text[1:]`` (already shifted for next-token prediction);
- ``loss_mask`` (float): 1 everywhere except where ``labels`` is padding and, with
  ``eod_mask_loss=True``, where ``tokens`` is the EOD token (``_get_ltor_masks_and_position_ids``);
  all zeros for batch-padding samples (``idx=None``);
- padding ids in ``tokens`` and ``labels`` are rewritten to 0, a real vocabulary id. Padding only
  occurs in batch-padding samples and, with ``drop_last_partial_validation_sequence=False``, at
  the tail of the last validation sample; training samples are never padded.

CLM: :func:`apply_clm` takes ``tokens``, ``labels`` and ``loss_mask`` as given.
MLM: :func:`apply_mlm` takes ``tokens`` only (the dataset's labels, loss mask and causal
attention mask are ignored; the model must attend bidirectionally). Because padding looks like
token 0, pass ``maskable`` to exclude it when a batch may contain padding, e.g.
``maskable=(loss_mask.sum(-1, keepdim=True) > 0)`` drops batch-padding samples.

Labels are ``IGNORE_INDEX`` wherever ``loss_mask`` is 0. Megatron's vocab-parallel cross entropy
accepts such labels (out-of-partition ids give a finite value), which the loss mask then zeroes.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch

from megatron_ext.config_loading import UserError

IGNORE_INDEX = -100
"""Label value at positions that carry no loss (also ``torch.nn.CrossEntropyLoss``'s default)."""


@dataclass(frozen=True, kw_only=True)
class MaskingConfig:
    """How MLM corrupts its input. Replacement probabilities apply to the selected positions."""

    mask_ratio: float
    """Share of the maskable positions of each sequence that are selected (the paper: 0.2-0.5)."""

    mask_replace_prob: float = 1.0
    """Probability that a selected position becomes the mask token (1.0: the paper's likely
    setting; BERT's 80/10/10 is 0.8)."""

    random_replace_prob: float = 0.0
    """Probability that a selected position becomes a random non-special token (BERT: 0.1).
    The remaining ``1 - mask_replace_prob - random_replace_prob`` keep their original token."""

    def __post_init__(self) -> None:
        if not 0.0 < self.mask_ratio < 1.0:
            raise UserError(f"mask_ratio must be in (0, 1), got {self.mask_ratio}")
        for name in ("mask_replace_prob", "random_replace_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise UserError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.mask_replace_prob + self.random_replace_prob > 1.0 + 1e-12:
            raise UserError(
                "mask_replace_prob + random_replace_prob must be <= 1, got "
                f"{self.mask_replace_prob} + {self.random_replace_prob}"
            )


@dataclass(frozen=True, kw_only=True)
class ObjectiveBatch:
    """One micro-batch ready for the model and the loss."""

    input_ids: torch.Tensor
    """Model input ids, long ``[b, s]``."""

    labels: torch.Tensor
    """Target ids, long ``[b, s]``; ``IGNORE_INDEX`` where ``loss_mask`` is 0."""

    loss_mask: torch.Tensor
    """Float ``[b, s]``; 1 where a target is scored."""

    causal: bool
    """True: causal attention (CLM). False: bidirectional attention (MLM)."""

    max_scored_per_sequence: int
    """No sequence of the batch has more scored positions than this: a bound known on the host
    without reading ``loss_mask`` (the LM head at the scored positions selects this many rows per
    sequence, so the GPU never waits for the host). MLM: ``floor(mask_ratio * s + 0.5)``; CLM: ``s``."""


def apply_mlm(
    tokens: torch.Tensor,
    *,
    config: MaskingConfig,
    mask_id: int,
    vocab_size: int,
    special_ids: Collection[int],
    generator: torch.Generator,
    maskable: torch.Tensor | None = None,
) -> ObjectiveBatch:
    """Corrupt ``tokens`` ``[b, s]`` for masked language modeling.

    Selection is an exact count per sequence: ``floor(mask_ratio * n + 0.5)`` positions drawn
    uniformly without replacement among the ``n`` maskable positions of that sequence (lower
    variance than per-position Bernoulli draws; a sequence with few maskable positions may get
    none). Maskable = not in ``special_ids``, not ``mask_id``, and True in ``maskable`` (a bool
    tensor broadcastable to ``tokens``) when given. Each selected position is then independently
    replaced by ``mask_id``, by a uniformly drawn id of ``[0, vocab_size)`` outside
    ``special_ids``/``mask_id``, or kept, with the config's probabilities.

    The output is a function of the inputs and ``generator``'s state, which must live on
    ``tokens.device``.
    """
    if tokens.dim() != 2 or tokens.dtype != torch.long:
        raise ValueError(
            f"tokens must be a long [b, s] tensor, got {tokens.dtype} {tuple(tokens.shape)}"
        )
    if not 0 <= mask_id < vocab_size:
        raise ValueError(f"mask_id must be in [0, vocab_size={vocab_size}), got {mask_id}")
    excluded_ids = sorted({*special_ids, mask_id})
    if excluded_ids[0] < 0 or excluded_ids[-1] >= vocab_size:
        raise ValueError(
            f"special_ids must be in [0, vocab_size={vocab_size}), got {sorted(special_ids)}"
        )
    excluded = torch.tensor(excluded_ids, dtype=torch.long, device=tokens.device)

    eligible = ~torch.isin(tokens, excluded)
    if maskable is not None:
        eligible &= maskable.to(device=tokens.device, dtype=torch.bool)

    # Rank uniform scores per row with non-eligible positions pushed last; ranking (not a score
    # threshold) keeps the count exact even when float32 scores tie.
    scores = torch.rand(tokens.shape, generator=generator, device=tokens.device)
    scores = scores.masked_fill(~eligible, 2.0)
    order = scores.argsort(dim=1)
    ranks = torch.empty_like(order).scatter_(
        1, order, torch.arange(tokens.shape[1], device=tokens.device).expand_as(order)
    )
    n_eligible = eligible.sum(dim=1, dtype=torch.float64)
    n_selected = torch.floor(n_eligible * config.mask_ratio + 0.5).long()
    selected = ranks < n_selected.unsqueeze(1)

    choice = torch.rand(tokens.shape, generator=generator, device=tokens.device)
    to_mask = selected & (choice < config.mask_replace_prob)
    input_ids = tokens.masked_fill(to_mask, mask_id)
    if config.random_replace_prob > 0.0:
        replace_prob = config.mask_replace_prob + config.random_replace_prob
        to_random = selected & ~to_mask & (choice < replace_prob)
        allowed = torch.ones(vocab_size, dtype=torch.bool, device=tokens.device)
        allowed[excluded] = False
        allowed_ids = allowed.nonzero().squeeze(1)
        draws = torch.randint(
            len(allowed_ids), tokens.shape, generator=generator, device=tokens.device
        )
        input_ids = torch.where(to_random, allowed_ids[draws], input_ids)

    return ObjectiveBatch(
        input_ids=input_ids,
        labels=tokens.masked_fill(~selected, IGNORE_INDEX),
        loss_mask=selected.float(),
        causal=False,
        # n_selected's formula at n = s, its largest value (in float64, as n_selected).
        max_scored_per_sequence=math.floor(tokens.shape[1] * config.mask_ratio + 0.5),
    )


def apply_clm(
    tokens: torch.Tensor, labels: torch.Tensor, *, loss_mask: torch.Tensor
) -> ObjectiveBatch:
    """Next-token prediction on ``GPTDataset`` output: ``labels`` is ``tokens`` shifted by one."""
    if tokens.dim() != 2 or tokens.shape != labels.shape or tokens.shape != loss_mask.shape:
        raise ValueError(
            "tokens, labels and loss_mask must share one [b, s] shape, got "
            f"{tuple(tokens.shape)}, {tuple(labels.shape)}, {tuple(loss_mask.shape)}"
        )
    scored = loss_mask > 0
    return ObjectiveBatch(
        input_ids=tokens,
        labels=labels.masked_fill(~scored, IGNORE_INDEX),
        loss_mask=loss_mask.float(),
        causal=True,
        max_scored_per_sequence=tokens.shape[1],
    )
