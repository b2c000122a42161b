"""What a task family is: :class:`Family`, one per module of :mod:`megatron_ext.eval.families`.

A family (``task.json``'s ``family``: ``sc``, ``tc``, ``qa``, ``ir``, ``sts``) owns everything the
rest of the evaluation asks about its tasks: the columns of their rows (:class:`TaskSchema`), the
run that fine-tunes and scores a model on one, the config defaults of that run, which tasks share
one training, what must not leak from the test split into training when a task is built, the
metric, and the family's title in reports. The harness, the suite builder, the benchmark converter
and the study report read these fields and know no family by name; adding a family is one module
that defines a ``FAMILY`` plus its line in the registry (docs/eval_suite.md, "Adding a family").

This module sits below the family modules and imports none of them, so each can describe itself
with it; :mod:`megatron_ext.eval.families` is the registry.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_ext.config_loading import UserError

if TYPE_CHECKING:
    from megatron_ext.eval.finetuning import FinetuneConfig, RunResult

SPLITS = ("train", "validation", "test")
"""The splits every task has (IR adds ``corpus``; a test-only task has just ``test``)."""
TASK_FILE = "task.json"
"""The task's metadata file: family, metric, labels, per-split sizes and hashes, sources."""
CORPUS_COLUMNS = ("id", "text")
"""Columns of a retrieval task's ``corpus`` split."""
ZERO_SHOT_LR = 0.0
"""The LR of a zero-shot run: nothing is trained (``lr0_seed0.json`` under ``runs/``)."""
ZERO_SHOT_SEED = 0


@dataclass(frozen=True, kw_only=True)
class TaskSchema:
    """The columns every row of a family's splits must have (docs/eval_suite.md), and its reader."""

    family: str
    """The family's name: ``task.json``'s ``family``, the key of the registry."""
    columns: tuple[str, ...]
    """Columns of every split's rows, except as below."""
    train_columns: tuple[str, ...] | None = None
    """Columns of the train split when they differ (retrieval trains on (query, positive) pairs,
    like MS MARCO's; its validation and test need graded ``relevance``)."""
    corpus: bool = False
    """Whether tasks have a ``corpus`` split (:data:`CORPUS_COLUMNS`) besides :data:`SPLITS`."""

    def required(self, split: str) -> tuple[str, ...]:
        """Columns required in ``split``."""
        if split == "corpus":
            return CORPUS_COLUMNS
        return self.train_columns if split == "train" and self.train_columns else self.columns

    def splits(self, test_only: bool = False) -> tuple[str, ...]:
        """The split files of a task: :data:`SPLITS` (``test`` alone for a test-only task), and ``corpus``."""
        return (*(("test",) if test_only else SPLITS), *(("corpus",) if self.corpus else ()))

    def read(self, task_dir: Path, split: str, *, column_map: Mapping[str, str] | None = None) -> list[dict]:
        """Rows of ``task_dir/<split>.jsonl``, renamed by ``column_map`` (every mapped column must
        exist), each checked for the columns :meth:`required` names."""
        path = Path(task_dir) / f"{split}.jsonl"
        if not path.exists():
            present = sorted(p.stem for p in Path(task_dir).glob("*.jsonl"))
            raise UserError(f"split {split!r} not found in {task_dir}; present splits: {present}")
        required = self.required(split)
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
                                    f"{self.family!r} split {split!r}; the row has {sorted(row)} "
                                    f"(rename columns with column_map)")
                rows.append(row)
        return rows


FamilyRun = Callable[[str, Path, "FinetuneConfig"], "RunResult"]
"""``run(model_dir, task_dir, config)``: fine-tune (or not, zero-shot) and score one task."""
SharedRun = Callable[[Sequence[Path], str, "FinetuneConfig"], "list[RunResult]"]
"""``run_shared(task_dirs, model_dir, config)``: one training scored on each of several tasks."""


@dataclass(frozen=True, kw_only=True)
class Family:
    """One task family: its schema, run, defaults, shared-training rule, leak check, metric and title."""

    schema: TaskSchema
    title: str
    """Its name in reports ("sequence classification"); the registry's order is the tables' order."""
    paper: bool
    """One of the paper's four families, averaged in the reports; others (STS) are shown apart as extras."""
    metric: str
    """The key of the score its runs report (``accuracy``, ``f1``, ``ndcg@10``, ``spearman``)."""
    run: FamilyRun
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """FinetuneConfig values its runs use unless the caller sets the length of the run (the paper
    trains token classification for one epoch, everything else for ``max_steps``)."""
    zero_shot: bool = False
    """Its run trains nothing: an LR or a seed would change nothing, so each (model, task) is one
    run at :data:`ZERO_SHOT_LR` and :data:`ZERO_SHOT_SEED` (:meth:`grid`), reported as it is."""
    score_note: str = ""
    """What its scores are, where reports print them beside the paper's (zero-shot families)."""
    leak_key: Callable[[dict], str] | None = None
    """What a built task's test rows must not share with its train and validation rows, beyond
    their documents (:mod:`megatron_ext.eval.suite`); None: nothing beyond the documents."""
    training_key: Callable[[Path], str] | None = None
    """Tasks whose keys are equal train one model for all of them (retrieval: the paper trains on
    MS MARCO pairs once and evaluates MS MARCO, NQ and MLDR) through :attr:`run_shared`; None: a
    training per task."""
    run_shared: SharedRun | None = None
    splits_scored: Callable[[Path], tuple[str, ...]] | None = None
    """The splits a run reads, when they depend on the task (STS: test, and validation if present);
    None: :meth:`TaskSchema.splits`."""

    def __post_init__(self) -> None:
        if (self.training_key is None) != (self.run_shared is None):
            raise ValueError(f"family {self.name!r}: training_key and run_shared come together (tasks with "
                             "equal keys are run through run_shared)")
        if self.zero_shot and not self.score_note:
            raise ValueError(f"family {self.name!r}: a zero-shot family says what its scores are (score_note)")

    @property
    def name(self) -> str:
        return self.schema.family

    def grid(self, lrs: Sequence[float], seeds: Sequence[int]) -> tuple[tuple[float, ...], tuple[int, ...]]:
        """The (LRs, seeds) its tasks run at: the grid's, or one zero-shot run."""
        if self.zero_shot:
            return (ZERO_SHOT_LR,), (ZERO_SHOT_SEED,)
        return tuple(lrs), tuple(seeds)

    def splits_read(self, task_dir: Path) -> tuple[str, ...]:
        """The splits a run reads from ``task_dir`` (the harness loads them all before any run, so a
        schema error stops the grid before it starts)."""
        return self.splits_scored(task_dir) if self.splits_scored is not None else self.schema.splits()

    def shared_training_key(self, task_dir: Path) -> str | None:
        """Tasks with equal keys share one training per LR and seed; None for a family that trains per task."""
        return None if self.training_key is None else self.training_key(task_dir)
