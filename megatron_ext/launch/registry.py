"""The launchers by name: adding one is a module that defines ``LAUNCHER`` and a line in :data:`LAUNCHERS`."""

from __future__ import annotations

import importlib

from megatron_ext.config_loading import UserError

LAUNCHERS: dict[str, str] = {
    "local": "megatron_ext.launch.local",
    "slurm": "megatron_ext.launch.slurm",
}
"""Launcher name -> the module that defines it as ``LAUNCHER`` (a ``launch.job.Launcher``)."""


def launcher_class(name: str) -> type:
    if name not in LAUNCHERS:
        raise UserError(f"--launcher: no launcher named {name!r}; the launchers: {', '.join(LAUNCHERS)}")
    return importlib.import_module(LAUNCHERS[name]).LAUNCHER
