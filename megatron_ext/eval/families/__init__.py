"""The registry of task families: ``FAMILIES``, ``task.json``'s ``family`` -> its
:class:`~megatron_ext.eval.family.Family` (in the reports' order), and ``PAPER_FAMILIES``, the
paper's four (reports show any other, STS, apart and out of the average).

Each family lives in one module that defines its ``FAMILY`` (schema, run, defaults, shared-training
rule, leak check, metric, title): sequence classification (:mod:`.sc`), token classification
(:mod:`.tc`), question answering (:mod:`.qa`), retrieval (:mod:`.ir`) and zero-shot semantic
similarity (:mod:`.sts`, not one of the paper's). SC and TC share one run with a linear head
(:mod:`.linear_head`). The family modules are imported on the registry's first use (torch with
them); what only a run needs (sentence-transformers) is imported inside the run.
"""

from __future__ import annotations

import functools

from megatron_ext.config_loading import UserError
from megatron_ext.eval.family import Family


@functools.cache
def _registry() -> dict[str, Family]:
    # Imported on the registry's first use, not with the package: ``python -m
    # megatron_ext.eval.families.sts`` (the STS file converter) then runs a module the package has
    # not imported already, which runpy would warn about.
    from megatron_ext.eval.families import ir, qa, sc, sts, tc

    return {family.name: family for family in (sc.FAMILY, tc.FAMILY, qa.FAMILY, ir.FAMILY, sts.FAMILY)}


def __getattr__(name: str):
    if name == "FAMILIES":  # By name, in the order of the reports' tables.
        return _registry()
    if name == "PAPER_FAMILIES":  # The paper's families; reports show any other (STS) apart, out of the average.
        return tuple(key for key, family in _registry().items() if family.paper)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def family_of(name: str, *, task: str) -> Family:
    """The family named ``name`` (``task.json``'s ``family`` of ``task``); an unknown one is an error."""
    if name not in _registry():
        raise UserError(f"task {task!r} has family {name!r}, which the harness cannot fine-tune; "
                        f"families: {sorted(_registry())}")
    return _registry()[name]
