"""A classification task of one's own, with no other file: a folder of ``train``, ``validation``
and ``test`` files, each CSV (``.csv``, with a header row) or JSONL (``.jsonl``), whose rows have a
``text`` (and, for pairs, a ``text_pair``) and a ``label`` column, an ``id`` column optional.

:func:`build_own_task` converts such a folder into a built task of the ``sc`` family (the schema of
``docs/eval_suite.md``: ``<split>.jsonl`` rows ``{id, text[, text_pair], label}`` with integer
labels, and a ``task.json``) under ``<suite dir>/own/<folder name>``, which the harness then runs
like any task. Labels that are all integers are class indices (names ``0..max``); otherwise they
are class names, sorted and numbered, the mapping recorded in ``task.json`` (``labels`` in index
order, and ``label_map``). The conversion is redone whenever it is asked for and rewrites only what
changed (each file written whole, ``task.json`` last), so edits to the folder are picked up.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

from megatron_ext.config_loading import UserError
from megatron_ext.eval.family import SPLITS, TASK_FILE
from megatron_ext.fileio import write_files

SUFFIXES = (".jsonl", ".csv")
"""The formats a split file may have."""

_INTEGER = re.compile(r"^-?\d+$")


def own_task_files(folder: Path) -> dict[str, Path] | None:
    """``split -> file`` of a task-of-one's-own folder; None when it holds no split file at all; a
    ``UserError`` naming what is missing or ambiguous otherwise."""
    found: dict[str, Path] = {}
    for split in SPLITS:
        candidates = [folder / f"{split}{suffix}" for suffix in SUFFIXES if (folder / f"{split}{suffix}").is_file()]
        if len(candidates) > 1:
            raise UserError(f"{folder}: both {candidates[0].name} and {candidates[1].name}; keep one per split")
        if candidates:
            found[split] = candidates[0]
    if not found:
        return None
    missing = [split for split in SPLITS if split not in found]
    if missing:
        raise UserError(f"{folder}: a task of your own needs {', '.join(f'{s}.jsonl or {s}.csv' for s in missing)} "
                        f"beside {', '.join(p.name for p in found.values())}")
    return found


def _read_rows(path: Path) -> list[tuple[str, dict]]:
    """``(location, row)`` of a CSV or JSONL split file."""
    rows = []
    if path.suffix == ".csv":
        with open(path, encoding="utf-8", newline="") as handle:
            reader = csv.DictReader(handle)
            for row in reader:
                rows.append((f"{path}:{reader.line_num}", dict(row)))
        return rows
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{path}:{line_no}: invalid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}")
            rows.append((f"{path}:{line_no}", row))
    return rows


def _is_integer(label) -> bool:
    return (isinstance(label, int) and not isinstance(label, bool)) or (isinstance(label, str) and
                                                                        bool(_INTEGER.match(label.strip())))


def build_own_task(folder: Path, suite_dir: Path) -> Path | None:
    """The built ``sc`` task made from ``folder`` (module docstring), under ``suite_dir/own``; None
    when ``folder`` holds no split file (it is not such a task)."""
    files = own_task_files(folder)
    if files is None:
        return None
    read = {split: _read_rows(path) for split, path in files.items()}
    pairs = None
    for split, rows in read.items():
        if not rows:
            raise UserError(f"{files[split]}: no rows")
        for where, row in rows:
            missing = [column for column in ("text", "label") if row.get(column) in (None, "")]
            if missing:
                raise UserError(f"{where}: column(s) {missing} missing or empty; columns present: {sorted(row)}")
            if pairs is None:
                pairs = "text_pair" in row
            elif pairs != ("text_pair" in row):
                raise UserError(f"{where}: {'no' if pairs else 'a'} text_pair, unlike the rows before it; "
                                "a task is of single texts or of pairs throughout")
    labels = [row["label"] for rows in read.values() for _, row in rows]
    by_index = all(_is_integer(label) for label in labels)
    if by_index:
        names = [str(i) for i in range(max(int(label) for label in labels) + 1)]
        if min(int(label) for label in labels) < 0:
            raise UserError(f"{folder}: negative label {min(int(label) for label in labels)}; integer labels are "
                            "class indices from 0")
        index = {name: i for i, name in enumerate(names)}
    else:
        names = sorted({str(label) for label in labels})
        index = {name: i for i, name in enumerate(names)}
    files_out: dict[Path, bytes] = {}
    task_dir = suite_dir / "own" / folder.resolve().name
    counts = {}
    for split, rows in read.items():
        lines = []
        for i, (_, row) in enumerate(rows):
            out = {"id": str(row.get("id") or f"{split}-{i}"), "text": str(row["text"])}
            if pairs:
                out["text_pair"] = str(row["text_pair"])
            out["label"] = index[str(int(row["label"]))] if by_index else index[str(row["label"])]
            lines.append(json.dumps(out, ensure_ascii=False) + "\n")
        files_out[task_dir / f"{split}.jsonl"] = "".join(lines).encode("utf-8")
        counts[split] = len(rows)
    meta = {"family": "sc", "metric": "accuracy", "labels": names, "source": str(folder.resolve()),
            "made_from": {split: path.name for split, path in files.items()}, "rows": counts,
            **({} if by_index else {"label_map": index})}
    files_out[task_dir / TASK_FILE] = (json.dumps(meta, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    task_dir.mkdir(parents=True, exist_ok=True)
    write_files(files_out, overwrite=True)  # task.json last: it vouches for the splits
    return task_dir
