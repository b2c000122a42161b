"""What the disk does to a save: full, over quota or read-only.

A save that fails because the disk is full, over quota or read-only (Megatron's writer
processes lose the ``OSError`` and raise ``RuntimeError: Worker failure``, so the save directory
is examined too: :func:`storage_problem`) is a :class:`CheckpointStorageError`: one line naming
the directory, the problem and the size needed, exit code :data:`STORAGE_EXIT_CODE`. Before a run
starts, :class:`SpaceCheck` holds the free space against the checkpoints it will keep. Whether a
saved checkpoint's files are still whole is the reader's question (``checkpoint/reader.py``).
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.config_loading import UserError
from megatron_ext.exit_codes import STORAGE_EXIT_CODE


STORAGE_ERRNOS = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded",
                  errno.EROFS: "Read-only file system"}


class CheckpointStorageError(UserError):
    """The save directory cannot hold a checkpoint (full, over quota, read-only)."""

    exit_code = STORAGE_EXIT_CODE


def root_cause(error: BaseException) -> BaseException:
    """The first exception behind ``error``: the chain followed to its end, through the per-rank
    failures a ``torch.distributed.checkpoint.CheckpointException`` carries."""
    seen = set()
    while id(error) not in seen:
        seen.add(id(error))
        failures = getattr(error, "failures", None)
        if isinstance(failures, dict) and failures:
            first = next(iter(failures.values()))
            error = first[0] if isinstance(first, tuple) else first
            continue
        behind = error.__cause__ or error.__context__
        if behind is None:
            break
        error = behind
    return error


def one_line(error: BaseException) -> str:
    """``Type: message`` of ``error``'s root cause, its first line only (never a traceback)."""
    cause = root_cause(error)
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__


def directory_bytes(directory: Path) -> int:
    """Bytes of the files directly in ``directory``."""
    return sum(path.stat().st_size for path in directory.iterdir() if path.is_file())


def nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


@dataclass(frozen=True, kw_only=True)
class SpaceCheck:
    """Free space of a save directory against the checkpoints a run will keep there."""

    save_dir: Path
    checkpoint_bytes: int
    """One checkpoint's size: the newest complete one's, else an estimate from the model."""
    measured: bool
    """True when ``checkpoint_bytes`` is a saved checkpoint's size, False for an estimate."""
    kept: int
    """``checkpoint.keep_last``: a save needs room for one more while those stay (0: every one stays)."""
    existing_bytes: int
    """Bytes of the complete checkpoints already there (pruned as new ones come)."""

    @property
    def free_bytes(self) -> int:
        return shutil.disk_usage(nearest_existing(self.save_dir)).free

    def problem(self) -> tuple[str, bool] | None:
        """``(message, fatal)``: fatal where the next save cannot fit beside the checkpoints kept
        (a start that would fail at its first save); a warning where steady state (``kept``
        checkpoints plus the one being written) will not fit. None: enough space."""
        free = self.free_bytes
        size = f"{'' if self.measured else 'about '}{_size(self.checkpoint_bytes)}"
        where = f"checkpoint.save={str(self.save_dir)!r} has {_size(free)} free"
        if free < self.checkpoint_bytes:
            return (f"{where} and one checkpoint needs {size}: the first save would fail (No space left on "
                    "device); free space there or choose another --save", True)
        steady = (self.kept + 1) * self.checkpoint_bytes - self.existing_bytes
        if self.kept and free < steady:  # kept 0 keeps every checkpoint: no steady state to check
            return (f"{where}, short of the {_size(steady)} more that keeping checkpoint.keep_last={self.kept} "
                    f"checkpoints of {size} (plus the one being written) needs: a later save may fail", False)
        return None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def storage_problem(error: BaseException, save_dir: Path, *, needed_bytes: int | None) -> str | None:
    """The storage condition behind a failed save, as ``strerror``: an ``ENOSPC``/``EDQUOT``/
    ``EROFS`` ``OSError`` in ``error``'s chain, else (Megatron's writer processes report only
    ``Worker failure``) a read-only or too-full ``save_dir``. None: not a storage problem."""
    seen, pending = set(), [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in STORAGE_ERRNOS:
            return STORAGE_ERRNOS[current.errno]
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            pending.extend(item[0] if isinstance(item, tuple) else item for item in failures.values())
        pending.extend([current.__cause__, current.__context__])
    existing = nearest_existing(save_dir)
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        return STORAGE_ERRNOS[errno.EROFS]
    if needed_bytes is not None and shutil.disk_usage(existing).free < needed_bytes:
        return STORAGE_ERRNOS[errno.ENOSPC]
    return None


def storage_error(*, step: int, save_dir: Path, problem: str, needed_bytes: int | None,
                  previous: Path | None) -> CheckpointStorageError:
    """The one-line error of a save that failed on ``problem`` (its partial folder already removed)."""
    needed = f" (it needs about {_size(needed_bytes)}, {_size(shutil.disk_usage(nearest_existing(save_dir)).free)} " \
             "free now)" if needed_bytes else ""
    kept = (f"{previous.name} stays the newest complete checkpoint" if previous is not None
            else "no checkpoint was saved yet")
    return CheckpointStorageError(
        f"saving step {step} into {save_dir} failed: {problem}{needed}; the partial save was removed and {kept}. "
        f"Free space there (or pass another --save) and run the same command to resume "
        f"(exit code {STORAGE_EXIT_CODE})")
