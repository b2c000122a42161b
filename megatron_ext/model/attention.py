"""Core attention modules and the per-call attention pattern.

The same weights run causally (CLM steps) and bidirectionally (MLM steps, evaluation, export),
so the pattern is chosen per forward call. Megatron's ``SelfAttention`` fixes ``attn_mask_type``
at construction, but passes its ``attention_mask`` argument through ``TransformerBlock`` ->
``TransformerLayer`` -> ``SelfAttention`` -> core attention on every call, including activation
recomputation (only tensors and ``None`` survive ``tensor_parallel.checkpoint``). The pattern
therefore travels in ``attention_mask``, encoded by ``attention_mask_for``:

- ``None``: bidirectional, every position attends to every position;
- an empty boolean tensor: causal and nothing else, so SDPA and TE take their ``is_causal``
  kernels without materialising an ``s x s`` mask;
- a boolean ``[b, 1, s, s]`` tensor, True = masked out (Megatron's convention): documents of a
  packed sequence (block diagonal), intersected with the causal mask in causal mode.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from megatron.core.extensions.transformer_engine import HAVE_TE, TEDotProductAttention
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from torch import Tensor

from megatron_ext import hardware


def attention_mask_for(
    input_ids: Tensor, *, causal: bool, eod_token_id: int | None
) -> Tensor | None:
    """The per-call attention pattern for ``input_ids`` [b, s] (see the module docstring).

    With ``eod_token_id`` set, a document ends at (and includes) each EOD token, as in
    Megatron's ``GPTDataset`` with ``reset_attention_mask``.
    """
    if eod_token_id is None:
        return torch.empty(0, dtype=torch.bool, device=input_ids.device) if causal else None
    is_eod = (input_ids == eod_token_id).long()
    document = is_eod.cumsum(dim=1) - is_eod  # [b, s]: EODs strictly before each position
    masked = document[:, None, :, None] != document[:, None, None, :]
    if causal:
        s = input_ids.shape[1]
        masked |= torch.ones(s, s, dtype=torch.bool, device=input_ids.device).triu(1)
    return masked


def decode_attention_mask(attention_mask: Tensor | None) -> tuple[Tensor | None, bool]:
    """Inverse of ``attention_mask_for``: ``(mask with True = masked out, or None; is_causal)``."""
    if attention_mask is None:
        return None, False
    if attention_mask.numel() == 0:
        return None, True
    return attention_mask, False


class SDPAttention(MegatronModule):
    """Core attention on ``torch.nn.functional.scaled_dot_product_attention``.

    Replaces Megatron's ``DotProductAttention`` in the ``local`` spec: same interface (query,
    key, value ``[s, b, heads_per_rank, head_dim]`` -> ``[s, b, heads_per_rank * head_dim]``),
    same head split over tensor-parallel ranks and the same GQA grouping (query head ``i`` reads
    KV head ``i // (heads / groups)``), but it runs on CPU and reads the pattern per call.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        cp_comm_type: str | None = None,
        softmax_scale: float | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("transformer_impl='local' does not support context parallelism")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        # Attention() hands us a config whose num_query_groups is at least the TP size.
        self.heads_per_rank = divide(config.num_attention_heads, tp)
        self.groups_per_rank = divide(config.num_query_groups, tp)
        self.softmax_scale = softmax_scale
        self.dropout = config.attention_dropout

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        """Attention over ``[s, b, n, d]``; ``attn_mask_type`` is ignored (see module doc)."""
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPAttention supports neither attention_bias nor packed_seq_params")
        mask, is_causal = decode_attention_mask(attention_mask)
        s, b = query.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, d]
        dropout = self.dropout if self.training else 0.0
        with hardware.tensor_parallel_rng() if dropout else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(
                q, k, v,
                attn_mask=None if mask is None else ~mask,  # SDPA: True = attend
                dropout_p=dropout,
                is_causal=is_causal,
                scale=self.softmax_scale,
                enable_gqa=self.heads_per_rank != self.groups_per_rank,
            )
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


if HAVE_TE:

    class TEEncoderAttention(TEDotProductAttention):
        """``TEDotProductAttention`` that takes its mask type from the per-call pattern.

        None -> ``no_mask`` and empty -> ``causal`` (flash/cuDNN kernels); an explicit document
        mask -> ``arbitrary``, which TE serves with a slower kernel. A packed-sequence (THD,
        ``cu_seqlens``) route for documents is the faster GPU path and is not wired yet.
        """

        # The same signature as SDPAttention.forward, deliberately: both are Megatron's core-attention
        # interface (``DotProductAttention.forward``), which the layer calls either way.
        def forward(  # type: ignore[override]
            self,
            query: Tensor,
            key: Tensor,
            value: Tensor,
            attention_mask: Tensor | None,
            attn_mask_type: AttnMaskType | None = None,
            attention_bias: Tensor | None = None,
            packed_seq_params: PackedSeqParams | None = None,
            num_splits: int | None = None,
        ) -> Tensor:
            mask, is_causal = decode_attention_mask(attention_mask)
            if mask is not None:
                mask_type = AttnMaskType.arbitrary
            else:
                mask_type = AttnMaskType.causal if is_causal else AttnMaskType.no_mask
            return super().forward(
                query, key, value, mask, mask_type, attention_bias, packed_seq_params, num_splits
            )

else:
    TEEncoderAttention = None
