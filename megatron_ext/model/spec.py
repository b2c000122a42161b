"""Megatron-Core ``ModuleSpec``s of the encoder block, one per layer implementation (``model.transformer_impl``).

Both give one ``TransformerLayer`` per Llama/EuroBERT block: RMSNorm -> fused QKV (GQA) ->
core attention -> output projection, then RMSNorm -> SwiGLU MLP (``linear_fc1`` holds
``[gate; up]``) -> ``linear_fc2``; optionally per-head RMSNorms on queries and keys (Qwen3's
``qk_layernorm``). The ``te`` spec fuses each norm into the following linear
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``); its dist-checkpoint keys
match the ``local`` spec's through ``sharded_state_dict_keys_map``, as in Megatron's GPT specs.
"""

from __future__ import annotations

import copy

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_ext.model.attention import SDPAttention, TEEncoderAttention
from megatron_ext.transformer_impl import TransformerImpl

# Core attention reads the pattern per call (attention.py); this construction-time type only
# reaches Megatron code paths we do not use (inference KV cache).
_MASK_TYPE = {"attn_mask_type": AttnMaskType.no_mask}


def _local_layer(qk_layernorm: bool) -> ModuleSpec:
    backend = LocalSpecProvider()
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params=_MASK_TYPE,
                submodules=SelfAttentionSubmodules(
                    linear_qkv=backend.column_parallel_linear(),
                    core_attention=SDPAttention,
                    linear_proj=backend.row_parallel_linear(),
                    q_layernorm=WrappedTorchNorm if qk_layernorm else None,
                    k_layernorm=WrappedTorchNorm if qk_layernorm else None,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=get_mlp_module_spec_for_backend(backend=backend),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )


def require_transformer_engine() -> None:
    """Raise an actionable ``ImportError`` when ``transformer_impl='te'`` cannot be built."""
    if TEEncoderAttention is None:
        raise ImportError(
            "transformer_impl='te' needs Transformer Engine, which is not importable here "
            "(import transformer_engine failed). Install transformer-engine-torch built for this "
            "torch/CUDA (NVIDIA's NGC PyTorch container ships it), or set "
            "transformer_impl='local'."
        )


def _fusing_weight_gradients(linear: type) -> type:
    """``linear`` (a Transformer Engine layer class) built with a copy of its ``TransformerConfig``
    whose ``gradient_accumulation_fusion`` is on: TE passes it to its layer as
    ``fuse_wgrad_accumulation`` at construction (``megatron.core.extensions.transformer_engine.
    TELinear``/``TELayerNormColumnParallelLinear``). The model's own config keeps it off when apex
    is missing, because Megatron's ``ColumnParallelLinear`` (the LM head) then refuses it."""

    class FusingWeightGradients(linear):
        def __init__(self, *args, config, **kwargs):
            config = copy.copy(config)
            config.gradient_accumulation_fusion = True
            super().__init__(*args, config=config, **kwargs)

    FusingWeightGradients.__name__ = FusingWeightGradients.__qualname__ = linear.__name__
    return FusingWeightGradients


def _te_backend(fuse_weight_gradients: bool):
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

    if not fuse_weight_gradients:
        return TESpecProvider()

    class WeightGradientFusingTESpecProvider(TESpecProvider):
        """TESpecProvider whose linear layers fuse weight-gradient accumulation whatever the
        model's config says (``_fusing_weight_gradients``)."""

        def column_parallel_layer_norm_linear(self):
            return _fusing_weight_gradients(super().column_parallel_layer_norm_linear())

        def row_parallel_linear(self):
            return _fusing_weight_gradients(super().row_parallel_linear())

        def column_parallel_linear(self):
            return _fusing_weight_gradients(super().column_parallel_linear())

        def linear(self):
            return _fusing_weight_gradients(super().linear())

    return WeightGradientFusingTESpecProvider()


def _te_layer(qk_layernorm: bool, fuse_weight_gradients: bool = False) -> ModuleSpec:
    # Deliberately the same shape as _local_layer, slot for slot: both specs must hold the same
    # weights under the same checkpoint keys, so a change to one is a change to both.
    require_transformer_engine()
    backend = _te_backend(fuse_weight_gradients)
    qk_norm = backend.layer_norm(rms_norm=True, for_qk=True) if qk_layernorm else None
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            self_attention=ModuleSpec(
                module=SelfAttention,
                params=_MASK_TYPE,
                submodules=SelfAttentionSubmodules(
                    linear_qkv=backend.column_parallel_layer_norm_linear(),
                    core_attention=TEEncoderAttention,
                    linear_proj=backend.row_parallel_linear(),
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=IdentityOp,
            mlp=get_mlp_module_spec_for_backend(backend=backend),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def encoder_block_spec(
    transformer_impl: TransformerImpl | str, num_layers: int, *, qk_layernorm: bool = False,
    te_linears_fuse_weight_gradients: bool = False,
) -> ModuleSpec:
    """Spec of a ``TransformerBlock`` of ``num_layers`` encoder layers and its final RMSNorm.

    ``num_layers`` is the number of layers on this pipeline stage; ``qk_layernorm`` adds the
    per-head query/key RMSNorms (``self_attention.q_layernorm``/``k_layernorm``).
    ``te_linears_fuse_weight_gradients`` (``te`` only): the layers' Transformer Engine linears
    accumulate weight gradients into ``main_grad`` even where the model's config has
    ``gradient_accumulation_fusion`` off (see ``EncoderModel``).
    """
    transformer_impl = TransformerImpl(transformer_impl)
    if te_linears_fuse_weight_gradients and not transformer_impl.uses_transformer_engine:
        raise ValueError("te_linears_fuse_weight_gradients needs transformer_impl='te'")
    if transformer_impl.uses_transformer_engine:
        layer = _te_layer(qk_layernorm, te_linears_fuse_weight_gradients)
        from megatron.core.extensions.transformer_engine import TENorm

        final_norm = TENorm
    else:
        layer, final_norm = _local_layer(qk_layernorm), WrappedTorchNorm
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(
            layer_specs=[layer] * num_layers, layer_norm=final_norm
        ),
    )
