"""The registry of task families: :data:`FAMILIES`, ``task.json``'s ``family`` -> its
:class:`~megatron_ext.eval.family.Family`.

Each family lives in one module that defines its ``FAMILY`` (schema, run, defaults, shared-training
rule, leak check, metric, title): sequence classification (:mod:`.sc`), token classification
(:mod:`.tc`), question answering (:mod:`.qa`), retrieval (:mod:`.ir`) and zero-shot semantic
similarity (:mod:`.sts`, not one of the paper's). SC and TC share one run with a linear head
(:mod:`.linear_head`). Every family module comes with the registry (torch with them); what only
a run needs (sentence-transformers) is imported inside the run.
"""

from __future__ import annotations

from megatron_ext.config_loading import UserError
from megatron_ext.eval.families import ir, qa, sc, sts, tc
from megatron_ext.eval.family import Family

FAMILIES: dict[str, Family] = {family.name: family for family in (sc.FAMILY, tc.FAMILY, qa.FAMILY, ir.FAMILY,
                                                                  sts.FAMILY)}
"""By name, in the order of the reports' tables."""
PAPER_FAMILIES = tuple(name for name, family in FAMILIES.items() if family.paper)
"""The paper's families; reports show any other (STS) apart, as an extra not in the paper's average."""


def family_of(name: str, *, task: str) -> Family:
    """The family named ``name`` (``task.json``'s ``family`` of ``task``); an unknown one is an error."""
    if name not in FAMILIES:
        raise UserError(f"task {task!r} has family {name!r}, which the harness cannot fine-tune; "
                        f"families: {sorted(FAMILIES)}")
    return FAMILIES[name]
