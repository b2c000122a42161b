"""Which tokenizer made a dataset: a record beside its index, and the check a run makes of it.

``tools/preprocess_data.py`` writes ``{prefix}.tokenizer.json`` with every ``{prefix}.bin/.idx``
pair (published before them, so a finished pair always has its record): the tokenizer's class, its
reference (what rebuilds it), its vocabulary size, its special tokens by role and its content
fingerprint (``EncoderTokenizer.fingerprint``: every id's piece and the special roles). A run, and
``--dry-run``, compare the fingerprint with the run's own tokenizer's and refuse a difference in one
line naming both: ids made by one tokenizer mean other words to another even when the vocabulary
sizes agree, and nothing downstream would notice. Data made before these records existed (or by
Megatron-LM's own tool) has none: one notice says the check was not possible.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from megatron_ext.config_loading import UserError
from megatron_ext.tokenizer import EncoderTokenizer

SUFFIX = ".tokenizer.json"
"""The record's name: the dataset prefix + this."""


def record_path(prefix: str) -> Path:
    return Path(prefix + SUFFIX)


def tokenizer_record(tokenizer: EncoderTokenizer) -> dict:
    """What the record says of ``tokenizer``."""
    return {"class": type(tokenizer).__name__, "reference": tokenizer.reference(),
            "vocab_size": tokenizer.vocab_size, "special_tokens": tokenizer.special_tokens(),
            "fingerprint": tokenizer.fingerprint()}


def write_record(prefix: str, tokenizer: EncoderTokenizer, *, suffix: str = "") -> str:
    """Write ``tokenizer``'s record for ``prefix`` at ``record_path(prefix)`` + ``suffix`` (a
    temporary name the caller renames when publishing); returns that path."""
    path = f"{record_path(prefix)}{suffix}"
    with open(path, "w", encoding="utf-8") as out:
        json.dump(tokenizer_record(tokenizer), out, indent=1, ensure_ascii=False)
        out.write("\n")
    return path


def describe_record(record: dict) -> str:
    """A tokenizer record in one line: class, where it loads from, ids and fingerprint (naming both
    sides of a refused difference)."""
    reference = record.get("reference") or {}
    where = reference.get("tokenizer_model") or f"{reference.get('vocab_file')} + {reference.get('merge_file')}"
    return f"{record.get('class')} {where!r} ({record.get('vocab_size'):,} ids, fingerprint {record.get('fingerprint')})"


def check_data_tokenizer(prefixes: list[str], tokenizer: EncoderTokenizer, *, field: str = "data.data_path") -> str | None:
    """Refuse (``UserError``, naming both tokenizers) data whose record names another tokenizer than
    ``tokenizer``; returns a notice naming the prefixes without a record (None when all have one).
    Prefixes whose files are missing are left to ``preflight.check_paths``."""
    unrecorded = []
    for prefix in prefixes:
        path = record_path(prefix)
        if not path.is_file():
            if os.path.isfile(prefix + ".idx"):
                unrecorded.append(prefix)
            continue
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            fingerprint = record["fingerprint"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise UserError(f"{field}: {path} is not a tokenizer record ({error}); rerun tools/preprocess_data.py "
                            "or delete it to skip the check") from None
        if fingerprint != tokenizer.fingerprint():
            raise UserError(
                f"{field}: {prefix} was tokenized by {describe_record(record)}, but this run's tokenizer is "
                f"{describe_record(tokenizer_record(tokenizer))}: its ids would mean other tokens; set "
                "tokenizer.tokenizer_model to the one that made the data, or preprocess the data again with this one")
    if not unrecorded:
        return None
    shown = ", ".join(unrecorded[:3]) + (f" and {len(unrecorded) - 3} more" if len(unrecorded) > 3 else "")
    return (f"notice: {shown} has no {SUFFIX} (made before tools/preprocess_data.py recorded its tokenizer): "
            f"that it was made with {tokenizer.name} is not checked")
