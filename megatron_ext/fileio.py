"""Outputs published whole: a reader (or a run killed half-way) sees the old output or the new
one, never a half-written one; and the project's one rule for outputs that already exist.

Files and directories are staged under hidden temporary names beside their target and renamed
into place once complete (a rename within a directory is atomic). Two writers keep their own
staging because they publish more than a rename: distributed checkpoints (every rank writes,
rank 0 publishes after a barrier; ``checkpoint/writer.py``) and indexed datasets (a ``.bin``/``.idx``
pair, with temporaries named by process id so that a killed run's leftovers can be recognised;
``data/preprocess.py``).

Existing outputs: identical ones are left alone, different ones are replaced only with
``overwrite`` (the ``--overwrite`` flag of the tools), and the error names the files that differ.
"""

from __future__ import annotations

import contextlib
import filecmp
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

from megatron_ext.config_loading import UserError


@contextlib.contextmanager
def staged_file(path: str | os.PathLike) -> Iterator[Path]:
    """A fresh temporary file beside ``path`` for the block to fill; renamed over ``path``
    (mode 0644) when the block completes, deleted when it raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` (str as UTF-8) to ``path`` through :func:`staged_file`."""
    with staged_file(path) as tmp:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


def _refuse_differences(differing: list[str], what: str, overwrite: bool) -> None:
    if differing and not overwrite:
        listing = ", ".join(differing[:6]) + (" ..." if len(differing) > 6 else "")
        raise UserError(f"{what} (files that differ: {listing}); pass --overwrite (overwrite=True) to replace "
                        "them")


def write_files(files: Mapping[Path, bytes], *, overwrite: bool) -> bool:
    """Write each of ``files`` atomically, in order (so the last one, a manifest, vouches for
    the others); returns False when they all already held exactly these bytes (nothing written).
    Existing files with other bytes are a ``UserError`` naming them unless ``overwrite``."""
    existing = {path: path.read_bytes() for path in files if path.exists()}
    differing = [str(path) for path, data in existing.items() if data != files[path]]
    _refuse_differences(differing, "outputs exist with different content", overwrite)
    if not differing and len(existing) == len(files):
        return False
    for path, data in files.items():
        write_atomic(path, data)
    return True


@contextlib.contextmanager
def staged_dir(target: Path) -> Iterator[Path]:
    """A fresh hidden directory beside ``target`` for the block to fill; removed on exit unless
    the block published it (:func:`publish_dir`)."""
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
    directory; ``UserError`` when it is a file."""
    if path.exists() and not path.is_dir():
        raise UserError(f"{path} exists and is not a directory")
    return not path.exists() or not any(path.iterdir())


def tree_differences(a: Path, b: Path) -> list[str]:
    """Relative paths of the files that differ between two directory trees (byte comparison)."""
    def files(root: Path) -> set[str]:
        return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}

    fa, fb = files(a), files(b)
    return sorted((fa ^ fb) | {f for f in fa & fb if not filecmp.cmp(a / f, b / f, shallow=False)})


def publish_dir(tmp: Path, target: Path, *, overwrite: bool, identical_ok: bool) -> str:
    """Move the finished ``tmp`` to ``target`` in one rename; returns what happened.

    ``created``: ``target`` was absent or empty. ``unchanged``: ``identical_ok`` and ``target``
    already holds byte-identical files. ``replaced``: ``overwrite`` (the old tree is swapped out,
    then deleted). Otherwise ``UserError`` naming the files that differ.
    """
    if is_empty_dir_or_absent(target):
        if target.exists():
            target.rmdir()
        os.replace(tmp, target)
        return "created"
    differences = tree_differences(tmp, target)
    if identical_ok and not differences:
        return "unchanged"
    _refuse_differences(differences or ["(identical files)"], f"{target} already holds a different model", overwrite)
    old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:12]}"
    os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old)
    return "replaced"
