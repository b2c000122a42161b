"""A checkpoint resolved once, and what the stages above training ask of it.

Export, evaluation, inference and the resume policy all start from a path that names either one
checkpoint or a save directory (then its newest complete checkpoint). :class:`Checkpoint` resolves
that path once, refusing incomplete ones with the reason; its reads (the files saved beside the
weights: the run config, the model architecture, the tokenizer reference, the optimizer format;
and the weights) go to that directory without resolving it again.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_ext.checkpoint import megatron_io
from megatron_ext.config_loading import UserError, build_dataclass
from megatron_ext.model.config import EncoderModelConfig, with_current_model_keys
from megatron_ext.tokenizer import TokenizerConfig


@dataclass(frozen=True)
class Checkpoint:
    """One complete checkpoint directory (``iter_NNNNNNN``)."""

    path: Path
    """The checkpoint directory itself, never a save directory."""

    @classmethod
    def open(cls, location: str | os.PathLike) -> Checkpoint:
        """The checkpoint ``location`` names: itself, or the newest complete one in a save
        directory. ``UserError`` naming the path and what is missing otherwise."""
        return cls(megatron_io.resolve_checkpoint(Path(location)))

    @classmethod
    def latest(cls, location: str | os.PathLike | None) -> Checkpoint | None:
        """Like :meth:`open`, but None where there is no complete checkpoint (or no location)."""
        found = megatron_io.latest_checkpoint(location) if location else None
        return cls(found) if found is not None else None

    @classmethod
    def every(cls, save_dir: str | os.PathLike) -> list[Checkpoint]:
        """The complete checkpoints of a save directory, oldest first (none, or no directory: [])."""
        return [cls(path) for path in megatron_io.complete_checkpoints(Path(save_dir))]

    @classmethod
    def at_step(cls, save_dir: str | os.PathLike, step: int) -> Checkpoint:
        """The complete checkpoint of ``step`` in ``save_dir`` (``checkpoint.load_step``)."""
        return cls(megatron_io.checkpoint_at_step(Path(save_dir), step))

    def check_intact(self) -> None:
        """``UserError`` naming the missing or resized file, the intact checkpoints left beside
        it and ``--load-step``, when the files no longer match the manifest saved with them."""
        megatron_io.check_intact(self.path)

    def _json(self, name: str) -> dict:
        return json.loads((self.path / name).read_text())

    @property
    def step(self) -> int:
        """The number of training steps the checkpoint has completed."""
        return int(self._json(megatron_io.COMPLETE)["step"])

    def run_config(self) -> dict:
        """The resolved run config the training run saved (``run_config.json``), with keys renamed
        since under their current names."""
        run_config = self._json(megatron_io.RUN_CONFIG)
        if isinstance(run_config.get("model"), dict):
            run_config["model"] = with_current_model_keys(
                run_config["model"], f"{self.path / megatron_io.RUN_CONFIG} model", warn=False)
        return run_config

    def model_config(self) -> EncoderModelConfig:
        """The architecture of the saved weights (the run config's ``model`` section)."""
        where = f"{self.path / megatron_io.RUN_CONFIG} model"
        run_config = self.run_config()
        if "model" not in run_config:
            raise UserError(f"{where}: missing; expected the saved model section")
        return build_dataclass(EncoderModelConfig, run_config["model"], where)

    def tokenizer_config(self) -> TokenizerConfig:
        """The tokenizer the weights expect (``tokenizer_reference.json``: the ``TokenizerConfig``
        fields that rebuild it)."""
        reference = self._json(megatron_io.TOKENIZER_REFERENCE)
        reference.pop(megatron_io.TOKENIZER_FINGERPRINT, None)
        return TokenizerConfig(**reference)

    def tokenizer_fingerprint(self) -> str | None:
        """The content fingerprint of that tokenizer (``EncoderTokenizer.fingerprint``; None for
        checkpoints saved without one)."""
        return self._json(megatron_io.TOKENIZER_REFERENCE).get(megatron_io.TOKENIZER_FINGERPRINT)

    def optimizer_format(self) -> dict | None:
        """The optimizer-state format saved (None: weights only); see ``megatron_io.saved_optimizer_format``."""
        return megatron_io.saved_optimizer_format(self.path)

    def load(self, *, model: torch.nn.Module, optimizer: megatron_io.OptimizerCheckpointState | None = None,
             strict_shapes: bool = True) -> dict:
        """Load the weights (and ``optimizer``'s state) into place; returns the trainer state.
        See :func:`megatron_ext.checkpoint.megatron_io.load_checkpoint`."""
        return megatron_io.load_checkpoint(self.path, model=model, optimizer=optimizer, strict_shapes=strict_shapes)

    def __str__(self) -> str:
        return str(self.path)
