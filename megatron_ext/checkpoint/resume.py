"""The resume policy: where a run starts from (nothing, a checkpoint's weights, or a whole
checkpoint), and what it may change on the way.

``checkpoint.finetune``: the weights of ``checkpoint.load``'s newest checkpoint and a fresh
optimizer and schedule (continued pretraining), unless ``checkpoint.save`` already holds a
checkpoint of this run (an interrupted continued pretraining), which is resumed in full.
Otherwise the newest checkpoint in ``checkpoint.load`` (or ``checkpoint.save``) is resumed in
full, or the run starts fresh.

A full resume first checks, before anything is loaded, that the run is the same model (its
``model`` fields and tokenizer content; only ``RESUME_MAY_CHANGE_MODEL`` may differ) and that
this run's optimizer can take the saved optimizer-state format. Everything else (learning rate,
schedule, intervals, data blend, the parallel layout where the optimizer format allows) may
change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from megatron_ext.checkpoint.config import CheckpointConfig
from megatron_ext.checkpoint.core import OptimizerCheckpointState, optimizer_format_problem
from megatron_ext.checkpoint.handle import Checkpoint
from megatron_ext.config_loading import UserError
from megatron_ext.tokenizer import EncoderTokenizer

RESUME_MAY_CHANGE_MODEL = ("attention_backend", "depth_scaled_init")
"""Model fields that may differ on resume: the attention kernels (te and local load the same
weights) and how weights are initialised (loaded weights replace them)."""


class TrainingState(Protocol):
    """What checkpoints save and load of a training engine (``training.engines.MegatronEngine``):
    the policy loads into it, the training loop saves it."""

    checkpoint_model: torch.nn.Module
    """The bare model whose ``sharded_state_dict`` is saved and loaded."""
    optimizer_state: OptimizerCheckpointState
    """The optimizer's state as the checkpoint writes and reads it."""

    def checkpointing(self) -> contextlib.AbstractContextManager:
        """The context in which the engine's state may be saved or loaded."""

    def weights_loaded(self) -> None:
        """The model's weights were replaced without the optimizer's state (continued pretraining):
        copies the optimizer keeps of them (fp32 main parameters) are refreshed."""


@dataclass(kw_only=True)
class StartingPoint:
    """Where a run starts from."""

    trainer_state: dict = field(default_factory=dict)
    """The saved trainer state of a full resume (step, RNG, counters); empty for a fresh start
    or continued pretraining from weights only."""
    checkpoint: Checkpoint | None = None
    """The checkpoint loaded (None: a fresh start)."""


def meaning_changes(checkpoint: Checkpoint, *, model_fields: Mapping, tokenizer: EncoderTokenizer,
                    tokenizer_model: str) -> list[str]:
    """What differs between the run that saved ``checkpoint`` and this one in a way that changes
    what the weights mean: ``model_fields`` (the run config's ``model`` section as saved, beyond
    ``RESUME_MAY_CHANGE_MODEL``) and the tokenizer's content."""
    saved = checkpoint.run_config().get("model", {})
    changes = [f"model.{key}: {saved.get(key)!r} -> {model_fields.get(key)!r}"
               for key in sorted(saved.keys() | model_fields.keys())
               if key not in RESUME_MAY_CHANGE_MODEL and saved.get(key) != model_fields.get(key)]
    fingerprint = checkpoint.tokenizer_fingerprint()
    if fingerprint is not None and fingerprint != tokenizer.fingerprint():
        changes.append(f"tokenizer: {checkpoint.tokenizer_config().tokenizer_model!r} (content {fingerprint}) -> "
                       f"{tokenizer_model!r} (content {tokenizer.fingerprint()})")
    return changes


def _resume_in_full(target: TrainingState, checkpoint: Checkpoint, *, model_fields: Mapping,
                    tokenizer: EncoderTokenizer, tokenizer_model: str) -> dict:
    """Load model and optimizer state from ``checkpoint`` if the run is the same model and the
    engine can take its optimizer state (both checked before anything is loaded); returns the
    trainer state."""
    changes = meaning_changes(checkpoint, model_fields=model_fields, tokenizer=tokenizer,
                              tokenizer_model=tokenizer_model)
    if changes:
        raise UserError(f"cannot resume from checkpoint {checkpoint}: this run changes what its weights mean:\n  "
                        + "\n  ".join(changes) + "\nUse the checkpoint's settings, or another checkpoint.save "
                        "directory for a new run (checkpoint.load + checkpoint.finetune to start from its weights).")
    problem = optimizer_format_problem(checkpoint.optimizer_format(), target.optimizer_state.format())
    if problem:
        raise UserError(f"cannot resume from checkpoint {checkpoint}: {problem}. Or start from its weights only with "
                        f"checkpoint.load={checkpoint.path.parent} and checkpoint.finetune: true (fresh optimizer "
                        "and schedule).")
    with target.checkpointing():
        return checkpoint.load(model=target.checkpoint_model, optimizer=target.optimizer_state)


def load_starting_point(target: TrainingState, config: CheckpointConfig, *, model_fields: Mapping,
                        tokenizer: EncoderTokenizer, tokenizer_model: str) -> StartingPoint:
    """Apply the policy of the module docstring to ``target``. ``model_fields`` and
    ``tokenizer_model``: this run's model section (as saved, JSON types) and tokenizer setting."""
    identity = dict(model_fields=model_fields, tokenizer=tokenizer, tokenizer_model=tokenizer_model)
    if config.finetune:
        weights = Checkpoint.latest(config.load)
        if weights is None:
            raise UserError(f"checkpoint.load={config.load!r}: no complete checkpoint found")
        with target.checkpointing():
            weights.load(model=target.checkpoint_model, optimizer=None)
        target.weights_loaded()
        own = Checkpoint.latest(config.save)
        if own is not None:
            return StartingPoint(trainer_state=_resume_in_full(target, own, **identity), checkpoint=own)
        return StartingPoint(checkpoint=weights)
    found = Checkpoint.latest(config.load or config.save)
    if config.load and found is None:
        raise UserError(f"checkpoint.load={config.load!r}: no complete checkpoint found")
    if found is None:
        return StartingPoint()
    return StartingPoint(trainer_state=_resume_in_full(target, found, **identity), checkpoint=found)
