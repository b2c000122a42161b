"""The resume policy: where a run starts from (nothing, a checkpoint's weights, another run's
whole checkpoint, or its own), and what it may change on the way.

In this order, the first that applies:

1. The run's own newest checkpoint in ``checkpoint.save`` (unless ``checkpoint.load`` names
   another run to resume without ``finetune``: case 4): resumed in full. An interrupted or
   finished run, branch or continued pretraining, goes on from its own state, never its
   parent's again. Where the recipe names a parent (``checkpoint.branch_from``), the
   checkpoint must record the same one (``BRANCHED_FROM``); a rerun without the branch keys
   resumes, keeping the record.
2. ``checkpoint.branch_from``: the parent's checkpoint at exactly ``checkpoint.branch_step``
   (``iter_NNNNNNN``, complete), resumed in full in place (not copied) after the caller's check
   that both recipes compute the same steps before it (``training.branching.check_saved_parent``
   through ``branch_check``), all before anything is loaded. The trainer state is the parent's
   (step, RNG, counters: the child's own trajectory up to there), with ``BRANCHED_FROM`` added;
   the caller drops what belongs to the parent's run alone (``StartingPoint.from_parent``).
   A continued pretraining branching off a sibling (``load`` + ``finetune`` and the branch keys)
   takes this case: its ``load`` names the weights both started from.
3. ``checkpoint.finetune``: the weights of ``checkpoint.load``'s newest checkpoint, a fresh
   optimizer and schedule (continued pretraining).
4. ``checkpoint.load`` (without ``finetune``): its newest checkpoint resumed in full.
5. Nothing: a fresh start.

A full resume first checks, before anything is loaded, that the run is the same model (its
``model`` fields and tokenizer content; only ``RESUME_MAY_CHANGE_MODEL`` may differ) and that
this run's optimizer can take the saved optimizer-state format. What a step reads and attends to
is the trainer's to keep (``training.loop``: each phase's context, the batch ramp-up, and
``RESUME_KEEPS_DATA``, e.g. ``data.reset_attention_mask``). Everything else (learning rate,
schedule, intervals, data blend, the parallel layout where the optimizer format allows) may
change on a resume; a branch's schedule is checked against its parent's by ``branch_check``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from megatron_ext.checkpoint.config import CheckpointConfig
from megatron_ext.checkpoint.reader import Checkpoint, OptimizerCheckpointState, optimizer_format_problem
from megatron_ext.config_loading import UserError
from megatron_ext.tokenizer import EncoderTokenizer

RESUME_MAY_CHANGE_MODEL = ("transformer_impl", "depth_scaled_init", "seq_length")
"""Model fields that may differ on resume: the attention kernels (te and local load the same
weights), how weights are initialised (loaded weights replace them) and the longest input accepted
(a guard: RoPE has no learned table). The lengths a resumed run's steps read are compared with the
saved run's by the trainer (``training.loop``: a resume keeps each phase's context)."""

BRANCHED_FROM = "branched_from"
"""Trainer-state key of a branch's parent, ``{"save": its save directory (absolute), "step": the
branch step}``: set when the branch starts, carried by every checkpoint the run saves."""

BranchCheck = Callable[[dict, int], None]
"""``check(parent_run_config, step)``: raises ``UserError`` naming the first difference unless this
run is the run that saved ``parent_run_config`` (a ``run_config.json``) on its first ``step``
steps (``training.branching.check_saved_parent``: the check lives above the checkpoint layer)."""


class TrainingState(Protocol):
    """What checkpoints save and load of a training engine (``training.megatron_engine.MegatronEngine``):
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
    from_parent: bool = False
    """True where ``trainer_state`` is the parent's (a branch starting now, case 2): what belongs to
    the parent's run alone (e.g. its W&B run id) is the caller's to drop."""

    @property
    def branched_from(self) -> dict | None:
        """The parent this run branched from (``BRANCHED_FROM``), or None."""
        return self.trainer_state.get(BRANCHED_FROM)


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
    checkpoint.check_intact()  # first: the files the checks below read may be the damaged ones
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


def branch_record(config: CheckpointConfig) -> dict | None:
    """The ``BRANCHED_FROM`` record of the branch ``config`` names (None: no branch)."""
    if config.branch_from is None:
        return None
    return {"save": os.path.abspath(config.branch_from), "step": config.branch_step}


def _branch_point(config: CheckpointConfig) -> Checkpoint:
    """The parent's complete checkpoint at ``branch_step``, or the reason there is none."""
    where, step = f"checkpoint.branch_from={config.branch_from!r}", config.branch_step
    if not Path(config.branch_from).is_dir():
        raise UserError(f"{where}: no such directory (the parent run's checkpoint.save): train the parent first")
    saved = Checkpoint.every(config.branch_from)
    found = [checkpoint for checkpoint in saved if checkpoint.step == step]
    if found:
        return found[0]
    steps = [checkpoint.step for checkpoint in saved]
    if not steps or max(steps) < step:
        newest = f"its newest is step {max(steps)}" if steps else "it holds no complete checkpoint"
        raise UserError(f"{where}: the parent has not reached step {step} yet ({newest}); branch once it has "
                        f"saved it (with keep_steps: [{step}] on the parent, so that it keeps it)")
    raise UserError(f"{where}: the parent never saved step {step} (or pruned it); it has steps "
                    f"{', '.join(map(str, steps))}; set keep_steps: [{step}] in the parent's checkpoint section "
                    "and train it again from before that step, or branch at one of those")


def _check_same_parent(own: Checkpoint, state: dict, config: CheckpointConfig) -> None:
    """A rerun of a branch resumes its own checkpoint only if that branched from the recipe's parent."""
    wanted, recorded = branch_record(config), state.get(BRANCHED_FROM)
    if wanted is None or recorded == wanted:
        return
    held = (f"a run branched from {recorded['save']} at step {recorded['step']}" if recorded
            else "a run that was not branched")
    raise UserError(f"checkpoint.save={config.save!r} holds {own.path.name} of {held}, but this recipe branches from "
                    f"{wanted['save']} at step {wanted['step']}: give this branch its own checkpoint.save, or "
                    "rerun the recipe of the run saved there")


def load_starting_point(target: TrainingState, config: CheckpointConfig, *, model_fields: Mapping,
                        tokenizer: EncoderTokenizer, tokenizer_model: str,
                        branch_check: BranchCheck | None = None) -> StartingPoint:
    """Apply the policy of the module docstring to ``target``. ``model_fields`` and
    ``tokenizer_model``: this run's model section (as saved, JSON types) and tokenizer setting;
    ``branch_check``: needed with ``checkpoint.branch_from``."""
    identity = dict(model_fields=model_fields, tokenizer=tokenizer, tokenizer_model=tokenizer_model)
    if config.load_step is not None:  # an explicit step (past a damaged newest checkpoint): nothing else applies
        directory = config.load if config.load and not config.finetune else config.save
        chosen = Checkpoint.at_step(directory, config.load_step)
        state = _resume_in_full(target, chosen, **identity)
        _check_same_parent(chosen, state, config)
        return StartingPoint(trainer_state=state, checkpoint=chosen)
    own = Checkpoint.latest(config.save) if config.finetune or not config.load else None
    if own is not None:
        state = _resume_in_full(target, own, **identity)
        _check_same_parent(own, state, config)
        return StartingPoint(trainer_state=state, checkpoint=own)
    if config.branch_from is not None:
        if branch_check is None:
            raise TypeError("load_starting_point: checkpoint.branch_from needs a branch_check")
        parent = _branch_point(config)
        branch_check(parent.run_config(), config.branch_step)
        state = _resume_in_full(target, parent, **identity)
        return StartingPoint(trainer_state={**state, BRANCHED_FROM: branch_record(config)}, checkpoint=parent,
                             from_parent=True)
    if config.finetune:
        weights = Checkpoint.latest(config.load)
        if weights is None:
            raise UserError(f"checkpoint.load={config.load!r}: no complete checkpoint found")
        with target.checkpointing():
            weights.load(model=target.checkpoint_model, optimizer=None)
        target.weights_loaded()
        return StartingPoint(checkpoint=weights)
    if not config.load:
        return StartingPoint()
    found = Checkpoint.latest(config.load)
    if found is None:
        raise UserError(f"checkpoint.load={config.load!r}: no complete checkpoint found")
    return StartingPoint(trainer_state=_resume_in_full(target, found, **identity), checkpoint=found)
