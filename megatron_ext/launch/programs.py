"""The programs and launch scripts of the installed package that the launchers start."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_ext.config_loading import UserError

if TYPE_CHECKING:
    from megatron_ext.launch.job import Job

SCRIPTS_DIR = Path(__file__).resolve().parent / "scripts"
"""The launch scripts, shipped with the package."""


def script(name: str) -> Path:
    """A launch script of the installed package (``slurm.sbatch``, ``single_node.sh``, ...)."""
    path = SCRIPTS_DIR / name
    if not path.is_file():
        known = ", ".join(sorted(p.name for p in SCRIPTS_DIR.iterdir() if not p.name.startswith(("_", "."))))
        raise UserError(f"{path}: no such launch script; the package's: {known}")
    return path


def program(module: str, python: str | None = None) -> list[str]:
    """The command that runs ``module`` of the installed package: a top-level module by its file
    (``python .../pretrain_encoder.py``), a package's as ``python -m`` (its folder must not shadow
    other modules on ``sys.path``)."""
    python = python or sys.executable
    if "." in module:
        return [python, "-m", module]
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise UserError(f"{module}: not importable from {python}; install the package (pip install .)")
    return [python, spec.origin]


def program_args(job: Job) -> list[str]:
    """What follows the Python interpreter in the command of ``job``'s program (its arguments not
    included): its script's path, or its module as :func:`program` runs it."""
    if job.script is not None:
        return [str(job.script)]
    return program(job.module)[1:]
