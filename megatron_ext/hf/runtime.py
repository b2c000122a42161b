"""What import and export share besides the name map: a one-process Megatron runtime at
tensor-parallel size 1, checkpoint loading, and atomically published output directories."""

from __future__ import annotations

import contextlib
import dataclasses
import filecmp
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ext import platform
from megatron_ext.model import EncoderModel, EncoderModelConfig, build_encoder_model
from megatron_ext.checkpoint.handle import Checkpoint


@contextlib.contextmanager
def single_process_model_parallel() -> Iterator[None]:
    """Megatron's parallel state for this one process at TP=1; started (and torn down) here
    unless the caller already runs one. The caller's torch RNG state is left untouched."""
    with torch.random.fork_rng(devices=[]):
        if dist.is_initialized():
            if (dist.get_world_size() != 1 or not parallel_state.model_parallel_is_initialized()
                    or parallel_state.get_tensor_model_parallel_world_size() != 1):
                raise RuntimeError(
                    "Hugging Face conversion runs in a single process at tensor-parallel size 1 "
                    "(Megatron's dist checkpoints reshard on load); run it outside torchrun")
            yield
            return
        with tempfile.TemporaryDirectory() as tmp:
            platform.init_process_group_and_model_parallel(
                init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
            try:
                yield
            finally:
                platform.destroy_process_group_and_model_parallel()


def build_local_model(config: EncoderModelConfig) -> EncoderModel:
    """The model at TP=1 with the ``local`` attention backend (its parameter names are the name
    map's; both backends share dist-checkpoint keys). Needs the parallel state."""
    return build_encoder_model(dataclasses.replace(config, attention_backend="local")).eval()


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


@contextlib.contextmanager
def staging_dir(target: Path) -> Iterator[Path]:
    """A fresh hidden directory beside ``target``, removed on exit unless published."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def is_empty_dir_or_absent(path: Path) -> bool:
    """True when ``path`` does not exist or is an empty directory; False for a non-empty
    directory; ``ValueError`` when it is a file."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory")
    return not path.exists() or not any(path.iterdir())


def tree_differences(a: Path, b: Path) -> list[str]:
    """Relative paths of the files that differ between two directory trees (byte comparison)."""
    def files(root: Path) -> set[str]:
        return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}

    fa, fb = files(a), files(b)
    return sorted((fa ^ fb) | {f for f in fa & fb if not filecmp.cmp(a / f, b / f, shallow=False)})


def publish(tmp: Path, target: Path, *, overwrite: bool, identical_ok: bool) -> str:
    """Move the finished ``tmp`` to ``target`` in one rename; returns what happened.

    ``created``: ``target`` was absent or empty. ``unchanged``: ``identical_ok`` and ``target``
    already holds byte-identical files. ``replaced``: ``overwrite`` (the old tree is swapped out,
    then deleted). Otherwise ``ValueError`` naming the files that differ.
    """
    if is_empty_dir_or_absent(target):
        if target.exists():
            target.rmdir()
        os.replace(tmp, target)
        return "created"
    differences = tree_differences(tmp, target)
    if identical_ok and not differences:
        return "unchanged"
    if not overwrite:
        listing = ", ".join(differences[:6]) + (" ..." if len(differences) > 6 else "")
        raise ValueError(f"{target} already holds a different model (files that differ: "
                         f"{listing}); pass --overwrite (overwrite=True) to replace it")
    old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:12]}"
    os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old)
    return "replaced"
