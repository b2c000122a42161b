"""``checkpoint:`` of a run config. Kept apart from the checkpoint code (``core.py``, which
imports Megatron-Core's ``dist_checkpointing``) so reading and validating a recipe
(``--dry-run`` on a login node) stays light."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_ext.config_loading import UserError


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where and how often to checkpoint, and what to resume from."""

    save: str | None = None
    """Directory of checkpoints (Megatron: ``--save``); None writes none."""
    load: str | None = None
    """Directory (or one checkpoint) to start from (Megatron: ``--load``); when resuming it
    defaults to ``save``."""
    save_interval: int = 1000
    """Steps between checkpoints (``--save-interval``); a final one is always written at the end."""
    keep_last: int = 2
    """Keep only the ``keep_last`` newest complete checkpoints."""
    finetune: bool = False
    """Load weights only from ``load``: fresh optimizer, step 0 (continued pretraining; Megatron:
    ``--finetune``)."""
    async_save: bool = False
    """Write checkpoints in the background (Megatron's asynchronous save, ``--async-save``):
    training stalls only while the state is staged, and a checkpoint counts (tracker, marker)
    only once every rank has written it."""
    optimizer_format: Literal["dp_reshardable", "fully_reshardable"] = "dp_reshardable"
    """How the distributed optimizer's state is written (Megatron's
    ``distrib_optim_sharding_type``; ``parallel.use_distributed_optimizer`` only).
    ``dp_reshardable``: each rank writes its own buffers, no communication; the run can resume
    at another data-parallel size but the same tensor and pipeline sizes. ``fully_reshardable``
    (Megatron-LM ``--dist-ckpt-optim-fully-reshardable``): the state is gathered into one tensor
    per parameter, slower to save, resumable under any layout (needed to change TP or PP)."""

    def __post_init__(self) -> None:
        if self.save_interval < 1:
            raise UserError(f"CheckpointConfig.save_interval must be >= 1, got {self.save_interval}")
        if self.keep_last < 1:
            raise UserError(f"CheckpointConfig.keep_last must be >= 1, got {self.keep_last}")
