"""Which implementation the transformer layers are built from (``model.transformer_impl``;
Megatron-LM's ``--transformer-impl``), and what that choice implies.

``local``: Megatron-Core's own modules with PyTorch scaled_dot_product_attention and torch norms,
on CPU and GPU. ``te``: Transformer Engine's modules (fused norm + linear, fused attention, FP8),
GPU only. Both hold the same weights, so checkpoints load into either. The value is checked
once, where the model config is built (:meth:`TransformerImpl.parse`); everything else asks the
value its questions instead of comparing strings.
"""

from __future__ import annotations

from enum import StrEnum

import yaml

from megatron_ext.config_loading import ConfigError


class TransformerImpl(StrEnum):
    """A ``str`` as well (``"local"``, ``"te"``): recipes, ``run_config.json`` and flags keep
    their spelling."""

    LOCAL = "local"
    TE = "te"

    @classmethod
    def parse(cls, value: object, where: str = "model.transformer_impl") -> TransformerImpl:
        """``value`` as a ``TransformerImpl``; ``ConfigError`` naming ``where`` and the choices otherwise.
        Megatron-LM's spelling ``transformer_engine`` (its ``--transformer-impl`` default) is ``te``."""
        if value == "transformer_engine":
            return cls.TE
        try:
            return cls(value)
        except ValueError:
            choices = " or ".join(repr(impl.value) for impl in cls)
            raise ConfigError(f"{where} must be {choices}, got {value!r}") from None

    @property
    def uses_transformer_engine(self) -> bool:
        """Transformer Engine's modules: they need ``transformer_engine`` and a CUDA GPU, run FP8,
        fuse weight-gradient accumulation without apex, and go with TE's RNG tracker under CUDA
        graphs. Otherwise Megatron's own modules, whose linears need apex for that fusion."""
        return self is TransformerImpl.TE

    @property
    def runs_on_cpu(self) -> bool:
        """Whether a CPU process can build and train these layers."""
        return not self.uses_transformer_engine

    def __repr__(self) -> str:  # messages quote the value as the recipe spells it
        return repr(self.value)


# A config holding one is dumped as YAML (``--print-config``, imported models' recipes) as its string.
yaml.SafeDumper.add_representer(TransformerImpl, lambda dumper, impl: dumper.represent_str(impl.value))
