"""The encoder model on Megatron-Core: config and presets, layer specs, attention, builder.

The builder (which imports Megatron-Core, several seconds) loads on first use, so that reading
presets and configs (``--dry-run`` on a login node) stays fast.
"""

from megatron_ext.model.config import PRESETS, EncoderModelConfig, parameter_count, preset

_BUILDER_NAMES = ("EncoderModel", "build_encoder_model", "gather_vocab_parallel_logits", "transformer_config")

__all__ = ["PRESETS", "EncoderModelConfig", "parameter_count", "preset", *_BUILDER_NAMES]


def __getattr__(name: str):
    if name in _BUILDER_NAMES:
        from megatron_ext.model import builder

        return getattr(builder, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
