"""Training objectives, one module each: its typed settings and their checks, its name, how it
turns a dataset micro-batch into model inputs and loss targets, its attention direction, the LM
head's share of positions, and what makes two phases' steps the same (``base.Objective``).

A phase names its objective as a tagged mapping, ``objective: {name: mlm, mask_ratio: 0.4}``, or
in the flat form older recipes use, the settings beside the phase's own keys
(``{objective: mlm, mask_ratio: 0.4, share: 0.75}``); both read into the same settings
(:func:`read_objective`). Adding an objective is one module here plus its entry in
:data:`OBJECTIVES`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from megatron_ext.config_loading import ConfigError, build_dataclass
from megatron_ext.objectives.base import IGNORE_INDEX, Objective, ObjectiveBatch, PhaseProgress, Vocabulary
from megatron_ext.objectives.clm import CLM, apply_clm
from megatron_ext.objectives.mlm import MLM, MaskingConfig, apply_mlm
from megatron_ext.objectives.mntp import MNTP
from megatron_ext.objectives.span import SpanMLM
from megatron_ext.objectives.whole_word import WholeWordMLM

OBJECTIVES: dict[str, type[Objective]] = {cls.tag: cls for cls in (CLM, MLM, WholeWordMLM, SpanMLM, MNTP)}
"""Every objective by its YAML name (``Objective.tag``)."""

__all__ = ["CLM", "IGNORE_INDEX", "MLM", "MNTP", "OBJECTIVES", "MaskingConfig", "Objective", "ObjectiveBatch",
           "PhaseProgress", "SpanMLM", "Vocabulary", "WholeWordMLM", "apply_clm", "apply_mlm", "read_objective",
           "validation_objectives"]


def read_objective(value: Any, where: str, *, flat_settings: Mapping[str, Any] | None = None) -> Objective:
    """The objective of ``value``: a tagged mapping ``{name: <tag>, <setting>: ...}`` or, with
    ``flat_settings`` (the keys beside ``objective:`` in a flat phase), a tag alone. Flat settings
    that are null count as unset (``run_config.json`` files of older runs write them so)."""
    if isinstance(value, Objective):
        return value
    if isinstance(value, str):
        tag, settings = value, {k: v for k, v in (flat_settings or {}).items() if v is not None}
    elif isinstance(value, Mapping):
        if flat_settings:
            raise ConfigError(f"{where}: give the objective's settings inside objective: {{name: ...}} or beside "
                              f"it, not both; found {sorted(flat_settings)} beside it")
        if "name" not in value:
            raise ConfigError(f"{where}.objective: missing key 'name' (one of {sorted(OBJECTIVES)})")
        settings = dict(value)
        tag = settings.pop("name")
    else:
        raise ConfigError(f"{where}.objective: expected an objective name or a mapping {{name: ..., ...}}, "
                          f"got {value!r}")
    if tag not in OBJECTIVES:
        raise ConfigError(f"{where}.objective: unknown objective {tag!r}; expected one of {sorted(OBJECTIVES)}")
    return build_dataclass(OBJECTIVES[tag], settings, where if isinstance(value, str) else f"{where}.objective")


def validation_objectives(eval_mask_ratio: float, trained: Iterable[Objective] = ()) -> dict[str, Objective]:
    """What every validation pass measures, by its key in ``metrics.jsonl``: CLM, and MLM at the
    fixed ``training.eval_mask_ratio`` (so that runs of any objectives compare), and for each
    ``trained`` objective whose prediction is not at the mask (MNTP) its own loss at that ratio,
    keyed by its tag."""
    measured: dict[str, Objective] = {CLM.tag: CLM(), MLM.tag: MLM(mask_ratio=eval_mask_ratio)}
    for objective in trained:
        own = objective.validation_objective(eval_mask_ratio)
        if own is not None:
            measured.setdefault(objective.tag, own)
    return measured
