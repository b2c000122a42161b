"""What a built evaluation task looks like on disk, and its reader: all a task family's run needs.

A task directory holds one ``<split>.jsonl`` per split (:data:`SPLITS`, plus ``corpus`` for IR)
whose rows have their family's columns (:data:`COLUMNS`, docs/eval_suite.md), and usually a
``task.json`` (:data:`TASK_FILE`) naming the family, metric and labels. :func:`load_task` reads the
suite's tasks by name and local copies of the paper's datasets converted to the same schema.

The builders of the suite's own tasks live in :mod:`megatron_ext.eval.suite`; this module imports
none of them, so fine-tuning (:mod:`megatron_ext.eval.families`) does not pull in their
dependencies (mwparserfromhell, nltk).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from megatron_ext.config_loading import UserError
from megatron_ext import assets

Family = Literal["sc", "tc", "qa", "ir", "sts"]

COLUMNS: dict[str, tuple[str, ...]] = {
    "sc": ("id", "text", "label"),
    "tc": ("id", "tokens", "tags"),
    "qa": ("id", "context", "question", "answers"),
    "ir": ("id", "query", "relevance"),
    "sts": ("id", "text", "text_pair", "score"),
}
"""Columns every row of a family's splits must have (docs/eval_suite.md), except as below."""
IR_TRAIN_COLUMNS = ("id", "query", "positive")
"""IR training needs (query, positive passage) pairs only, like MS MARCO's; validation and test
need graded ``relevance`` for NDCG@10."""
CORPUS_COLUMNS = ("id", "text")
"""Columns of an IR task's ``corpus`` split."""
SPLITS = ("train", "validation", "test")
"""The splits every task has (IR adds ``corpus``; a test-only task has just ``test``)."""
TASK_FILE = "task.json"
"""The task's metadata file: family, metric, labels, per-split sizes and hashes, sources."""
SUITE_TASKS = ("rt_sentiment", "wiki_mentions", "news_cloze", "news_cloze_v2", "wiki_sections", "lee_sts")
"""Names of the tasks :mod:`megatron_ext.eval.suite` builds (its ``TASKS``, in order); listed here so
that loading a task by name needs no builder."""


def default_suite_dir() -> Path:
    """Where ``tools/build_eval_suite.py`` writes by default: ``<data dir>/eval_suite``."""
    return assets.data_dir() / "eval_suite"


def required_columns(family: Family, split: str) -> tuple[str, ...]:
    """Columns :func:`load_task` requires in ``split`` of a ``family`` task."""
    if split == "corpus":
        return CORPUS_COLUMNS
    return IR_TRAIN_COLUMNS if family == "ir" and split == "train" else COLUMNS[family]


def load_task(name_or_dir: str | Path, split: str, *, column_map: Mapping[str, str] | None = None,
              family: Family | None = None, suite_dir: str | Path | None = None) -> list[dict]:
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
    if family not in COLUMNS:
        raise UserError(
            f"{task_dir} has no {TASK_FILE}: pass family= one of {list(COLUMNS)}, got {family!r}"
        )
    path = task_dir / f"{split}.jsonl"
    if not path.exists():
        present = sorted(p.stem for p in task_dir.glob("*.jsonl"))
        raise UserError(f"split {split!r} not found in {task_dir}; present splits: {present}")
    required = required_columns(family, split)
    column_map = dict(column_map or {})
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{path} line {line_no}: not JSON ({err})") from None
            unmapped = [c for c in column_map if c not in raw]
            if unmapped:
                raise UserError(f"{path} line {line_no}: column_map names columns {unmapped} that the "
                                f"row lacks; it has {sorted(raw)}")
            row = {column_map.get(k, k): v for k, v in raw.items()}
            missing = [c for c in required if c not in row]
            if missing:
                raise UserError(f"{path} line {line_no}: missing column(s) {missing} required for family "
                                f"{family!r} split {split!r}; the row has {sorted(row)} "
                                f"(rename columns with column_map)")
            rows.append(row)
    return rows
