"""A checkpoint's model in this one process: Megatron's parallel state at tensor-parallel size 1,
the model built from a saved architecture, a checkpoint loaded into it. What the tools that read or
write weights outside a training run share (Hugging Face import and export, ``checkpoint/merge.py``);
Megatron's dist checkpoints reshard on load, so a checkpoint saved at any TP loads here."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ext import process_group
from megatron_ext.checkpoint.reader import Checkpoint
from megatron_ext.checkpoint.writer import save_checkpoint
from megatron_ext.config_loading import UserError
from megatron_ext.model import EncoderModel, EncoderModelConfig, build_encoder_model


@contextlib.contextmanager
def single_process_model_parallel() -> Iterator[None]:
    """Megatron's parallel state for this one process at TP=1; started (and torn down) here
    unless the caller already runs one. The caller's torch RNG state is left untouched."""
    with torch.random.fork_rng(devices=[]):
        if dist.is_initialized():
            if (dist.get_world_size() != 1 or not parallel_state.model_parallel_is_initialized()
                    or parallel_state.get_tensor_model_parallel_world_size() != 1):
                raise UserError(
                    "loading a checkpoint outside training runs in a single process at tensor-parallel size 1 "
                    "(Megatron's dist checkpoints reshard on load); run it outside torchrun")
            yield
            return
        with tempfile.TemporaryDirectory() as tmp:
            process_group.init_process_group_and_model_parallel(
                init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
            try:
                yield
            finally:
                process_group.destroy_process_group_and_model_parallel()


def build_local_model(config: EncoderModelConfig) -> EncoderModel:
    """The model at TP=1 with the ``local`` layer implementation (its parameter names are the name
    map's; both backends share dist-checkpoint keys). Needs the parallel state."""
    return build_encoder_model(dataclasses.replace(config, transformer_impl="local")).eval()


def load_megatron_checkpoint(checkpoint: str | os.PathLike | Checkpoint) -> EncoderModel:
    """The checkpoint's model (its saved architecture) at TP=1, whatever TP it was saved at.

    ``checkpoint``: one checkpoint or a save directory (its newest). Needs the parallel state
    (:func:`single_process_model_parallel`).
    """
    if not isinstance(checkpoint, Checkpoint):
        checkpoint = Checkpoint.open(checkpoint)
    model = build_local_model(checkpoint.model_config())
    checkpoint.load(model=model)
    return model


def save_weights(directory: str | os.PathLike, config: EncoderModelConfig, state: dict[str, torch.Tensor], *,
                 run_config: dict, model_config: dict, tokenizer_reference: dict) -> Path:
    """``state`` loaded into the model of ``config`` (every name matched: a tool's name map or merge
    and the model agree) and saved as the weights-only checkpoint of step 0 in ``directory``; its
    path. Needs the parallel state (:func:`single_process_model_parallel`)."""
    model = build_local_model(config)
    outcome = model.load_state_dict(state, strict=False)
    if outcome.unexpected_keys or [k for k in outcome.missing_keys if not k.endswith("._extra_state")]:
        raise RuntimeError(f"the state and the model disagree: missing {outcome.missing_keys}, "
                           f"unexpected {outcome.unexpected_keys}")
    return save_checkpoint(directory, step=0, model=model, optimizer=None, trainer_state={}, run_config=run_config,
                           model_config=model_config, tokenizer_reference=tokenizer_reference, keep_last=1)
