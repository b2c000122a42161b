"""Held-out masked-language-modeling loss of an encoder: a Hugging Face masked LM or a Megatron
checkpoint, scored on exactly the same masked inputs.

The texts become what the trainer sees: each is tokenized like ``preprocess`` does (the
tokenizer's own special tokens, then EOD), the documents are concatenated and cut into full
``seq_length`` windows (Megatron's ``GPTDataset`` packs documents the same way; the tail is
dropped, so there is no padding and no attention mask). Masks come from
:func:`megatron_ext.objectives.apply_mlm` with a generator seeded by ``seed``: the same texts,
tokenizer ids, ratio and seed give the same masked inputs whichever model is scored, and
:attr:`MLMLoss.inputs_sha256` lets two measurements prove it.

The loss is the mean cross entropy (nats) over the selected positions, with the softmax over the
tokenizer's vocabulary: Megatron's padding rows are cut off, so a checkpoint and its EuroBERT
export score identically.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_ext.config_loading import UserError
from megatron_ext.objectives import IGNORE_INDEX, MaskingConfig, ObjectiveBatch, apply_mlm
from megatron_ext.tokenizer import EncoderTokenizer


@dataclass(frozen=True, kw_only=True)
class MLMLoss:
    """One held-out MLM measurement."""

    loss: float
    """Mean cross entropy (nats) over the masked positions."""
    accuracy: float
    """Share of masked positions whose top-1 prediction is the original token."""
    masked_tokens: int
    """Positions scored."""
    sequences: int
    """Windows of ``seq_length`` tokens scored."""
    inputs_sha256: str
    """Digest of the masked inputs and labels: equal digests = identical masks."""


def masked_windows(tokenizer: EncoderTokenizer, texts: Sequence[str], *, seq_length: int,
                   mask_ratio: float = 0.4, seed: int = 0,
                   max_sequences: int | None = None) -> ObjectiveBatch:
    """The texts as packed ``[n, seq_length]`` windows, MLM-masked (see the module docstring).

    Raises:
        UserError: the texts do not fill one window.
    """
    stream: list[int] = []
    for ids in tokenizer.tokenize_batch(list(texts), add_special_tokens=True):
        if ids:
            stream += [*ids, tokenizer.eod]
    n = len(stream) // seq_length
    if max_sequences is not None:
        n = min(n, max_sequences)
    if n < 1:
        raise UserError(f"the held-out texts give {len(stream)} tokens, fewer than one window of "
                        f"seq_length={seq_length}")
    tokens = torch.tensor(stream[: n * seq_length], dtype=torch.long).view(n, seq_length)
    return apply_mlm(tokens, config=MaskingConfig(mask_ratio=mask_ratio), mask_id=tokenizer.mask,
                     vocab_size=tokenizer.vocab_size, special_ids=tokenizer.special_ids,
                     generator=torch.Generator().manual_seed(seed))


def _logits_fn(model: Any):
    """``input_ids -> logits`` run bidirectionally, for either kind of model."""
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        return lambda ids: model(input_ids=ids).logits
    from megatron_ext.model import EncoderModel
    from megatron_ext.model.attention import attention_pattern

    if isinstance(model, EncoderModel):  # TP=1: the whole (padded) vocabulary
        return lambda ids: model(ids, packed_seq_params=attention_pattern(causal=False))
    raise TypeError(f"expected a transformers masked LM or a megatron_ext EncoderModel, got "
                    f"{type(model).__name__}")


@torch.no_grad()
def mlm_loss(model: Any, tokenizer: EncoderTokenizer, texts: Sequence[str], *,
             mask_ratio: float = 0.4, seq_length: int = 128, seed: int = 0,
             max_sequences: int | None = None, batch_size: int = 8) -> MLMLoss:
    """Held-out MLM loss of ``model`` on ``texts`` with bidirectional attention.

    Args:
        model: A ``transformers`` masked LM (e.g. ``EuroBertForMaskedLM``), or a megatron_ext
            ``EncoderModel`` at tensor-parallel size 1 (run it inside Megatron's parallel state,
            e.g. :func:`megatron_ext.hf.single_process_model_parallel`). Scored in eval mode;
            its training mode is restored after.
        tokenizer: The model's tokenizer (it needs a mask and an eos token).
        texts: Held-out documents.
        mask_ratio: Share of each window's maskable positions that are masked (all replaced by
            the mask token, the paper's setting).
        seq_length: Window length; at most the model's maximum length.
        seed: Seed of the masks.
        max_sequences: Score at most this many windows (the first ones).
        batch_size: Windows per forward pass.
    """
    batch = masked_windows(tokenizer, texts, seq_length=seq_length, mask_ratio=mask_ratio,
                           seed=seed, max_sequences=max_sequences)
    digest = hashlib.sha256(batch.input_ids.numpy().tobytes() + batch.labels.numpy().tobytes())
    logits_of = _logits_fn(model)
    device = next(model.parameters()).device
    vocab = tokenizer.vocab_size
    was_training = model.training
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    try:
        for start in range(0, batch.input_ids.shape[0], batch_size):
            ids = batch.input_ids[start:start + batch_size].to(device)
            labels = batch.labels[start:start + batch_size].to(device)
            logits = logits_of(ids)[..., :vocab].float()
            scored = labels != IGNORE_INDEX
            loss_sum += float(F.cross_entropy(logits[scored], labels[scored], reduction="sum"))
            correct += int((logits[scored].argmax(-1) == labels[scored]).sum())
            count += int(scored.sum())
    finally:
        model.train(was_training)
    return MLMLoss(loss=loss_sum / count, accuracy=correct / count, masked_tokens=count,
                   sequences=batch.input_ids.shape[0], inputs_sha256=digest.hexdigest())


def checkpoint_mlm_loss(checkpoint: str | os.PathLike, texts: Sequence[str], **kwargs: Any) -> MLMLoss:
    """:func:`mlm_loss` of a Megatron checkpoint (or a save directory: its newest), loaded at
    TP=1 in this process with the tokenizer it references; ``kwargs`` as for :func:`mlm_loss`."""
    from megatron_ext.checkpoint.reader import Checkpoint
    from megatron_ext.checkpoint.single_process import load_megatron_checkpoint, single_process_model_parallel
    from megatron_ext.tokenizer import build_tokenizer

    source = Checkpoint.open(checkpoint)
    tokenizer = build_tokenizer(source.tokenizer_config())
    with single_process_model_parallel():
        return mlm_loss(load_megatron_checkpoint(source), tokenizer, texts, **kwargs)


__all__ = ["MLMLoss", "checkpoint_mlm_loss", "masked_windows", "mlm_loss"]
