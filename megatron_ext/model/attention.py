"""Core attention modules and what one forward call attends to.

The same weights run causally (CLM steps) and bidirectionally (MLM steps, evaluation, export),
with or without isolated documents, so the pattern is chosen per forward call. Megatron's
``SelfAttention`` fixes ``attn_mask_type`` at construction, but hands its ``packed_seq_params``
argument from ``GPTModel``/``TransformerBlock`` through every ``TransformerLayer`` to core attention
on every call, also under activation recomputation (``recompute.py`` and selective recomputation
keep it in their closures) and CUDA graphs (``CudaGraphManager`` compares a dataclass argument field
by field: one runner per direction). The pattern is therefore an :class:`AttentionPattern`, a
``PackedSeqParams`` that also says the direction:

- ``causal``: position ``i`` attends to positions ``<= i`` only (within its document when documents
  are isolated); else to every position (of its document);
- ``cu_seqlens_q`` (= ``cu_seqlens_kv``, :attr:`AttentionPattern.documents`): isolated documents of
  packed rows (``data.reset_attention_mask``), int32, where each starts in the row-major ``[b * s]``
  token stream, then ``b * s`` (:func:`document_cu_seqlens`); None: a row attends across its
  documents. No ``s x s`` mask is materialised: Transformer Engine runs its packed-sequence (THD)
  kernels on these ``cu_seqlens``, the local spec one SDPA call per run of documents of one length
  (:func:`per_document_attention`).

``qkv_format`` stays ``"sbhd"``: the layers keep their ``[s, b, h]`` activations. Megatron's
``"thd"`` would have the layers flatten the batch and restart RoPE at each document inside the
attention; here positions are the model's ``position_ids`` (``data.reset_position_ids`` restarts
them per document), so core attention packs the stream itself.

``attention_mask`` keeps Megatron's meaning, an explicit boolean ``[b, 1, s, s]`` mask (True =
masked out) with a bidirectional pattern: the reference the packed route is tested and benchmarked
against (:func:`explicit_document_mask`); the trainer never builds one.

Documents end at (and include) each end-of-document token, as in Megatron's ``GPTDataset`` with
``reset_attention_mask``; the start of each row also starts a document (a document cut by the row
edge continues in the next sample as a document of its own there).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

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


@dataclass
class AttentionPattern(PackedSeqParams):
    """What each token attends to in one forward call (module docstring): Megatron's
    ``PackedSeqParams`` with the isolated documents in ``cu_seqlens_q``/``cu_seqlens_kv``, plus the
    direction. Build it with :func:`attention_pattern`."""

    causal: bool = False
    """Causal (CLM), alone or within each document; False: bidirectional (MLM, evaluation)."""

    @property
    def documents(self) -> Tensor | None:
        """int32 ``[n + 1]`` starts of the isolated documents in the row-major ``[b * s]`` stream, then
        ``b * s``; None when a row attends across its documents."""
        return self.cu_seqlens_q


def attention_pattern(*, causal: bool, document_ends: Tensor | None = None) -> AttentionPattern:
    """The pattern of a call: ``causal`` or bidirectional, within the documents that
    ``document_ends`` (bool ``[b, s]``, True at each token that ends one) delimits, or across them
    (None)."""
    documents = None if document_ends is None else document_cu_seqlens(document_ends)
    return AttentionPattern(qkv_format="sbhd", causal=causal, cu_seqlens_q=documents, cu_seqlens_kv=documents)


def document_cu_seqlens(document_ends: Tensor) -> Tensor:
    """Starts of the documents of a ``[b, s]`` micro-batch in its row-major token stream, then
    ``b * s`` (int32 ``[n + 1]``, Transformer Engine's ``cu_seqlens``). ``document_ends`` (bool
    ``[b, s]``) is True at each token that ends a document (its end-of-document token). A document
    starts at each row's first token and after each end; one that ends a row ends there.

    The count of documents is data-dependent: on a GPU reading it waits for the device (once per
    forward, not per layer)."""
    b, s = document_ends.shape
    starts = torch.ones(b, s, dtype=torch.bool, device=document_ends.device)
    starts[:, 1:] = document_ends[:, :-1]
    first = starts.reshape(-1).nonzero().squeeze(1)
    end = torch.full((1,), b * s, dtype=first.dtype, device=first.device)
    return torch.cat([first, end]).to(torch.int32)


def explicit_document_mask(document_ends: Tensor, *, causal: bool) -> Tensor:
    """The documents of ``document_ends`` (:func:`document_cu_seqlens`) as an explicit
    ``[b, 1, s, s]`` boolean mask (True = masked out), causal within each or not: the reference the
    packed route is compared with."""
    ends = document_ends.long()
    document = ends.cumsum(dim=1) - ends  # [b, s]: document ends strictly before each position
    masked = document[:, None, :, None] != document[:, None, None, :]
    if causal:
        s = document_ends.shape[1]
        masked |= torch.ones(s, s, dtype=torch.bool, device=document_ends.device).triu(1)
    return masked


def call_pattern(attention_mask: Tensor | None, packed_seq_params: PackedSeqParams | None) -> AttentionPattern:
    """The pattern core attention runs: ``packed_seq_params`` as ``EncoderModel.forward`` passes it;
    without one (a caller of Megatron's interface with an explicit ``attention_mask`` or nothing),
    bidirectional over the mask. Anything else is refused rather than guessed."""
    if packed_seq_params is None:
        return AttentionPattern()
    if not isinstance(packed_seq_params, AttentionPattern):
        raise ValueError("the encoder's core attention takes model.attention.AttentionPattern as packed_seq_params "
                         f"(EncoderModel.forward builds it), not {type(packed_seq_params).__name__} with "
                         f"qkv_format={packed_seq_params.qkv_format!r}")
    if attention_mask is not None and (packed_seq_params.causal or packed_seq_params.documents is not None):
        raise ValueError("an explicit attention_mask says alone what each token attends to: pass it with a "
                         "bidirectional AttentionPattern without documents")
    return packed_seq_params


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
        """Attention over ``[s, b, n, d]`` with the call's :class:`AttentionPattern`;
        ``attn_mask_type`` (fixed at construction) is ignored (module docstring)."""
        if attention_bias is not None:
            raise ValueError("SDPAttention does not support attention_bias")
        pattern = call_pattern(attention_mask, packed_seq_params)
        dropout = self.dropout if self.training else 0.0
        gqa = self.heads_per_rank != self.groups_per_rank
        with hardware.tensor_parallel_rng() if dropout else contextlib.nullcontext():
            if pattern.documents is not None:
                return per_document_attention(query, key, value, pattern.documents, causal=pattern.causal,
                                              dropout_p=dropout, scale=self.softmax_scale, enable_gqa=gqa)
            s, b = query.shape[:2]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, d]
            out = F.scaled_dot_product_attention(
                q, k, v,
                attn_mask=None if attention_mask is None else ~attention_mask,  # SDPA: True = attend
                dropout_p=dropout,
                is_causal=pattern.causal,
                scale=self.softmax_scale,
                enable_gqa=gqa,
            )
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


if HAVE_TE:

    class TEEncoderAttention(TEDotProductAttention):
        """``TEDotProductAttention`` that takes its mask type from the call's :class:`AttentionPattern`.

        Bidirectional -> ``no_mask`` and causal -> ``causal`` (flash/cuDNN kernels); isolated documents
        -> THD: the ``[s, b]`` tokens as one ``[b * s]`` stream of packed sequences,
        ``padding``/``padding_causal`` over Megatron's ``PackedSeqParams`` of the documents
        (:func:`packed_seq_params_for`); an explicit mask -> ``arbitrary``, which TE serves with a
        slower kernel (the reference only).
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
            pattern = call_pattern(attention_mask, packed_seq_params)
            if pattern.documents is not None:  # isolated documents: THD, no s x s mask
                s, b = query.shape[:2]
                stream = [t.transpose(0, 1).reshape(b * s, *t.shape[2:]) for t in (query, key, value)]
                mask_type = AttnMaskType.padding_causal if pattern.causal else AttnMaskType.padding
                out = super().forward(*stream, None, mask_type, attention_bias,
                                      packed_seq_params_for(pattern.documents, s), num_splits)
                return out.reshape(b, s, -1).transpose(0, 1).contiguous()
            if attention_mask is not None:
                mask_type = AttnMaskType.arbitrary
            else:
                mask_type = AttnMaskType.causal if pattern.causal else AttnMaskType.no_mask
            return super().forward(query, key, value, attention_mask, mask_type, attention_bias, None, num_splits)

else:
    TEEncoderAttention = None
