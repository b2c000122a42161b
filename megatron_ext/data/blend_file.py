"""A ``.blend`` file: a ``data_path`` written to a file, ``weight prefix`` per line.

The sharded preprocessing writes one per corpus (``shards.finish``: each non-empty shard's token
count and prefix), and a run reads it as its ``data.data_args_path`` (Megatron's
``--data-args-path``: the file's whitespace-separated entries are the blend). Both go through this
module, so the format has one writer and one reader.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from megatron_ext.config_loading import UserError
from megatron_ext.fileio import write_atomic


def write_blend(path: str | os.PathLike, pairs: Iterable[tuple[int | float, str]]) -> None:
    """Write ``(weight, prefix)`` pairs to ``path``, one per line (atomically)."""
    write_atomic(path, "".join(f"{weight} {prefix}\n" for weight, prefix in pairs))


def read_blend(path: str | os.PathLike, *, where: str | None = None) -> tuple[str, ...]:
    """The ``data_path`` entries of the file at ``path`` (``weight, prefix, weight, prefix, ...``);
    ``UserError`` naming ``where`` (default: the path) when it cannot be read or holds none."""
    where = where or str(path)
    try:
        entries = tuple(Path(path).read_text(encoding="utf-8").split())
    except OSError as error:
        raise UserError(f"{where}: {error.strerror or error}") from None
    if not entries:
        raise UserError(f"{where}: the file holds no data_path entries")
    return entries
