"""The launchers by name: adding one is a module that defines ``LAUNCHER`` and a line in :data:`LAUNCHERS`."""

from __future__ import annotations

import copy
import importlib
import sys
from pathlib import Path
from typing import Any

from megatron_ext.config_loading import ConfigError, UserError, coerce

LAUNCHERS: dict[str, str] = {
    "local": "megatron_ext.launch.local",
    "slurm": "megatron_ext.launch.slurm",
}
"""Launcher name -> the module that defines it as ``LAUNCHER`` (a ``launch.job.Launcher``)."""


def launcher_class(name: str) -> type:
    if name not in LAUNCHERS:
        raise UserError(f"--launcher: no launcher named {name!r}; the launchers: {', '.join(LAUNCHERS)}")
    return importlib.import_module(LAUNCHERS[name]).LAUNCHER


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
