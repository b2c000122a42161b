"""The encoder model on Megatron-Core: config and presets, layer specs, attention, builder."""

from megatron_ext.model.builder import (
    EncoderModel,
    build_encoder_model,
    gather_vocab_parallel_logits,
    transformer_config,
)
from megatron_ext.model.config import PRESETS, EncoderModelConfig, parameter_count, preset

__all__ = [
    "PRESETS",
    "EncoderModel",
    "EncoderModelConfig",
    "build_encoder_model",
    "gather_vocab_parallel_logits",
    "parameter_count",
    "preset",
    "transformer_config",
]
