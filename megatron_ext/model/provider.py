"""The model seam: a model provider builds this rank's module for the run; the encoder is the default.

``training.loop.pretrain`` takes a provider, as torchtitan's train spec names the model a run
builds and Megatron-Bridge's model providers build it for a pipeline stage: the trainer decides
the stage (``pre_process``/``post_process``) and the ``TransformerConfig`` fields the run sets on
top of the architecture (``training.megatron_engine.megatron_transformer_overrides``: fusions,
FP8, recomputation, CUDA graphs, the per-token loss), the provider builds the module. Importing
this module imports neither torch nor Megatron: the encoder's builder loads when a model is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from megatron_ext.model.config import EncoderModelConfig

if TYPE_CHECKING:
    import torch


class ModelProvider(Protocol):
    """What the trainer asks of its model: this rank's part of it, built for the run's ``model``
    config.

    The module it returns is what the trainer wraps and steps (``training.megatron_engine``): a
    Megatron-Core module of this pipeline stage whose ``config`` is its ``TransformerConfig``
    (Megatron's DDP, optimizer and schedules read it, and set their hooks on it), whose
    ``sharded_state_dict`` the checkpoints save, and whose forward is the encoder's
    (``model.builder.EncoderModel.forward``: token ids, the call's ``AttentionPattern`` and RoPE
    base and the objective's targets in, the per-token loss out), every parameter in
    ``config.torch_dtype``."""

    def build_model(self, config: EncoderModelConfig, *, pre_process: bool, post_process: bool,
                    transformer_overrides: Mapping[str, Any]) -> torch.nn.Module:
        """This rank's module for ``config``, with ``transformer_overrides`` set on its
        ``TransformerConfig``; ``pre_process``/``post_process``: whether this pipeline stage holds
        the embedding / the final norm and LM head. Needs ``parallel_state`` initialised."""
        ...


class EncoderProvider:
    """The encoder on Megatron-Core's ``GPTModel`` (``model.builder.build_encoder_model``)."""

    def build_model(self, config: EncoderModelConfig, *, pre_process: bool, post_process: bool,
                    transformer_overrides: Mapping[str, Any]) -> torch.nn.Module:
        from megatron_ext.model.builder import build_encoder_model

        return build_encoder_model(config, pre_process=pre_process, post_process=post_process,
                                   transformer_overrides=transformer_overrides)


ENCODER: ModelProvider = EncoderProvider()
"""The run's model unless ``training.loop.pretrain`` is given another provider."""
