"""What a task of the suite is (:class:`TaskSpec`) and what its builder produces (:class:`TaskData`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_ext.eval.families import FAMILIES

VALIDATION_FRACTION = 0.05
"""Share of the training documents held out for validation (the paper's 95/5)."""


@dataclass(kw_only=True)
class TaskData:
    """What a task builder produces before the split assignment."""

    documents: list[str]
    """Every source document (split unit) of the raw data, whether or not it yields rows: the
    split assignment ranks this whole set, so tasks over the same documents split them alike."""
    examples: list[tuple[str, dict]]
    """(source document, row) pairs; the document decides the split, so none straddles two."""
    stats: Callable[[list[dict]], dict]
    """Summary of one split's rows for ``task.json`` (class balance, mention counts, ...)."""
    corpus: list[dict] | None = None
    """IR only: the passages every split's ``relevance`` points into."""
    notes: dict = field(default_factory=dict)
    """Build-wide counts for ``task.json`` (duplicates dropped, filters, ...)."""


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """One task of the suite."""

    name: str
    """Directory name and key in :data:`TASKS`."""
    family: str
    """Key of :data:`~megatron_ext.eval.families.FAMILIES`: the rows' schema, the run that scores
    the task and what its test split must not share with training."""
    metric: str
    """What the paper reports for this family: accuracy, entity-level F1, SQuAD F1, NDCG@10."""
    labels: tuple[str, ...]
    """SC: class names, index = ``label``; TC: the tag set; empty otherwise."""
    description: str
    """One line for reports."""
    sources: tuple[tuple[str, str], ...]
    """(asset name, member path) of every raw file used."""
    license: str
    construction: str
    """How the task was built and why, for ``task.json`` and docs/eval_suite.md."""
    test_fraction: float
    """Share of source documents held out as the test split (0 = no split, everything is test)."""
    split_key: str
    """Salt of the document hash that assigns splits; tasks over the same documents share it so a
    document is a test document in all of them."""
    build: Callable[[], TaskData]

    @property
    def splits(self) -> tuple[str, ...]:
        return FAMILIES[self.family].schema.splits(test_only=self.test_fraction == 0)
