"""The launch layer: every job of a study (a training segment, an evaluation grid) goes through one
:class:`Launcher` interface, implemented once per scheduler.

- :mod:`megatron_ext.launch.job`: :class:`Job`, :class:`Resources`, :class:`JobState`, :class:`Launcher`.
- :mod:`megatron_ext.launch.local`: this machine, one job at a time (torchrun for several processes).
- :mod:`megatron_ext.launch.slurm`: SLURM batch jobs (dependencies, arrays, requeue).
- ``scripts/``: the launch scripts the launchers start (``examples/launch/`` shows the same files);
  ``python -m megatron_ext.launch script NAME`` prints where one is installed.

Adding a launcher: one module defining a :class:`Launcher` subclass as ``LAUNCHER``, and one line
in :data:`LAUNCHERS`. Its name is then a ``--launcher`` choice of ``run_study`` and a key of a
study's ``resources:`` (its extra flags).
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from megatron_ext.config_loading import ConfigError, UserError, coerce
from megatron_ext.launch.job import Job, JobEvents, JobState, Launcher, Resources

__all__ = ["LAUNCHERS", "Job", "JobEvents", "JobState", "Launcher", "Resources", "launcher_class", "program",
           "read_legacy_keys", "script"]

LAUNCHERS: dict[str, str] = {
    "local": "megatron_ext.launch.local",
    "slurm": "megatron_ext.launch.slurm",
}
"""Launcher name -> the module that defines it as ``LAUNCHER``."""

SCRIPTS_DIR = Path(__file__).resolve().parent / "scripts"
"""The launch scripts, shipped with the package."""


def launcher_class(name: str) -> type[Launcher]:
    if name not in LAUNCHERS:
        raise UserError(f"--launcher: no launcher named {name!r}; the launchers: {', '.join(LAUNCHERS)}")
    return importlib.import_module(LAUNCHERS[name]).LAUNCHER


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


_NOTICED: set[str] = set()


def read_legacy_keys(raw: Any, path: Path, *, sections: tuple[str, ...]) -> Any:
    """``raw`` (a study file's mapping) with each launcher's older key for its extra flags (its
    ``legacy_key``) moved to ``resources.<launcher>`` in each of ``sections`` (``""``: the top,
    ``sizes[*]``: every item of a list); one notice on stderr names the file and the keys."""
    if not isinstance(raw, dict):
        return raw
    raw = copy.deepcopy(raw)
    moved: list[str] = []

    def move(mapping: Any, where: str) -> None:
        if not isinstance(mapping, dict):
            return
        for name in LAUNCHERS:
            launcher = launcher_class(name)
            key = launcher.legacy_key
            if key is None or key not in mapping:
                continue
            flags = coerce(mapping.pop(key), tuple[str, ...], f"{where}{key}")
            try:
                launcher.check_extras(flags, f"{where}{key}")
            except ValueError as err:
                raise ConfigError(str(err)) from None
            resources = mapping.setdefault("resources", {})
            if not isinstance(resources, dict) or name in resources:
                raise ConfigError(f"{where}{key}: give the {name} launcher's flags once, as {where}resources.{name}")
            resources[name] = list(flags)
            moved.append(f"{where}{key}")

    for section in sections:
        if section == "":
            move(raw, "study.")
        elif section.endswith("[*]"):
            items = raw.get(section[:-3])
            for index, item in enumerate(items if isinstance(items, list) else []):
                move(item, f"study.{section[:-3]}[{index}].")
        else:
            move(raw.get(section), f"study.{section}.")
    if moved and str(path) not in _NOTICED:
        _NOTICED.add(str(path))
        names = ", ".join(moved)
        print(f"notice: {path}: {names}: the older form of resources.<launcher> (e.g. resources: {{slurm: "
              "[--partition=gpu]}); read as such", file=sys.stderr, flush=True)
    return raw
