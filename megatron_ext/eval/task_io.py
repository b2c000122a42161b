"""Loading a built evaluation task by name or directory: :func:`load_task`.

A task directory holds one ``<split>.jsonl`` per split (:data:`SPLITS`, plus ``corpus`` for IR)
whose rows have their family's columns (each family's :class:`~megatron_ext.eval.family.TaskSchema`,
docs/eval_suite.md), and usually a ``task.json`` (:data:`TASK_FILE`) naming the family, metric and
labels. :func:`load_task` reads the suite's tasks by name and local copies of the paper's datasets
converted to the same schema; a family's own run reads its splits with its schema directly.

The builders of the suite's own tasks live in :mod:`megatron_ext.eval.suite`; this module imports
none of them, so loading a task does not pull in their dependencies (mwparserfromhell, nltk).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from megatron_ext.config_loading import UserError
from megatron_ext import assets
from megatron_ext.eval.families import FAMILIES
from megatron_ext.eval.family import SPLITS, TASK_FILE

SUITE_TASKS = ("rt_sentiment", "wiki_mentions", "news_cloze", "news_cloze_v2", "wiki_sections", "lee_sts")
"""Names of the tasks :mod:`megatron_ext.eval.suite` builds (its ``TASKS``, in order); listed here so
that loading a task by name needs no builder."""
__all__ = ["SPLITS", "SUITE_TASKS", "TASK_FILE", "default_suite_dir", "load_task"]


def default_suite_dir() -> Path:
    """Where ``tools/build_eval_suite.py`` writes by default: ``<data dir>/eval_suite``."""
    return assets.data_dir() / "eval_suite"


def load_task(name_or_dir: str | Path, split: str, *, column_map: Mapping[str, str] | None = None,
              family: str | None = None, suite_dir: str | Path | None = None) -> list[dict]:
    """Rows of one split of a built task, or of a local dataset in the same per-family schema.

    ``name_or_dir`` is a name in :data:`SUITE_TASKS` (read from ``suite_dir``, default
    :func:`default_suite_dir`) or a directory holding ``<split>.jsonl`` files. ``column_map`` renames
    columns of every row first (``{"sentence": "text"}`` for a GLUE SST-2 copy). ``family`` says
    which columns to require for a directory without a ``task.json``.
    """
    if isinstance(name_or_dir, str) and name_or_dir in SUITE_TASKS:
        task_dir = Path(suite_dir if suite_dir is not None else default_suite_dir()) / name_or_dir
        if not (task_dir / TASK_FILE).exists():
            raise UserError(
                f"task {name_or_dir!r} is not built in {task_dir.parent}; run "
                f"tools/build_eval_suite.py --tasks {name_or_dir} --output-dir {task_dir.parent}"
            )
    elif Path(name_or_dir).is_dir():
        task_dir = Path(name_or_dir)
    else:
        raise UserError(
            f"unknown task {str(name_or_dir)!r}: not one of {sorted(SUITE_TASKS)} and not a directory"
        )
    if (task_dir / TASK_FILE).exists():
        built_family = json.loads((task_dir / TASK_FILE).read_text(encoding="utf-8"))["family"]
        if family is not None and family != built_family:
            raise UserError(f"family={family!r} contradicts {task_dir / TASK_FILE}: {built_family!r}")
        family = built_family
    if family not in FAMILIES:
        raise UserError(
            f"{task_dir} has no {TASK_FILE}: pass family= one of {list(FAMILIES)}, got {family!r}"
        )
    return FAMILIES[family].schema.read(task_dir, split, column_map=column_map)
