"""The programs and launch scripts of the installed package that the launchers start."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from megatron_ext.config_loading import UserError

if TYPE_CHECKING:
    from megatron_ext.launch.job import Job

TRAINER = "megatron_ext.cli.pretrain_encoder"
"""The trainer's module, as the launchers start it (``python -m``, ``torchrun --module``)."""

SCRIPTS_DIR = Path(__file__).resolve().parent / "scripts"
"""The launch scripts, shipped with the package."""


def script(name: str) -> Path:
    """A launch script of the installed package (``slurm.sbatch``, ``single_node.sh``, ...)."""
    path = SCRIPTS_DIR / name
    if not path.is_file():
        known = ", ".join(sorted(p.name for p in SCRIPTS_DIR.iterdir() if not p.name.startswith(("_", "."))))
        raise UserError(f"{path}: no such launch script; the package's: {known}")
    return path


def program_args(job: Job) -> list[str]:
    """What follows the Python interpreter in the command of ``job``'s program (its arguments not
    included): its script's path, or ``-m`` and its module (of the installed package, or one
    importable in the job's working directory)."""
    if job.script is not None:
        return [str(job.script)]
    return ["-m", job.module]
