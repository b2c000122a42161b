"""Streaming readers for raw corpora: JSONL (optionally gzipped), plain text, Parquet, HF datasets.

Every reader yields :class:`Record` objects in a deterministic order: the text fields requested
by ``json_keys`` plus a human-readable location (``file:line`` or ``file:row``) used in error
messages. JSON is decoded lazily (``Record.raw``) so that the expensive part can run in worker
processes while the reader stays a cheap line iterator.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megatron_ext.config_loading import UserError

logger = logging.getLogger(__name__)

InputFormat = Literal["auto", "jsonl", "text", "parquet", "hf"]
INPUT_FORMATS: tuple[str, ...] = ("auto", "jsonl", "text", "parquet", "hf")
TextMode = Literal["line", "paragraph", "file"]
TEXT_MODES: tuple[str, ...] = ("line", "paragraph", "file")

_JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".ndjson")
_TEXT_SUFFIXES = (".txt", ".txt.gz", ".text", ".cor")


@dataclass(frozen=True, slots=True)
class Record:
    """One input document before tokenization."""

    location: str
    """Where it came from, e.g. ``corpus.jsonl:17``; used in error messages."""
    raw: str | None = None
    """An undecoded JSON line (JSONL inputs); decoded by :func:`decode_record`."""
    fields: dict[str, str] | None = None
    """Already-extracted text fields (text, Parquet and HF inputs)."""
    error: str | None = None
    """Why the record cannot be read (e.g. invalid UTF-8); :func:`decode_record` raises it."""


class InputError(UserError):
    """Bad input: the message names the file, line or key, and what was expected."""


def expand_inputs(inputs: Sequence[str]) -> list[str]:
    """Expand globs and Parquet directories (their ``*.parquet`` files, sorted, at any depth); keep
    hub-style ids (``org/name``) that are not local paths as they are."""
    paths: list[str] = []
    for item in inputs:
        matches = sorted(glob.glob(item))
        if matches:
            for match in matches:
                paths.extend(_parquet_files(match) or [match])
        elif os.path.exists(item):
            paths.append(item)
        else:
            paths.append(item)  # validated by detect_format (a hub id, or a missing path)
    return paths


def _parquet_files(path: str) -> list[str]:
    """The Parquet files of directory ``path`` (a dataset written as Parquet parts); none for a
    file, a saved Hugging Face dataset, or a directory holding other files (read as text)."""
    if not os.path.isdir(path) or _is_hf_saved_dataset(Path(path)):
        return []
    files = sorted(str(f) for f in Path(path).rglob("*") if f.is_file() and not f.name.startswith((".", "_")))
    return files if files and all(f.endswith(".parquet") for f in files) else []


def _is_hf_saved_dataset(path: Path) -> bool:
    return path.is_dir() and (
        (path / "dataset_info.json").exists()
        or (path / "state.json").exists()
        or (path / "dataset_dict.json").exists()
    )


def detect_format(path: str, requested: str) -> str:
    """Resolve ``auto`` into a concrete format for ``path``; error if the path is unusable."""
    if requested not in INPUT_FORMATS:
        raise InputError(f"--input-format {requested!r} is not one of {INPUT_FORMATS}")
    p = Path(path)
    if requested == "hf":
        return "hf"
    if not p.exists():
        if requested == "auto" and "/" in path and not path.startswith((".", "/")):
            return "hf"  # looks like a hub id, e.g. "HuggingFaceFW/fineweb-edu"
        raise InputError(f"--input {path!r}: no such file or directory")
    if p.is_dir():
        if _is_hf_saved_dataset(p):
            return "hf"
        if requested in ("auto", "text"):
            return "text"
        raise InputError(f"--input {path!r} is a directory; expected a {requested} file")
    if not os.access(p, os.R_OK):
        raise InputError(f"--input {path!r} is not readable")
    if requested != "auto":
        return requested
    name = p.name.lower()
    if name.endswith(_JSON_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(_TEXT_SUFFIXES):
        return "text"
    raise InputError(
        f"--input {path!r}: cannot infer the format from the name; expected one of "
        f"{_JSON_SUFFIXES + _TEXT_SUFFIXES + ('.parquet',)} or pass --input-format"
    )


def _open_binary(path: str) -> io.BufferedIOBase:
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _decoded_lines(path: str, part: tuple[int, int] | None = None) -> Iterator[tuple[str, str | None, str | None]]:
    """``(location, text, error)`` per line: lines are decoded one by one, so a byte that is not
    UTF-8 is reported (or skipped) with its file and line instead of stopping the whole read.

    ``part``: only the lines that start in bytes ``[start, end)`` of an uncompressed file (a shard
    of it; every line belongs to exactly one part), located by their first byte (``file:byte N``)."""
    with _open_binary(path) as f:
        if part is None:
            lines = ((f"{path}:{lineno}", line) for lineno, line in enumerate(f, start=1))
        else:
            lines = _lines_in(f, path, *part)
        for location, line in lines:
            try:
                yield location, line.decode("utf-8"), None
            except UnicodeDecodeError as err:
                yield location, None, f"invalid UTF-8 (byte 0x{line[err.start]:02x} at column {err.start + 1})"


def _lines_in(f, path: str, start: int, end: int) -> Iterator[tuple[str, bytes]]:
    """The lines of ``f`` whose first byte lies in ``[start, end)``."""
    if start > 0:
        f.seek(start - 1)
        f.readline()  # the rest of the line that started before ``start`` (or just its newline)
    position = f.tell()
    while position < end:
        line = f.readline()
        if not line:
            return
        yield f"{path}:byte {position}", line
        position += len(line)


def _read_jsonl(path: str, part: tuple[int, int] | None = None) -> Iterator[Record]:
    for location, line, error in _decoded_lines(path, part):
        if error is not None:
            yield Record(location=location, error=error)
        elif line.strip():
            yield Record(location=location, raw=line)


def _read_text(path: str, key: str, text_mode: str, part: tuple[int, int] | None = None) -> Iterator[Record]:
    if part is not None:  # a part of one file, line mode (the shard plan splits nothing else)
        for location, line, error in _decoded_lines(path, part):
            yield Record(location=location, error=error) if error is not None else \
                Record(location=location, fields={key: line.rstrip("\r\n")})
        return
    files = sorted(str(f) for f in Path(path).rglob("*") if f.is_file()) if os.path.isdir(path) else [path]
    for file in files:
        if text_mode == "file":
            with _open_binary(file) as f:
                data = f.read()
            try:
                text = data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")  # universal newlines
            except UnicodeDecodeError as err:
                line = data.count(b"\n", 0, err.start) + 1
                yield Record(location=f"{file}:{line}", error=f"invalid UTF-8 (byte 0x{data[err.start]:02x})")
                continue
            yield Record(location=file, fields={key: text})
            continue
        if text_mode == "paragraph":
            yield from _paragraphs(file, key)
            continue
        run = 0  # non-blank lines in a row
        several_lines = blank_after_text = told = False
        for location, line, error in _decoded_lines(file):
            if error is not None:
                yield Record(location=location, error=error)
                continue
            text = line.rstrip("\r\n")
            if text.strip():
                run += 1
                several_lines = several_lines or run > 1
                # Runs of lines between blank lines: paragraphs, which line mode cuts into lines.
                if several_lines and blank_after_text and not told:
                    logger.warning("notice: %s separates paragraphs with blank lines; --text-mode line makes each "
                                   "line a document, --text-mode paragraph one document per paragraph", file)
                    told = True
            else:
                blank_after_text = blank_after_text or run > 0
                run = 0
            yield Record(location=location, fields={key: text})


def _paragraphs(file: str, key: str) -> Iterator[Record]:
    """One record per paragraph of ``file``: lines up to a blank line (or the end), joined with
    their newlines; runs of blank lines separate, they make no document."""
    lines: list[str] = []
    first = ""
    for location, line, error in _decoded_lines(file):
        if error is not None:
            yield Record(location=location, error=error)
            continue
        text = line.rstrip("\r\n")
        if text.strip():
            if not lines:
                first = location
            lines.append(text)
        elif lines:
            yield Record(location=first, fields={key: "\n".join(lines)})
            lines = []
    if lines:
        yield Record(location=first, fields={key: "\n".join(lines)})


def parquet_row_groups(path: str) -> list[int]:
    """The row count of each row group of Parquet file ``path`` (the units a shard plan splits it in)."""
    import pyarrow.parquet as pq

    try:
        metadata = pq.ParquetFile(path).metadata
    except (OSError, ValueError) as err:
        raise InputError(f"--input {path!r}: not a readable Parquet file ({err})") from None
    return [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]


def _read_parquet(path: str, keys: Sequence[str], part: tuple[int, int] | None = None) -> Iterator[Record]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise InputError(f"--input {path!r}: not a readable Parquet file ({err})") from None
    present = pf.schema_arrow.names
    missing = [k for k in keys if k not in present]
    if missing:
        raise InputError(f"{path}: column(s) {missing} not found; columns present: {present}")
    groups = range(pf.metadata.num_row_groups) if part is None else range(*part)
    row = sum(pf.metadata.row_group(i).num_rows for i in range(groups.start))
    for batch in pf.iter_batches(columns=list(keys), batch_size=1024, row_groups=list(groups)):
        columns = [batch.column(k).to_pylist() for k in keys]
        for values in zip(*columns):
            yield Record(location=f"{path}:row {row}", fields=_text_fields(path, row, keys, values))
            row += 1


def _read_hf(path: str, keys: Sequence[str], split: str) -> Iterator[Record]:
    """A saved dataset (memory-mapped Arrow) or a hub dataset, streamed: its first document is
    tokenized before the rest is downloaded, in memory that does not grow with its size."""
    import datasets

    try:
        ds = datasets.load_from_disk(path) if os.path.isdir(path) else \
            datasets.load_dataset(path, split=split, streaming=True)
    except (OSError, ValueError) as err:  # a missing hub dataset is a FileNotFoundError
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise InputError(f"--input {path!r}: cannot load it as a Hugging Face dataset ({first_line})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise InputError(f"{path}: split {split!r} not found; splits present: {list(ds)}")
        ds = ds[split]
    present = list(ds.column_names or keys)  # a streamed dataset may not know its columns before reading
    missing = [k for k in keys if k not in present]
    if missing:
        raise InputError(f"{path}: column(s) {missing} not found; columns present: {present}")
    for row, example in enumerate(ds.select_columns(list(keys))):
        values = [example[k] for k in keys]
        yield Record(location=f"{path}:row {row}", fields=_text_fields(path, row, keys, values))


def _text_fields(path: str, row: int, keys: Sequence[str], values: Sequence[object]) -> dict[str, str]:
    fields = {}
    for key, value in zip(keys, values):
        if value is None:
            value = ""
        if not isinstance(value, str):
            raise InputError(f"{path}:row {row}: key {key!r} holds {type(value).__name__}, expected a string")
        fields[key] = value
    return fields


def iter_records(
    path: str, *, fmt: str, json_keys: Sequence[str], text_mode: str = "line", hf_split: str = "train",
    part: tuple[int, int] | None = None,
) -> Iterator[Record]:
    """Yield the records of one input in file order; ``part``: only those of one shard of it, in
    the unit the shard plan cuts the format in (bytes of JSONL and line-mode text, Parquet row groups)."""
    fmt = detect_format(path, fmt)
    if fmt == "jsonl":
        return _read_jsonl(path, part)
    if fmt == "text":
        if len(json_keys) != 1:
            raise InputError(f"{path}: plain-text input has one field; got --json-keys {list(json_keys)}")
        return _read_text(path, json_keys[0], text_mode, part)
    if fmt == "parquet":
        return _read_parquet(path, json_keys, part)
    return _read_hf(path, json_keys, hf_split)


def decode_record(record: Record, json_keys: Sequence[str]) -> dict[str, str]:
    """Text fields of ``record``; raises :class:`InputError` naming the location on bad input."""
    if record.error is not None:
        raise InputError(f"{record.location}: {record.error}")
    if record.fields is not None:
        return record.fields
    try:
        data = json.loads(record.raw)
    except json.JSONDecodeError as err:
        raise InputError(f"{record.location}: invalid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(data, dict):
        raise InputError(f"{record.location}: expected a JSON object, got {type(data).__name__}")
    missing = [k for k in json_keys if k not in data]
    if missing:
        raise InputError(f"{record.location}: key(s) {missing} missing; keys present: {sorted(data)}")
    fields = {}
    for key in json_keys:
        value = data[key]
        if value is None:
            value = ""
        if not isinstance(value, str):
            raise InputError(
                f"{record.location}: key {key!r} holds {type(value).__name__}, expected a string"
            )
        fields[key] = value
    return fields
