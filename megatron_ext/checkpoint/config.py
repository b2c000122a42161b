"""``checkpoint:`` of a run config. Kept apart from the checkpoint code (``reader.py`` and
``writer.py``, which import Megatron-Core's ``dist_checkpointing``) so reading and validating a recipe
(``--dry-run`` on a login node) stays light."""

from __future__ import annotations

import os
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
    load_step: int | None = None
    """Resume in full from this step's checkpoint (``iter_NNNNNNN``) of ``load`` (or of ``save``
    where ``load`` is unset) instead of the newest: past a damaged newest checkpoint, whose error
    names this flag (``--load-step``). Checkpoints newer than it are replaced as the run saves those
    steps again; drop the flag once it has saved past them, or a restart goes back to this step."""
    save_interval: int = 1000
    """Steps between checkpoints (``--save-interval``); a final one is always written at the end.
    Unlike Megatron-LM, which keeps every checkpoint, only the ``keep_last`` newest stay (and
    those of ``keep_steps``): ``keep_last: 0`` keeps them all."""
    save_interval_minutes: float | None = None
    """Also save after the first step that ends this many minutes (wall clock) after the last save
    or the run's start, every rank agreeing: bounds the work a failure loses whatever the steps
    cost (``--save-interval`` counts steps). None: steps only."""
    keep_last: int = 2
    """Keep only the ``keep_last`` newest complete checkpoints (and every one of ``keep_steps``);
    0 keeps every checkpoint, as Megatron-LM does."""
    keep_steps: tuple[int, ...] = ()
    """Steps this run saves even off ``save_interval`` and never prunes: the checkpoints other runs
    branch from (``branch_from``/``branch_step``) or start from. A study's planner sets them."""
    finetune: bool = False
    """Load weights only from ``load``: fresh optimizer, step 0 (continued pretraining; Megatron:
    ``--finetune``)."""
    branch_from: str | None = None
    """Another run's ``save`` directory: this run is that run up to ``branch_step`` and starts from
    its full state there (weights, optimizer, step, RNG), read in place, not copied; it saves into
    its own ``save`` and trains its own recipe's phases and schedule from ``branch_step`` on.
    Refused before anything is loaded unless both recipes compute the same steps before
    ``branch_step`` (``training.branching.check_branch``). Once ``save`` holds a checkpoint of this
    run, that is resumed instead (``checkpoint/resume.py``)."""
    branch_step: int | None = None
    """The parent's step to branch at (its ``iter_NNNNNNN``, which the parent must have saved:
    its ``keep_steps``); required with ``branch_from``."""
    async_save: bool = False
    """Write checkpoints in the background (Megatron's asynchronous save, ``--async-save``):
    training stalls only while the state is staged, and a checkpoint counts (tracker, marker)
    only once every rank has written it."""
    async_strategy: Literal["mcore", "nvrx"] = "mcore"
    """Which implementation writes the asynchronous saves (Megatron's ``async_strategy``; with
    ``async_save`` only: synchronous saves always use Megatron's own writer). ``mcore``: Megatron-Core's
    own asynchronous writer, which Megatron calls deprecated. ``nvrx``: NVIDIA's resiliency package
    (``nvidia-resiliency-ext``, which megatron-core 0.19.2 needs at >= ``NVRX_MIN_VERSION``; not in
    requirements.txt: docs/gpu.md, "Asynchronous saves"). Both write the same checkpoint format."""
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
        if self.save_interval_minutes is not None and not self.save_interval_minutes > 0:
            raise UserError(f"checkpoint.save_interval_minutes must be > 0, got {self.save_interval_minutes}")
        if self.keep_last < 0:
            raise UserError(f"checkpoint.keep_last must be >= 1, or 0 to keep every checkpoint; got {self.keep_last}")
        if self.load_step is not None:
            if isinstance(self.load_step, bool) or not isinstance(self.load_step, int) or self.load_step < 1:
                raise UserError(f"checkpoint.load_step must be a saved step >= 1, got {self.load_step!r}")
            if not (self.load or self.save):
                raise UserError("checkpoint.load_step needs checkpoint.save or checkpoint.load (where that step is)")
            if self.finetune or self.branch_from is not None:
                raise UserError("checkpoint.load_step resumes a run in full: drop checkpoint.finetune and "
                                "checkpoint.branch_from (or load_step)")
        if self.async_strategy == "nvrx" and not self.async_save:
            raise UserError("checkpoint.async_strategy: nvrx chooses the writer of asynchronous saves; set "
                            "checkpoint.async_save: true as well (synchronous saves always use Megatron's own writer)")
        if any(isinstance(step, bool) or not isinstance(step, int) or step < 1 for step in self.keep_steps):
            raise UserError(f"checkpoint.keep_steps must be steps >= 1, got {list(self.keep_steps)}")
        object.__setattr__(self, "keep_steps", tuple(sorted(set(self.keep_steps))))
        if self.keep_steps and not self.save:
            raise UserError(f"checkpoint.keep_steps {list(self.keep_steps)} needs checkpoint.save (where they are kept)")
        if (self.branch_from is None) != (self.branch_step is None):
            given, missing = ("branch_from", "branch_step") if self.branch_step is None else ("branch_step", "branch_from")
            raise UserError(f"checkpoint.{given} needs checkpoint.{missing}: a branch starts from the parent run's "
                            "save directory (branch_from) at one of its saved steps (branch_step)")
        if self.branch_from is None:
            return
        if isinstance(self.branch_step, bool) or not isinstance(self.branch_step, int) or self.branch_step < 1:
            raise UserError(f"checkpoint.branch_step must be a step >= 1, got {self.branch_step!r} "
                            "(step 0 is a start from scratch: drop branch_from)")
        if self.load and not self.finetune:
            raise UserError(f"checkpoint.branch_from={self.branch_from!r} and checkpoint.load={self.load!r} both name "
                            "the state this run starts from; keep one (load with finetune: true is a continued "
                            "pretraining's source weights, which a branch may have)")
        if self.save and os.path.abspath(self.save) == os.path.abspath(self.branch_from):
            raise UserError(f"checkpoint.branch_from is this run's own checkpoint.save ({self.save!r}): a branch "
                            "saves into its own directory, so that the parent's checkpoints stay as they are")
        below = [step for step in self.keep_steps if step <= self.branch_step]
        if below:
            raise UserError(f"checkpoint.keep_steps {below}: this run starts at its branch_step {self.branch_step} "
                            "and never saves those steps (keep them on the run that trains them)")


NVRX_DISTRIBUTION = "nvidia-resiliency-ext"
NVRX_MIN_VERSION = "0.6.0"
"""The oldest ``nvidia-resiliency-ext`` megatron-core 0.19.2 takes (its ``strategies/nvrx.py``:
``NVRX_MIN_VERSION``; a test holds the two equal). Below it Megatron cannot even be imported: its
``strategies/torch.py`` asserts the version at import (0.4.1, the newest this project's package
index offered in 2026-11, also lacks ``__version__``, so the import dies with an ``AttributeError``)."""


def nvrx_problem() -> str | None:
    """Why Megatron's ``nvrx`` asynchronous writer cannot run here (one line), or None when it can.
    Read from the installed distribution's metadata, without importing Megatron or NVRx: an NVRx
    below ``NVRX_MIN_VERSION`` makes ``import megatron.core`` itself fail."""
    import importlib.metadata

    from packaging.version import Version

    try:
        installed = importlib.metadata.version(NVRX_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return (f"{NVRX_DISTRIBUTION} is not installed (megatron-core 0.19.2 needs >= {NVRX_MIN_VERSION}; "
                "docs/gpu.md, \"Asynchronous saves\")")
    if Version(installed) < Version(NVRX_MIN_VERSION):
        return (f"{NVRX_DISTRIBUTION} {installed} is installed and megatron-core 0.19.2 needs >= {NVRX_MIN_VERSION}; "
                f"below that Megatron fails at import whatever the settings: pip uninstall {NVRX_DISTRIBUTION}, "
                f"or install >= {NVRX_MIN_VERSION}")
    return None


def check_nvrx_async_writer() -> None:
    """Raise ``UserError`` in one line where ``checkpoint.async_strategy: nvrx`` cannot run here."""
    if problem := nvrx_problem():
        raise UserError(f"checkpoint.async_strategy: nvrx: {problem}; or set checkpoint.async_strategy: mcore")
