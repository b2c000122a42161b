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
- an int32 tensor of ``cu_seqlens`` (:func:`document_cu_seqlens`): isolated documents of packed
  rows (``data.reset_attention_mask``), each attending only within itself; 1-D bidirectional,
  ``[1, n + 1]`` causal within each document. No ``s x s`` mask is materialised: Transformer
  Engine runs its packed-sequence (THD) kernels on these ``cu_seqlens``, the local spec one SDPA
  call per bucket of documents of similar length (:func:`per_document_attention`);
- a boolean ``[b, 1, s, s]`` tensor, True = masked out (Megatron's convention): an explicit mask
  (:func:`explicit_document_mask`), kept as the reference the packed route is tested and
  benchmarked against.

Documents end at (and include) each end-of-document token, as in Megatron's ``GPTDataset`` with
``reset_attention_mask``; the start of each row also starts a document (a document cut by the row
edge continues in the next sample as a document of its own there).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

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


THD_MAX_SEQLEN_MULTIPLE = 64
"""Transformer Engine rounds the longest packed sequence up to a multiple of 64 when it reads it
from ``cu_seqlens`` itself (``DotProductAttention.forward``, a device-to-host copy); we pass the
row length so rounded, an upper bound known on the host, so no copy happens."""


class AttentionPattern(NamedTuple):
    """A decoded per-call pattern (module docstring)."""

    mask: Tensor | None
    """Explicit boolean mask ``[b, 1, s, s]``, True = masked out; None without one."""
    is_causal: bool
    """Causal, alone (no mask) or within each document (with ``cu_seqlens``)."""
    cu_seqlens: Tensor | None
    """int32 ``[n + 1]``: where each isolated document starts in the row-major ``[b * s]`` token
    stream, then ``b * s``; None when documents are not isolated."""


def document_cu_seqlens(input_ids: Tensor, eod_token_id: int) -> Tensor:
    """Starts of the documents of ``input_ids`` ``[b, s]`` in its row-major token stream, then
    ``b * s`` (int32 ``[n + 1]``, Transformer Engine's ``cu_seqlens``). A document starts at each
    row's first token and after each end-of-document token; one that ends a row ends there.

    The count of documents is data-dependent: on a GPU reading it waits for the device (once per
    forward, not per layer)."""
    b, s = input_ids.shape
    starts = torch.ones(b, s, dtype=torch.bool, device=input_ids.device)
    starts[:, 1:] = input_ids[:, :-1] == eod_token_id
    first = starts.reshape(-1).nonzero().squeeze(1)
    end = torch.full((1,), b * s, dtype=first.dtype, device=first.device)
    return torch.cat([first, end]).to(torch.int32)


def attention_mask_for(
    input_ids: Tensor, *, causal: bool, eod_token_id: int | None
) -> Tensor | None:
    """The per-call attention pattern for ``input_ids`` [b, s] (see the module docstring).

    ``eod_token_id`` set: documents are isolated (``data.reset_attention_mask``), each ending at
    (and including) that token.
    """
    if eod_token_id is None:
        return torch.empty(0, dtype=torch.bool, device=input_ids.device) if causal else None
    cu_seqlens = document_cu_seqlens(input_ids, eod_token_id)
    return cu_seqlens[None] if causal else cu_seqlens


def explicit_document_mask(input_ids: Tensor, *, causal: bool, eod_token_id: int) -> Tensor:
    """The same documents as :func:`attention_mask_for`, as an explicit ``[b, 1, s, s]`` boolean
    mask (True = masked out): the reference the packed route is compared with."""
    is_eod = (input_ids == eod_token_id).long()
    document = is_eod.cumsum(dim=1) - is_eod  # [b, s]: EODs strictly before each position
    masked = document[:, None, :, None] != document[:, None, None, :]
    if causal:
        s = input_ids.shape[1]
        masked |= torch.ones(s, s, dtype=torch.bool, device=input_ids.device).triu(1)
    return masked


def decode_attention_mask(attention_mask: Tensor | None) -> AttentionPattern:
    """Inverse of ``attention_mask_for`` (and of :func:`explicit_document_mask`)."""
    if attention_mask is None:
        return AttentionPattern(None, False, None)
    if attention_mask.dtype == torch.int32:
        return AttentionPattern(None, attention_mask.dim() == 2, attention_mask.reshape(-1))
    if attention_mask.numel() == 0:
        return AttentionPattern(None, True, None)
    return AttentionPattern(attention_mask, False, None)


def _equal_length_runs(lengths: list[int]) -> list[tuple[int, int]]:
    """``(count, length)`` of each run of consecutive documents of one length, in order."""
    runs: list[tuple[int, int]] = []
    for length in lengths:
        if runs and runs[-1][1] == length:
            runs[-1] = (runs[-1][0] + 1, length)
        else:
            runs.append((1, length))
    return runs


def per_document_attention(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, *, causal: bool,
    dropout_p: float = 0.0, scale: float | None = None, enable_gqa: bool = False,
) -> Tensor:
    """SDPA within each document of ``cu_seqlens`` (:func:`document_cu_seqlens`), without an
    ``s x s`` mask: ``query`` ``[s, b, n, d]``, ``key``/``value`` ``[s, b, g, d]`` -> ``[s, b, n * d]``.

    The ``[b * s]`` token stream is split into its documents, consecutive documents of one length
    (e.g. whole rows without an end of document) viewed as one batch: one SDPA call per run, no
    padding, no mask, no gather, and ``torch.cat`` puts the outputs back in stream order (the
    backward of a split is one concatenation). Attention then costs each document its own L^2
    instead of the row's s^2; the calls cost a few tens of microseconds each. (Measured on CPU,
    ``benchmarks/document_attention.py``: gathering documents into padded buckets cost more in
    copies and zero-filled gradients than the attention it saved.)"""
    s, b = query.shape[:2]
    bounds = cu_seqlens.tolist()  # the local spec's host sync; TE's THD kernels need none
    runs = _equal_length_runs([end - start for start, end in zip(bounds, bounds[1:])])
    sizes = [count * length for count, length in runs]
    pieces = [t.transpose(0, 1).reshape(b * s, *t.shape[2:]).split(sizes) for t in (query, key, value)]
    outputs = []
    for (count, length), q, k, v in zip(runs, *pieces):
        q, k, v = (t.view(count, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))  # [count, heads, L, d]
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale,
                                             enable_gqa=enable_gqa)
        outputs.append(out.transpose(1, 2).reshape(count * length, -1))
    return torch.cat(outputs).view(b, s, -1).transpose(0, 1).contiguous()


def packed_seq_params_for(cu_seqlens: Tensor, seq_length: int) -> PackedSeqParams:
    """Megatron's ``PackedSeqParams`` for Transformer Engine's THD attention over the isolated
    documents of ``cu_seqlens``: the row's tokens are contiguous in the stream, so there is no
    padding between documents (``cu_seqlens_*_padded`` unset; this trainer has no context
    parallelism, whose per-document ``2 x cp`` padding is what the padded form is for), and the
    longest document is at most the row, rounded up as TE rounds (:data:`THD_MAX_SEQLEN_MULTIPLE`)."""
    longest = -(-seq_length // THD_MAX_SEQLEN_MULTIPLE) * THD_MAX_SEQLEN_MULTIPLE
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


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
        pattern = decode_attention_mask(attention_mask)
        dropout = self.dropout if self.training else 0.0
        gqa = self.heads_per_rank != self.groups_per_rank
        with hardware.tensor_parallel_rng() if dropout else contextlib.nullcontext():
            if pattern.cu_seqlens is not None:
                return per_document_attention(query, key, value, pattern.cu_seqlens, causal=pattern.is_causal,
                                              dropout_p=dropout, scale=self.softmax_scale, enable_gqa=gqa)
            s, b = query.shape[:2]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, d]
            out = F.scaled_dot_product_attention(
                q, k, v,
                attn_mask=None if pattern.mask is None else ~pattern.mask,  # SDPA: True = attend
                dropout_p=dropout,
                is_causal=pattern.is_causal,
                scale=self.softmax_scale,
                enable_gqa=gqa,
            )
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


if HAVE_TE:

    class TEEncoderAttention(TEDotProductAttention):
        """``TEDotProductAttention`` that takes its mask type from the per-call pattern.

        None -> ``no_mask`` and empty -> ``causal`` (flash/cuDNN kernels); isolated documents
        (``cu_seqlens``) -> THD: the ``[s, b]`` tokens as one ``[b * s]`` stream of packed sequences,
        ``padding``/``padding_causal`` over :func:`packed_seq_params_for`; an explicit mask ->
        ``arbitrary``, which TE serves with a slower kernel (the reference only).
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
            pattern = decode_attention_mask(attention_mask)
            if pattern.cu_seqlens is not None:  # isolated documents: THD, no s x s mask
                if packed_seq_params is not None:
                    raise ValueError("TEEncoderAttention builds its own packed_seq_params from the documents")
                s, b = query.shape[:2]
                stream = [t.transpose(0, 1).reshape(b * s, *t.shape[2:]) for t in (query, key, value)]
                mask_type = AttnMaskType.padding_causal if pattern.is_causal else AttnMaskType.padding
                out = super().forward(*stream, None, mask_type, attention_bias,
                                      packed_seq_params_for(pattern.cu_seqlens, s), num_splits)
                return out.reshape(b, s, -1).transpose(0, 1).contiguous()
            if pattern.mask is not None:
                mask_type = AttnMaskType.arbitrary
            else:
                mask_type = AttnMaskType.causal if pattern.is_causal else AttnMaskType.no_mask
            return super().forward(
                query, key, value, pattern.mask, mask_type, attention_bias, packed_seq_params, num_splits
            )

else:
    TEEncoderAttention = None
