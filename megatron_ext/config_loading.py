"""Typed configuration from YAML recipes plus Megatron-style command-line overrides.

A recipe is a YAML mapping of sections; each section is one kw-only dataclass (one concern), e.g.
``data:`` -> :class:`megatron_ext.training.config.DataConfig`. Every dataclass field also gets a
command-line flag named like Megatron-LM's (``micro_batch_size`` -> ``--micro-batch-size``), so
``--lr 3e-4 --train-iters 100`` override the recipe. Unknown keys are errors that list the valid
ones; values are converted to the field's declared type or rejected naming the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, get_args, get_origin, get_type_hints


class UserError(ValueError):
    """Bad input from the user (a recipe, data files, a checkpoint, a path): the message names the
    file, key or flag and what was expected. Entry points print it as one line and exit with 2;
    any other exception is a bug and keeps its traceback."""


class ConfigError(UserError):
    """A recipe or override is invalid; the message names the key and what was expected."""


def _field_types(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def coerce(value: Any, annotation: Any, where: str) -> Any:
    """Convert a YAML / command-line value to ``annotation`` or raise :class:`ConfigError`."""
    origin = get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return coerce(value, option, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} matches none of {annotation}")
    if origin is Literal:
        choices = get_args(annotation)
        if value not in choices:
            raise ConfigError(f"{where}: expected one of {list(choices)}, got {value!r}")
        return value
    if origin in (tuple, list):
        if isinstance(value, str):
            value = value.split()
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        inner = get_args(annotation)[0] if get_args(annotation) else Any
        items = [coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if annotation is Any:
        return value
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if annotation is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                try:
                    as_float = float(value)  # "1e3"
                except ValueError:
                    pass
                else:
                    if as_float.is_integer():
                        return int(as_float)
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # PyYAML reads "5e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if annotation is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):  # already typed (a tagged union read by its owner)
            return value
        if hasattr(annotation, "from_config"):  # a class that reads its own YAML forms
            return annotation.from_config(value, where)
        return build_dataclass(annotation, value, where)
    if isinstance(annotation, type) and hasattr(annotation, "parse"):  # a value type that checks itself
        return annotation.parse(value, where)
    raise ConfigError(f"{where}: unsupported field type {annotation}")


def did_you_mean(unknown: list[str], valid) -> str:
    """``" (did you mean 'x'?)"`` for the unknown names that are near misses of a valid one (a typo,
    a Megatron-LM spelling); empty when none is."""
    import difflib

    guesses = [f"{name!r} -> {close[0]!r}" if len(unknown) > 1 else repr(close[0])
               for name in unknown if (close := difflib.get_close_matches(str(name), [str(v) for v in valid], n=1,
                                                                         cutoff=0.75))]
    return f" (did you mean {', '.join(guesses)}?)" if guesses else ""


MOVED_KEYS: dict[str, str] = {
    "model.document_mask": "data.reset_attention_mask (and data.reset_position_ids to restart RoPE per document)",
    "model.eod_token_id": "data.reset_attention_mask, which reads the tokenizer's end-of-document token",
    "model.attention_backend": "model.transformer_impl",
    "phases[*].rope_base": "phases[*].rotary_base (Megatron's name, as model.rotary_base)",
    "training.engine": "nothing: every run trains with the Megatron engine; delete the key",
}
"""Keys an earlier version read, by dotted path (``[*]``: any item of a list), and where each went:
the one table an unknown key's error consults (there are no aliases: an old key is refused)."""


def _moved(where: str, unknown: list[str]) -> str:
    path = re.sub(r"\[\d+\]", "[*]", where.split()[-1])  # "<file> model": the section is the last word
    moved = [f"{key} is now {MOVED_KEYS[f'{path}.{key}']}" for key in unknown if f"{path}.{key}" in MOVED_KEYS]
    return f" ({'; '.join(moved)})" if moved else ""


def build_dataclass(cls: type, values: Any, where: str) -> Any:
    """Instantiate ``cls`` from a mapping; unknown keys and bad values raise :class:`ConfigError`."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where}: expected a mapping of {cls.__name__} fields, got {values!r}")
    types_ = _field_types(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}{_moved(where, unknown) or did_you_mean(unknown, fields)}; "
                          f"valid keys: {sorted(fields)}")
    missing = sorted(
        name for name, f in fields.items()
        if name not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    if missing:
        raise ConfigError(f"{where}: missing required key(s) {missing}")
    kwargs = {name: coerce(value, types_[name], f"{where}.{name}") for name, value in values.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{where}: {err}") from err


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_dataclass_flags(parser: argparse.ArgumentParser, section: str, cls: type, *, skip: frozenset[str] = frozenset()) -> dict[str, tuple[str, str]]:
    """Add one flag per field of ``cls``; returns ``{argparse dest: (section, field)}``.

    Values stay strings (or lists of strings) here and are converted by :func:`coerce` together
    with the recipe's values, so the command line and YAML follow the same rules.
    """
    group = parser.add_argument_group(section)
    types_ = _field_types(cls)
    dests = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name in skip:
            continue
        annotation = types_[f.name]
        dest = f"{section}__{f.name}"
        doc = _field_doc(cls, f.name)
        base = annotation
        if get_origin(annotation) in (typing.Union, types.UnionType):
            base = next(a for a in get_args(annotation) if a is not type(None))
        if base is bool:
            group.add_argument(flag_name(f.name), dest=dest, action=argparse.BooleanOptionalAction, default=None, help=doc)
        elif get_origin(base) in (tuple, list):
            group.add_argument(flag_name(f.name), dest=dest, nargs="+", default=None, help=doc)
        else:
            group.add_argument(flag_name(f.name), dest=dest, default=None, help=doc)
        dests[dest] = (section, f.name)
    return dests


def _field_doc(cls: type, name: str) -> str | None:
    """The field's docstring (the string literal after it in the class body), for --help."""
    return _field_docs(cls).get(name)


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    import ast
    import inspect

    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            docs[node.target.id] = " ".join(str(nxt.value.value).split()).replace("%", "%%")
    return docs
