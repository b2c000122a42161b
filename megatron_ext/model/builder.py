"""The encoder model: Megatron-Core's ``GPTModel`` with a per-call attention pattern and RoPE base.

Parameter names are GPTModel's (``embedding.word_embeddings``, ``decoder.layers.<i>.*``,
``decoder.final_layernorm``, ``output_layer``), one ``TransformerLayer`` per EuroBERT/Llama
block, so checkpoints map 1:1 onto ``EuroBertForMaskedLM`` and ``LlamaForCausalLM``.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import init_method_normal
from torch import Tensor

from megatron_ext.config_loading import UserError
from megatron_ext import hardware
from megatron_ext.model.attention import AttentionPattern
from megatron_ext.model.config import EncoderModelConfig, tensor_parallel_problem
from megatron_ext.model.spec import encoder_block_spec, require_transformer_engine


class EncoderModel(GPTModel):
    """Bidirectional/causal encoder on Megatron-Core; build it with ``build_encoder_model``.

    What a call computes beyond its tokens are arguments of :meth:`forward`, nothing the model holds:
    the attention pattern (``packed_seq_params``, Megatron's per-call channel to core attention) and
    the RoPE base (a phase may raise it). RoPE is computed here per call from positions
    (``position_ids`` or ``0..s-1``) and that base rather than by GPTModel's ``RotaryEmbedding``,
    whose frequencies are fixed at construction, which ignores ``position_ids`` and moves its
    frequencies to ``torch.cuda.current_device()``; GPTModel is therefore built with no position
    embedding.

    ``gradient_accumulation_fusion`` in ``transformer_config`` without apex's
    ``fused_weight_gradient_mlp_cuda`` (``hardware.megatron_linear_wgrad_fusion_available``):
    Megatron's ``ColumnParallelLinear`` (the LM head) raises at construction, Transformer Engine's
    layers need no apex. The model's config (``self.config``: embedding, LM head, layers) then has
    it off and the block's TE linears get a copy with it on (``encoder_block_spec``), so the wgrad
    GEMMs of the layers write into ``main_grad`` and the LM head adds its gradient as before.
    """

    def __init__(
        self,
        config: EncoderModelConfig,
        transformer_config: TransformerConfig,
        *,
        pre_process: bool = True,
        post_process: bool = True,
    ) -> None:
        te_linears_only = (transformer_config.gradient_accumulation_fusion
                           and not hardware.megatron_linear_wgrad_fusion_available())
        if te_linears_only:
            if not config.transformer_impl.uses_transformer_engine:
                raise UserError(
                    "training.gradient_accumulation_fusion with model.transformer_impl: local needs apex's "
                    "fused_weight_gradient_mlp_cuda (Megatron's linear layers), which does not import here; "
                    "set training.gradient_accumulation_fusion: false or use transformer_impl: te")
            transformer_config = copy.copy(transformer_config)
            transformer_config.gradient_accumulation_fusion = False
        spec = encoder_block_spec(
            config.transformer_impl,
            get_num_layers_to_build(transformer_config),
            qk_layernorm=config.qk_layernorm,
            te_linears_fuse_weight_gradients=te_linears_only,
        )
        super().__init__(
            config=transformer_config,
            transformer_layer_spec=spec,
            vocab_size=config.vocab_size,
            max_sequence_length=config.seq_length,
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=True,
            share_embeddings_and_output_weights=config.tie_embeddings,
            position_embedding_type="none",
        )
        self.encoder_config = config

    def rotary_embedding(
        self, seq_len: int, position_ids: Tensor | None, device: torch.device, *, base: float
    ) -> Tensor:
        """RoPE angles ``[s, b or 1, 1, head_dim]`` in Megatron's (non-interleaved) layout, of theta
        ``base``.

        Always float32 (recomputed per call, a few KB), whatever the parameter dtype.
        """
        d = self.encoder_config.head_dim
        exponents = torch.arange(0, d, 2, dtype=torch.float32, device=device) / d
        inv_freq = base**-exponents
        if position_ids is None:
            positions = torch.arange(seq_len, dtype=torch.float32, device=device)[:, None]
        else:
            positions = position_ids.t().to(device, torch.float32)
        freqs = positions[..., None] * inv_freq
        return torch.cat((freqs, freqs), dim=-1)[:, :, None, :]

    def _check_rope_positions(self, position_ids: Tensor | None) -> None:
        # TE's fused RoPE (apply_rope_fusion) takes a [s, 1, 1, d] table only (one row of positions
        # for the batch: TORCH_CHECK in transformer_engine's fused_rope_forward); say so first.
        if self.config.apply_rope_fusion and position_ids is not None and position_ids.shape[0] > 1:
            raise ValueError(
                "position_ids of several sequences need training.rope_fusion: false (Transformer Engine's fused "
                "RoPE takes one row of positions for the whole batch); pass position_ids=None for 0..s-1")

    def forward(  # type: ignore[override]
        self,
        input_ids: Tensor,
        *,
        packed_seq_params: AttentionPattern,
        rotary_base: float | None = None,
        position_ids: Tensor | None = None,
        labels: Tensor | None = None,
        loss_mask: Tensor | None = None,
        max_scored_per_sequence: int | None = None,
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        """Run the encoder with the call's attention pattern and RoPE base.

        Args:
            input_ids: ``[b, s]`` token ids (also on later pipeline stages: the length is read
                from them).
            packed_seq_params: What each token attends to (``model.attention.attention_pattern``):
                causal (CLM) or bidirectional (MLM, evaluation), within isolated documents
                (``data.reset_attention_mask``: THD on Transformer Engine, per-document SDPA on the
                local spec) or across them. Megatron hands it to every layer's core attention.
            rotary_base: RoPE theta of this call: a phase's ``rotary_base`` (``training.context``);
                None: the architecture's ``rotary_base``.
            position_ids: ``[b, s]`` RoPE positions; default ``0..s-1`` in every row.
            labels: ``[b, s]`` target ids. A position holding an id outside the vocabulary
                (e.g. ``IGNORE_INDEX`` = -100) gets a finite, meaningless loss: multiply the
                result by the loss mask.
            loss_mask: ``[b, s]`` weights of the per-token loss, with ``labels``. When given, the
                LM head and the cross entropy run only at positions of positive weight (MLM: the
                masked ~40 %, so most of the head's FLOPs and its ``[s, b, vocab]`` logits are
                saved); the other positions get loss 0, which their zero weight ignores anyway.
            max_scored_per_sequence: With ``loss_mask``: no row of ``loss_mask`` has more positive
                entries (``ObjectiveBatch.max_scored_per_sequence``). The head then runs at this many
                positions per sequence, chosen on the device, with no host sync; a value below the
                truth drops scored positions. None reads the largest count from the mask (one host
                sync).
            attention_mask: Megatron's explicit boolean ``[b, 1, s, s]`` mask (True = masked out),
                with a bidirectional ``packed_seq_params`` without documents: the reference the
                packed route is tested against (``model.attention.explicit_document_mask``).

        Returns:
            Without ``labels``: logits ``[b, s, vocab_size / tp]``, this tensor-parallel rank's
            vocabulary shard (``gather_vocab_parallel_logits`` assembles them). With ``labels``:
            fp32 per-token cross entropy ``[b, s]`` from Megatron's
            ``vocab_parallel_cross_entropy`` (exact under tensor parallelism). On a pipeline
            stage without the LM head: hidden states ``[s, b, hidden]``.
        """
        seq_len = input_ids.shape[1]
        if seq_len > self.encoder_config.seq_length:
            raise ValueError(
                f"input length {seq_len} exceeds EncoderModelConfig.seq_length="
                f"{self.encoder_config.seq_length}"
            )
        self._check_rope_positions(position_ids)
        base = self.encoder_config.rotary_base if rotary_base is None else rotary_base
        # Full length from input_ids: hidden states are shorter under sequence parallelism.
        rotary = self.rotary_embedding(seq_len, position_ids, input_ids.device, base=base)
        processor = None
        if labels is not None and loss_mask is not None:
            if max_scored_per_sequence is None:
                max_scored_per_sequence = int((loss_mask > 0).sum(dim=1).max()) if loss_mask.numel() else 0
            processor = functools.partial(self._loss_at_scored_positions, rows_per_sequence=max_scored_per_sequence)
        # GPTModel.forward's three steps, with this call's RoPE table: its _preprocess computes RoPE
        # only from the frequencies fixed at construction, so it serves here for the embedding alone
        # (None on later pipeline stages, whose decoder reads the stage's input tensor).
        decoder_input = self._preprocess(input_ids, position_ids, packed_seq_params=packed_seq_params)[0]
        hidden_states = self.decoder(hidden_states=decoder_input, attention_mask=attention_mask,
                                     rotary_pos_emb=rotary, packed_seq_params=packed_seq_params)
        return self._postprocess(hidden_states=hidden_states, input_ids=input_ids, position_ids=position_ids,
                                 labels=labels, rotary_pos_emb=rotary, rotary_pos_cos=None, rotary_pos_sin=None,
                                 loss_mask=loss_mask, attention_mask=attention_mask,
                                 packed_seq_params=packed_seq_params, output_processor=processor)

    def _loss_at_scored_positions(
        self, *, hidden_states: Tensor, output_layer, output_weight: Tensor | None, labels: Tensor,
        loss_mask: Tensor, compute_language_model_loss, scale_logits, rows_per_sequence: int, **_: Any,
    ) -> Tensor:
        """GPTModel ``output_processor``: LM head + cross entropy at the scored positions only.

        Each sequence contributes ``rows_per_sequence`` positions (at least as many as it scores):
        its scored ones first, in order, then unscored ones whose loss is zeroed. The count is
        known on the host, so nothing waits for the device (a data-dependent ``nonzero()`` did,
        once per micro-batch). Every tensor-parallel rank holds the same batch and the full
        sequence (no sequence parallelism), so each selects the same rows and the
        vocabulary-parallel head and loss stay exact.
        """
        if output_layer.sequence_parallel:
            raise NotImplementedError(
                "the scored-positions LM head does not support sequence parallelism; set "
                "training.lm_head_scored_only: false"
            )
        seq, batch, hidden = hidden_states.shape
        scored = loss_mask.t() > 0  # [s, b], hidden_states' order
        if rows_per_sequence >= seq:  # e.g. CLM: every position runs the head
            rows, weight, selected, selected_labels = None, scored, hidden_states, labels
        else:
            # A stable sort puts each column's scored positions first, in position order.
            rows = torch.sort(scored.to(torch.uint8), dim=0, descending=True, stable=True).indices[:rows_per_sequence]
            weight = scored.gather(0, rows)  # [k, b]
            selected = hidden_states.gather(0, rows.unsqueeze(-1).expand(-1, -1, hidden))  # [k, b, h]
            selected_labels = labels.t().gather(0, rows).t()  # [b, k]
        logits, _ = output_layer(selected, weight=output_weight)  # [k, b, vocab / tp]
        loss = compute_language_model_loss(selected_labels, scale_logits(logits))  # [b, k]
        loss = torch.where(weight.t(), loss, 0.0)  # unscored picks: 0, even where a diverged head gives inf
        if rows is None:
            return loss
        return loss.new_zeros(batch, seq).scatter(1, rows.t(), loss)


def transformer_config(config: EncoderModelConfig, overrides: Mapping[str, Any] | None = None) -> TransformerConfig:
    """Megatron ``TransformerConfig`` for ``config`` under the initialised parallel state.

    ``overrides``: fields the training run sets beyond the architecture (FP8 recipe, activation
    recomputation, per-token loss for Megatron's schedules), e.g.
    ``megatron_ext.training.megatron_engine.megatron_transformer_overrides``.
    """
    dtype = config.torch_dtype
    return TransformerConfig(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.ffn_hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups,
        kv_channels=config.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=config.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=config.add_qkv_bias,
        qk_layernorm=config.qk_layernorm,
        hidden_dropout=config.hidden_dropout,
        attention_dropout=config.attention_dropout,
        init_method_std=config.init_method_std,
        # None lets Megatron derive its depth-scaled init for the output projections.
        output_layer_init_method=None if config.depth_scaled_init else init_method_normal(config.init_method_std),
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        use_cpu_initialization=hardware.use_cpu_initialization(),
        # Megatron's default ("full") means the same (no CUDA graphs are captured unless
        # cuda_graph_impl is set) but warns "full scope is deprecated" on every rank.
        cuda_graph_modules=[],
        **(overrides or {}),
    )


def build_encoder_model(
    config: EncoderModelConfig, *, pre_process: bool = True, post_process: bool = True,
    transformer_overrides: Mapping[str, Any] | None = None,
) -> EncoderModel:
    """Build this rank's part of the encoder; needs ``parallel_state`` initialised
    (``megatron_ext.process_group.init_process_group_and_model_parallel``).

    ``pre_process``/``post_process``: whether this pipeline stage holds the embedding / the
    final norm and LM head.
    """
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "Megatron parallel_state is not initialised; call "
            "megatron_ext.process_group.init_process_group_and_model_parallel() first"
        )
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if (problem := tensor_parallel_problem(config, tp)) is not None:
        raise UserError(f"EncoderModelConfig: {problem}")
    if config.vocab_size % tp:
        raise UserError(f"EncoderModelConfig.vocab_size={config.vocab_size} is not divisible by the "
                        f"tensor-parallel size {tp} (pad the vocabulary)")
    if config.transformer_impl.uses_transformer_engine:
        require_transformer_engine()
    hardware.check_model_parallel_supported(
        tensor_parallel_size=tp,
        num_query_groups=config.num_query_groups,
        transformer_impl=config.transformer_impl,
    )
    model = EncoderModel(
        config, transformer_config(config, transformer_overrides), pre_process=pre_process,
        post_process=post_process,
    )
    # Megatron's torch norms ignore params_dtype; Megatron-LM casts the whole model later
    # (Float16Module). Cast here so every parameter has the configured dtype.
    return model.to(config.torch_dtype)


def gather_vocab_parallel_logits(logits: Tensor) -> Tensor:
    """Full-vocabulary logits ``[b, s, vocab]`` from each tensor-parallel rank's shard.

    For evaluation and tests (no autograd). Megatron's differentiable gather
    (``runtime_gather_output``) allocates on CUDA, see ``megatron_ext.hardware``.
    """
    group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return logits
    shards = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, logits.contiguous(), group=group)
    return torch.cat(shards, dim=-1)
