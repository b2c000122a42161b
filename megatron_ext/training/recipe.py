"""Reading a run's configuration: a YAML recipe (``base:`` recipes merged), the command line's
overrides with Megatron-LM's flag names, and the :class:`~megatron_ext.training.config.RunConfig`
they make (``training/config.py`` holds the dataclasses, one per concern). A key an earlier version
read is refused as unknown, naming where it went (``config_loading.MOVED_KEYS``)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
from pathlib import Path
from typing import Any

import yaml

from megatron_ext.checkpoint.config import CheckpointConfig
from megatron_ext.config_loading import ConfigError, add_dataclass_flags, build_dataclass, coerce, did_you_mean
from megatron_ext.model.config import PRESETS, VOCAB_FROM_TOKENIZER_PRESETS, EncoderModelConfig, padded_vocab_size
from megatron_ext.phases import Phase
from megatron_ext.schedule import LRScheduleConfig
from megatron_ext.tokenizer import TokenizerConfig
from megatron_ext.training.config import (SECTIONS, DataConfig, LoggingConfig, OptimizerConfig, ParallelConfig, RunConfig,
                                          TrainingConfig)

TOP_LEVEL_KEYS = (*SECTIONS, "phases", "base")
VOCAB_FROM_TOKENIZER = "from_tokenizer"
"""``model.vocab_size`` value: the tokenizer's size padded to a multiple of 128 x TP (Megatron)."""
# model.seq_length defaults to data.seq_length; Megatron calls the model-side guard this.
_FLAG_RENAMES = {("model", "seq_length"): "max_position_embeddings"}


def deep_merge(base: dict, override: dict) -> dict:
    """``override`` on top of ``base``, section by section (how ``base:`` recipes combine)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def read_recipe(path: str | Path) -> dict[str, Any]:
    """Load a YAML recipe, following ``base:`` links (relative to the file), deep-merged."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {str(path)!r}: no such file")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(TOP_LEVEL_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {unknown}{did_you_mean(unknown, TOP_LEVEL_KEYS)}; valid "
                          f"sections: {sorted(TOP_LEVEL_KEYS)}")
    if "base" in raw:
        base = read_recipe(path.parent / raw.pop("base"))
        raw = deep_merge(base, raw)
    return raw


def add_override_flags(parser: argparse.ArgumentParser) -> dict[str, tuple[str, str]]:
    """One flag per config field (Megatron-style names); returns ``{dest: (section, field)}``."""
    dests: dict[str, tuple[str, str]] = {}
    seen: dict[str, str] = {}
    for section, cls in SECTIONS.items():
        names = [f.name for f in dataclasses.fields(cls)]
        renamed = {n for n in names if (section, n) in _FLAG_RENAMES}
        skip = frozenset(renamed)
        for name in names:
            flag = _FLAG_RENAMES.get((section, name), name)
            if flag in seen:
                raise RuntimeError(f"config field {section}.{name} collides with {seen[flag]}.{flag}")
            seen[flag] = section
        dests.update(add_dataclass_flags(parser, section, cls, skip=skip))
        group = parser.add_argument_group(f"{section} (renamed)")
        for name in sorted(renamed):
            dest = f"{section}__{name}"
            group.add_argument("--" + _FLAG_RENAMES[(section, name)].replace("_", "-"), dest=dest, default=None)
            dests[dest] = (section, name)
    parser.add_argument("--model-preset", dest="model__preset", default=None, help=f"one of {sorted(PRESETS)}")
    dests["model__preset"] = ("model", "preset")
    parser.add_argument("--phases", dest="phases", default=None,
                        help="phase list as YAML, e.g. '[{objective: clm, share: 0.25}, "
                             "{objective: mlm, mask_ratio: 0.4, share: 0.75}]'")
    return dests


FIELD_DEFAULTS_SHOWN = {
    ("model", "seq_length"): "the longest seq_length of data and phases",
    ("model", "vocab_size"): f"{VOCAB_FROM_TOKENIZER} (the tokenizer's, padded to 128 x TP)",
}
"""Defaults a recipe gets from another key, not from the field's dataclass default (``_model_config``)."""


def field_defaults(dests: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """``{dest: the value a recipe that does not set the field gets}`` (``dataclasses.MISSING``:
    required), for ``--help``; flags that set no single field (``--phases``, ``--model-preset``) are left out."""
    found: dict[str, Any] = {}
    for dest, (section, name) in dests.items():
        fields = {f.name: f for f in dataclasses.fields(SECTIONS[section])}
        if name not in fields:
            continue
        field = fields[name]
        if (section, name) in FIELD_DEFAULTS_SHOWN:
            found[dest] = FIELD_DEFAULTS_SHOWN[section, name]
        elif field.default is not dataclasses.MISSING:
            found[dest] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            found[dest] = field.default_factory()
        else:
            found[dest] = dataclasses.MISSING
    return found


def apply_overrides(recipe: dict[str, Any], args: argparse.Namespace, dests: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """Recipe with every flag given on the command line written into its section."""
    out = copy.deepcopy(recipe)
    given: dict[tuple[str, str], str] = {}
    for dest, (section, name) in dests.items():
        value = getattr(args, dest, None)
        if value is not None:
            if (section, name) in given:
                flags = sorted("--" + d.split("__", 1)[1].replace("_", "-") for d in (given[(section, name)], dest))
                raise ConfigError(f"{' and '.join(flags)} both set {section}.{name}; give one")
            given[(section, name)] = dest
            out.setdefault(section, {})[name] = value
    if getattr(args, "phases", None) is not None:
        try:
            out["phases"] = yaml.safe_load(args.phases)
        except yaml.YAMLError as err:
            raise ConfigError(f"--phases: invalid YAML: {err}") from err
    return out


def _model_config(section: dict[str, Any], *, data_seq_length: int, tokenizer_vocab_size: int | None, tp: int) -> EncoderModelConfig:
    section = dict(section)
    preset_name = section.pop("preset", None)
    if preset_name is not None:
        if preset_name not in PRESETS:
            raise ConfigError(f"model.preset: unknown preset {preset_name!r}; expected one of {sorted(PRESETS)}")
        base = {f.name: getattr(PRESETS[preset_name], f.name) for f in dataclasses.fields(EncoderModelConfig)}
        if "seq_length" not in section:
            base.pop("seq_length")
        if preset_name in VOCAB_FROM_TOKENIZER_PRESETS:  # its vocab_size is a placeholder
            base.pop("vocab_size")
        section = {**base, **section}
    section.setdefault("seq_length", data_seq_length)
    section.setdefault("vocab_size", VOCAB_FROM_TOKENIZER)
    if section["vocab_size"] == VOCAB_FROM_TOKENIZER:
        if tokenizer_vocab_size is None:
            raise ConfigError("model.vocab_size: from_tokenizer needs the tokenizer to be loadable")
        section["vocab_size"] = padded_vocab_size(tokenizer_vocab_size, tp)
    return build_dataclass(EncoderModelConfig, section, "model")


def run_config_from_dict(raw: dict[str, Any], *, tokenizer_vocab_size: int | None = None) -> RunConfig:
    """Validate a merged recipe into a :class:`RunConfig` (errors name the section and key)."""
    missing = [s for s in ("model", "tokenizer", "data", "phases", "training") if s not in raw]
    if missing:
        raise ConfigError(f"recipe: missing section(s) {missing}")
    sections = {name: raw.get(name, {}) or {} for name in SECTIONS}
    data = build_dataclass(DataConfig, sections["data"], "data")
    parallel = build_dataclass(ParallelConfig, sections["parallel"], "parallel")
    if not isinstance(raw["phases"], list) or not raw["phases"]:
        raise ConfigError("phases: expected a non-empty list of phases")
    phases = tuple(coerce(p, Phase, f"phases[{i}]") for i, p in enumerate(raw["phases"]))
    longest = max([data.seq_length, *(p.seq_length for p in phases if p.seq_length is not None)])
    return RunConfig(
        model=_model_config(sections["model"], data_seq_length=longest,
                            tokenizer_vocab_size=tokenizer_vocab_size, tp=parallel.tensor_model_parallel_size),
        tokenizer=build_dataclass(TokenizerConfig, sections["tokenizer"], "tokenizer"),
        data=data,
        optimizer=build_dataclass(OptimizerConfig, sections["optimizer"], "optimizer"),
        schedule=build_dataclass(LRScheduleConfig, sections["schedule"], "schedule"),
        phases=phases,
        training=build_dataclass(TrainingConfig, sections["training"], "training"),
        parallel=parallel,
        checkpoint=build_dataclass(CheckpointConfig, sections["checkpoint"], "checkpoint"),
        logging=build_dataclass(LoggingConfig, sections["logging"], "logging"),
    )


def needs_tokenizer_vocab(raw: dict[str, Any]) -> bool:
    """True when ``model.vocab_size`` must be read from the tokenizer."""
    model = raw.get("model") or {}
    if "vocab_size" in model:
        return model["vocab_size"] == VOCAB_FROM_TOKENIZER
    # Presets carry their vocab size, but for those where it is a placeholder.
    return model.get("preset") is None or model.get("preset") in VOCAB_FROM_TOKENIZER_PRESETS
