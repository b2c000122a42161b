"""Corpus-scale preprocessing: one corpus cut into a deterministic plan of shards, each tokenized
into its own ``.bin``/``.idx`` by whichever worker claims it, on any node, with no central driver in
the data path; resumable shard by shard.

Layout, for ``--output-prefix out/corpus`` (``{key}`` the json key, ``{level}`` ``document`` or
``sentence``)::

    out/corpus.shards/plan.json                    the plan: options, tokenizer, inputs, shards
    out/corpus.shards/00012_{key}_{level}.bin/.idx  shard 12's dataset (+ .tokenizer.json)
    out/corpus.shards/00012.done                    shard 12's marker: published last, its counts
    out/corpus_{key}_{level}.blend                  every non-empty shard as "tokens prefix" pairs
    out/corpus_{key}_{level}.bin/.idx               with --merge: the shards as one dataset

- The plan: inputs are expanded (globs, Parquet directories) and cut, in input order, into shards
  of about ``shard_bytes``: an uncompressed JSONL or line-mode text file into byte ranges (a line
  belongs to the range its first byte is in), a Parquet file into runs of row groups, anything
  else (gzip, paragraph or file text mode, Hugging Face datasets) one shard per input. Concatenated
  in order, the shards' documents are the single-process output's, token for token.
- A worker walks the plan, claims (``megatron_ext.claims``) each shard that has no marker, writes it
  under temporary names, publishes it (atomic renames), then its marker. A shard is done when its
  marker exists; a killed worker's temporaries are removed by the next claimer, never read. A dead
  worker's claim expires (its process gone on this host, or its heartbeat older than the timeout)
  and the shard is done again.
- The same command again redoes only the shards without a marker; a plan that differs from the one
  on disk (tokenizer, an input's size or modification time, an option, the shard size) is refused,
  naming what changed, unless ``--overwrite`` (which starts over).
- Memory: a worker holds one chunk of documents and one block of index (``indexed_writer``),
  whatever the corpus or the document count; the blend and the merge stream too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.claims import Claim, ClaimPolicy, Owner, try_claim
from megatron_ext.config_loading import UserError
from megatron_ext.data import provenance
from megatron_ext.data.blend_file import write_blend
from megatron_ext.data.preprocess import (
    CHUNK_DOCUMENTS, ChunkEncoder, PreprocessConfig, PreprocessSummary, StagedDataset, chunked, write_datasets,
)
from megatron_ext.data.readers import InputError, detect_format, expand_inputs, iter_records, parquet_row_groups
from megatron_ext.fileio import write_atomic
from megatron_ext.progress import duration
from megatron_ext.tokenizer import TokenizerConfig, build_tokenizer

logger = logging.getLogger(__name__)

PLAN_VERSION = 1
SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30,
              "T": 1 << 40, "TB": 1 << 40}


def parse_size(text: str, flag: str = "--shard-size") -> int:
    """``512MB``, ``2G``, ``1000000`` -> bytes (binary units); ``UserError`` naming ``flag`` otherwise."""
    number = text.strip().upper().rstrip("IB") if text.strip().upper().endswith("IB") else text.strip().upper()
    digits = number.rstrip("KMGTB")
    unit = number[len(digits):]
    try:
        value = float(digits) * SIZE_UNITS[unit]
    except (ValueError, KeyError):
        raise UserError(f"{flag}: expected a size such as 512MB, 2GB or a byte count, got {text!r}") from None
    if value < 1:
        raise UserError(f"{flag}: expected a size of at least 1 byte, got {text!r}")
    return int(value)


@dataclass(frozen=True, kw_only=True)
class Shard:
    """One unit of work: a whole input, or a part of one."""

    index: int
    path: str
    format: str
    part: tuple[int, int] | None
    """Bytes (JSONL, line-mode text) or row groups (Parquet) ``[start, end)``; None: the whole input."""
    bytes: int
    """Its size on disk (a part's share of a Parquet file's; 0 when unknown: a hub dataset)."""


@dataclass(frozen=True, kw_only=True)
class ShardPlan:
    """What to tokenize, how, and in which shards: everything a worker needs (``plan.json``)."""

    config: PreprocessConfig
    shard_bytes: int
    tokenizer: dict
    """The tokenizer's record (``provenance.tokenizer_record``): its fingerprint says if it changed."""
    inputs: tuple[dict, ...]
    """Each expanded input: path, format, size and modification time (None: a hub dataset)."""
    shards: tuple[Shard, ...]
    merge: bool = False
    """Whether the finished shards are also merged into one dataset."""

    @property
    def total_bytes(self) -> int:
        return sum(shard.bytes for shard in self.shards)

    def to_json(self) -> str:
        config = dataclasses.asdict(self.config)
        for volatile in ("workers", "overwrite", "progress"):  # how to run it, not what it makes
            config.pop(volatile)
        return json.dumps({"version": PLAN_VERSION, "config": config, "shard_bytes": self.shard_bytes,
                           "merge": self.merge, "tokenizer": self.tokenizer, "inputs": list(self.inputs),
                           "shards": [dataclasses.asdict(s) for s in self.shards]}, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> ShardPlan:
        try:
            data = json.loads(text)
            if data.get("version") != PLAN_VERSION:
                raise ValueError(f"version {data.get('version')}, expected {PLAN_VERSION}")
            config = dict(data["config"])
            config["tokenizer"] = TokenizerConfig(**config["tokenizer"])
            config["inputs"], config["json_keys"] = tuple(config["inputs"]), tuple(config["json_keys"])
            shards = tuple(Shard(**{**s, "part": tuple(s["part"]) if s["part"] is not None else None})
                           for s in data["shards"])
            return cls(config=PreprocessConfig(**config, progress=False), shard_bytes=data["shard_bytes"],
                       tokenizer=data["tokenizer"], inputs=tuple(data["inputs"]), shards=shards,
                       merge=bool(data.get("merge")))
        except (ValueError, KeyError, TypeError) as err:
            raise UserError(f"{where}: not a shard plan ({err}); delete the directory or pass --overwrite") from None


def _input_record(path: str, fmt: str) -> dict:
    if not os.path.exists(path):  # a hub dataset
        return {"path": path, "format": fmt, "size": None, "mtime_ns": None}
    if os.path.isdir(path):
        files = [f for f in Path(path).rglob("*") if f.is_file()]
        return {"path": path, "format": fmt, "size": sum(f.stat().st_size for f in files),
                "mtime_ns": max((f.stat().st_mtime_ns for f in files), default=0)}
    stat = os.stat(path)
    return {"path": path, "format": fmt, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _cut(path: str, fmt: str, config: PreprocessConfig, size: int, shard_bytes: int) -> list[tuple[tuple[int, int] | None, int]]:
    """``(part, bytes)`` of each shard of one input."""
    if fmt == "parquet":
        rows = parquet_row_groups(path)
        total_rows = max(sum(rows), 1)
        parts, start, share = [], 0, 0
        for group, n in enumerate(rows):
            share += n
            if share * size / total_rows >= shard_bytes or group == len(rows) - 1:
                parts.append(((start, group + 1), round(share * size / total_rows)))
                start, share = group + 1, 0
        return parts or [(None, size)]
    splittable = (fmt == "jsonl" or (fmt == "text" and config.text_mode == "line")) and os.path.isfile(path) \
        and not path.endswith(".gz")
    if not splittable or size <= shard_bytes:
        return [(None, size)]
    n = -(-size // shard_bytes)
    bounds = [size * i // n for i in range(n + 1)]
    return [((a, b), b - a) for a, b in zip(bounds, bounds[1:])]


def plan_corpus(config: PreprocessConfig, shard_bytes: int, *, merge: bool = False) -> ShardPlan:
    """The deterministic shard plan of ``config``'s inputs (refusing unusable inputs up front)."""
    if shard_bytes < 1:
        raise UserError(f"--shard-size: expected at least 1 byte, got {shard_bytes}")
    if config.split_sentences:
        raise UserError("--split-sentences with --shard-size: the sentence splitter is trained on the whole "
                        "corpus, which no shard sees; preprocess without --shard-size, or without --split-sentences")
    paths = expand_inputs(config.inputs)
    tokenizer = build_tokenizer(config.tokenizer)
    if config.append_eod:
        tokenizer.eod  # raises with the fix when the tokenizer has no EOD
    inputs, shards = [], []
    for path in paths:
        fmt = detect_format(path, config.input_format)
        record = _input_record(path, fmt)
        inputs.append(record)
        for part, size in _cut(path, fmt, config, record["size"] or 0, shard_bytes):
            shards.append(Shard(index=len(shards), path=path, format=fmt, part=part, bytes=size))
    return ShardPlan(config=config, shard_bytes=shard_bytes, tokenizer=provenance.tokenizer_record(tokenizer),
                     inputs=tuple(inputs), shards=tuple(shards), merge=merge)


# --- the shard directory ----------------------------------------------------------------------


@dataclass(frozen=True)
class ShardDir:
    """Where a plan's shards, markers and claims live: ``{output_prefix}.shards/``."""

    root: Path

    @classmethod
    def for_prefix(cls, output_prefix: str) -> ShardDir:
        return cls(Path(output_prefix + ".shards"))

    @property
    def plan_path(self) -> Path:
        return self.root / "plan.json"

    def prefix(self, shard: int, key: str, level: str) -> str:
        return str(self.root / f"{shard:05d}_{key}_{level}")

    def marker(self, shard: int) -> Path:
        return self.root / f"{shard:05d}.done"

    def claim_base(self, shard: int) -> Path:
        return self.root / f"{shard:05d}"

    def read_plan(self) -> ShardPlan:
        if not self.plan_path.is_file():
            raise UserError(f"{self.plan_path}: no shard plan; run tools/preprocess_data.py with --shard-size first")
        return ShardPlan.from_json(self.plan_path.read_text(encoding="utf-8"), str(self.plan_path))

    def markers(self, plan: ShardPlan) -> dict[int, dict]:
        """The done shards' markers, by shard index (one directory listing)."""
        names = set(os.listdir(self.root)) if self.root.is_dir() else set()
        done = {}
        for shard in plan.shards:
            if self.marker(shard.index).name in names:
                with contextlib.suppress(OSError, ValueError):
                    done[shard.index] = json.loads(self.marker(shard.index).read_text(encoding="utf-8"))
        return done


def _differences(old: ShardPlan, new: ShardPlan) -> list[str]:
    """What changed from ``old`` to ``new``, one phrase each."""
    changed = []
    if old.tokenizer.get("fingerprint") != new.tokenizer.get("fingerprint"):
        changed.append(f"the tokenizer ({provenance.describe_record(old.tokenizer)} -> "
                       f"{provenance.describe_record(new.tokenizer)})")
    old_inputs = {i["path"]: i for i in old.inputs}
    new_inputs = {i["path"]: i for i in new.inputs}
    for path in old_inputs.keys() - new_inputs.keys():
        changed.append(f"input {path} is no longer in the inputs")
    for path in new_inputs.keys() - old_inputs.keys():
        changed.append(f"input {path} is new")
    for path in old_inputs.keys() & new_inputs.keys():
        a, b = old_inputs[path], new_inputs[path]
        if (a["size"], a["mtime_ns"]) != (b["size"], b["mtime_ns"]):
            changed.append(f"input {path} changed (size {a['size']} -> {b['size']} bytes, modified "
                           f"{'again' if a['mtime_ns'] != b['mtime_ns'] else 'at the same time'})")
    a, b = json.loads(old.to_json()), json.loads(new.to_json())
    for key in sorted(a["config"].keys() | b["config"].keys()):
        if key not in ("inputs", "tokenizer", "output_prefix") and a["config"].get(key) != b["config"].get(key):
            changed.append(f"option {key} ({a['config'].get(key)!r} -> {b['config'].get(key)!r})")
    if a["config"]["tokenizer"] != b["config"]["tokenizer"] and not changed:
        changed.append(f"the tokenizer's reference ({a['config']['tokenizer']} -> {b['config']['tokenizer']})")
    if old.shard_bytes != new.shard_bytes:
        changed.append(f"--shard-size ({old.shard_bytes} -> {new.shard_bytes} bytes)")
    if not changed and a["shards"] != b["shards"]:
        changed.append("the shards")
    return changed


def check_plan(plan: ShardPlan, *, overwrite: bool = False) -> ShardPlan | None:
    """The plan already on disk for ``plan``'s output prefix (None: none, or ``overwrite``); refused
    (``UserError`` naming what changed) when it differs, or when a fresh plan would replace the
    outputs of another run, unless ``overwrite``."""
    shard_dir = ShardDir.for_prefix(plan.config.output_prefix)
    parent = shard_dir.root.parent
    if not parent.is_dir():
        raise InputError(f"--output-prefix {plan.config.output_prefix!r}: directory {parent} does not exist")
    if overwrite:
        return None
    if not shard_dir.plan_path.is_file():
        for key in plan.config.json_keys:
            prefix = plan.config.output_prefix_for(key)
            existing = [p for p in (prefix + ".bin", prefix + ".idx", str(blend_path(plan, key))) if os.path.exists(p)]
            if existing:
                raise UserError(f"output {existing[0]} already exists (not made from a shard plan); pass --overwrite "
                                "to replace it")
        return None
    old = shard_dir.read_plan()
    changed = _differences(old, plan)
    if changed:
        raise UserError(f"{shard_dir.plan_path}: the corpus under this --output-prefix was planned with other "
                        f"inputs or options; changed: {'; '.join(changed)}. Use another --output-prefix, or "
                        "--overwrite to start over")
    return old


def prepare(plan: ShardPlan, *, overwrite: bool = False) -> ShardDir:
    """Write ``plan`` to its shard directory, or check it against the one there (same plan: the run
    resumes; another: refused naming what changed, unless ``overwrite``, which starts over)."""
    shard_dir = ShardDir.for_prefix(plan.config.output_prefix)
    old = check_plan(plan, overwrite=overwrite)
    if old is not None:
        if old.merge != plan.merge:  # asking for the merge (or no more) changes no shard
            write_atomic(shard_dir.plan_path, plan.to_json())
        return shard_dir
    if shard_dir.root.exists():
        shutil.rmtree(shard_dir.root)
    shard_dir.root.mkdir(parents=True)
    write_atomic(shard_dir.plan_path, plan.to_json())
    return shard_dir


# --- a worker ------------------------------------------------------------------------------------


def _remove_leftovers(shard_dir: ShardDir, shard: int) -> None:
    """Remove what a killed worker left of ``shard`` (its temporaries), once this worker holds its claim."""
    stem = f"{shard:05d}_"
    for entry in os.scandir(shard_dir.root):
        if entry.name.startswith(stem) and ".tmp" in entry.name:
            pid = entry.name.split(".tmp", 1)[1].split(".", 1)[0]
            if not pid.isdigit() or pid != str(os.getpid()):
                logger.warning("removing %s, left by an interrupted worker", entry.path)
                os.unlink(entry.path)


def shard_encoder(plan: ShardPlan, shard_dir: ShardDir) -> ChunkEncoder:
    """The worker's encoder, built once; refused when its tokenizer is not the one planned (a
    tokenizer directory changed in place since)."""
    encoder = ChunkEncoder(plan.config, None)
    if provenance.tokenizer_record(encoder.tokenizer)["fingerprint"] != plan.tokenizer["fingerprint"]:
        raise UserError(f"{shard_dir.plan_path}: the tokenizer {plan.config.tokenizer} is no longer the one planned "
                        f"({provenance.describe_record(plan.tokenizer)}); rerun with --overwrite to start over")
    return encoder


def tokenize_shard(plan: ShardPlan, shard_dir: ShardDir, shard: Shard, encoder: ChunkEncoder | None = None) -> dict:
    """Tokenize one shard into its datasets, publish them, then its marker; the marker's content."""
    config = plan.config
    start = time.perf_counter()
    encoder = encoder or shard_encoder(plan, shard_dir)
    tokenizer = encoder.tokenizer
    records = iter_records(shard.path, fmt=shard.format, json_keys=config.json_keys, text_mode=config.text_mode,
                           hf_split=config.hf_split, part=shard.part)
    summary = PreprocessSummary()
    results = map(encoder.encode_chunk, chunked(records, CHUNK_DOCUMENTS))
    prefixes = {key: shard_dir.prefix(shard.index, key, config.level) for key in config.json_keys}
    write_datasets(config, results, prefixes, tokenizer=tokenizer, summary=summary)
    marker = {"shard": shard.index, "documents": summary.documents, "tokens": summary.tokens,
              "characters": summary.characters, "bytes": shard.bytes, "empty_skipped": summary.empty_skipped,
              "invalid_skipped": summary.invalid_skipped, "seconds": round(time.perf_counter() - start, 3),
              "finished_at": time.time(), "worker": Owner.this_process().label,
              "tokens_by_key": {key: _tokens(prefixes[key]) for key in config.json_keys}, "dtype": summary.dtype}
    write_atomic(shard_dir.marker(shard.index), json.dumps(marker) + "\n")
    return marker


def _tokens(prefix: str) -> int:
    from megatron_ext.data.index_checks import IndexReader

    return IndexReader(prefix).tokens()


@dataclass(kw_only=True)
class WorkerReport:
    done: list[int] = dataclasses.field(default_factory=list)
    """Shards this worker tokenized."""
    held_elsewhere: list[int] = dataclasses.field(default_factory=list)
    """Shards without a marker that another live worker holds."""


def run_worker(shard_dir: ShardDir, *, policy: ClaimPolicy | None = None, max_shards: int | None = None) -> WorkerReport:
    """Tokenize every shard of the plan that no worker has done or holds, one at a time, in order;
    ``max_shards``: stop after that many (tests kill a worker between shards that way)."""
    plan = shard_dir.read_plan()
    policy = policy or ClaimPolicy()
    owner = Owner.this_process()
    report = WorkerReport()
    encoder = None
    for shard in plan.shards:
        if max_shards is not None and len(report.done) >= max_shards:
            break
        if shard_dir.marker(shard.index).exists():
            continue
        claim = try_claim(shard_dir.claim_base(shard.index), owner=owner, policy=policy)
        if not isinstance(claim, Claim):  # a live holder
            report.held_elsewhere.append(shard.index)
            continue
        with claim:
            if shard_dir.marker(shard.index).exists():  # finished while we looked
                claim.finish()
                continue
            _remove_leftovers(shard_dir, shard.index)
            encoder = encoder or shard_encoder(plan, shard_dir)
            marker = tokenize_shard(plan, shard_dir, shard, encoder)
            claim.finish()
        report.done.append(shard.index)
        logger.info("shard %d/%d done: %s documents, %s tokens, %.1f s", shard.index + 1, len(plan.shards),
                    f"{marker['documents']:,}", f"{marker['tokens']:,}", marker["seconds"])
    return report


# --- progress -----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ShardProgress:
    """Where the corpus stands, from the markers alone (every worker's, on every node)."""

    shards: int
    done: int
    documents: int
    tokens: int
    bytes_total: int
    bytes_done: int
    seconds: float
    """From the first shard's start to the last marker."""

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def eta_seconds(self) -> float | None:
        if self.done == self.shards:
            return 0.0
        if not self.bytes_done or self.seconds <= 0:
            return None
        return (self.bytes_total - self.bytes_done) * self.seconds / self.bytes_done

    def format(self) -> str:
        eta = self.eta_seconds
        return (f"shards {self.done}/{self.shards}, {self.documents:,} documents, {self.tokens:,} tokens, "
                f"{self.bytes_done / 2**30:.2f}/{self.bytes_total / 2**30:.2f} GiB, "
                f"{self.tokens_per_second:,.0f} tokens/s, ETA "
                + ("unknown" if eta is None else duration(eta)))


def shard_progress(shard_dir: ShardDir, plan: ShardPlan | None = None) -> ShardProgress:
    """The corpus's :class:`ShardProgress`, from the markers in ``shard_dir``."""
    plan = plan or shard_dir.read_plan()
    markers = shard_dir.markers(plan)
    starts = [m["finished_at"] - m["seconds"] for m in markers.values()]
    ends = [m["finished_at"] for m in markers.values()]
    return ShardProgress(shards=len(plan.shards), done=len(markers),
                         documents=sum(m["documents"] for m in markers.values()),
                         tokens=sum(m["tokens"] for m in markers.values()), bytes_total=plan.total_bytes,
                         bytes_done=sum(m["bytes"] for m in markers.values()),
                         seconds=(max(ends) - min(starts)) if markers else 0.0)


# --- the result: a blend, a merge ---------------------------------------------------------------------


def blend_path(plan: ShardPlan, key: str) -> Path:
    return Path(plan.config.output_prefix_for(key) + ".blend")


def finish(shard_dir: ShardDir) -> dict[str, Path]:
    """Once every shard is done: per json key the blend file (``tokens prefix`` per line, each
    non-empty shard, in plan order: a ``data_path`` that samples the corpus as one) and, when the
    plan asks, the merged dataset. ``UserError`` naming the shards not done otherwise."""
    plan = shard_dir.read_plan()
    markers = shard_dir.markers(plan)
    missing = [s.index for s in plan.shards if s.index not in markers]
    if missing:
        raise UserError(f"{shard_dir.root}: {len(missing)} of {len(plan.shards)} shard(s) not done (first: "
                        f"{missing[0]}); run the same command again to finish them")
    written = {}
    for key in plan.config.json_keys:
        pairs = [(markers[s.index]["tokens_by_key"][key], shard_dir.prefix(s.index, key, plan.config.level))
                 for s in plan.shards]
        pairs = [(tokens, prefix) for tokens, prefix in pairs if tokens > 0]
        if not pairs:
            raise InputError(f"no documents in {', '.join(plan.config.inputs)} for key {key!r}; nothing written")
        path = blend_path(plan, key)
        write_blend(path, pairs)
        written[f"blend [{key}]"] = path
        if plan.merge:
            written[f"merged [{key}]"] = Path(merge(plan, key, [prefix for _, prefix in pairs]) + ".bin")
    return written


def merge(plan: ShardPlan, key: str, prefixes: list[str]) -> str:
    """Merge ``prefixes`` into ``{output_prefix}_{key}_{level}`` (``.bin``/``.idx`` and its
    tokenizer record), published whole; its prefix. Skipped when already merged from this plan."""
    from megatron_ext.data.indexed_writer import merge_indexed

    target = plan.config.output_prefix_for(key)
    if os.path.exists(target + ".idx") and provenance.record_path(target).is_file() and os.path.getmtime(
            target + ".idx") >= os.path.getmtime(ShardDir.for_prefix(plan.config.output_prefix).plan_path):
        return target
    staged = StagedDataset(target)
    try:
        merge_indexed(prefixes, staged.bin_path, staged.idx_path)
        shutil.copyfile(provenance.record_path(prefixes[0]), staged.record_path)
        staged.publish()
    finally:
        staged.remove()
    return target


def plan_lines(plan: ShardPlan, shard_dir: ShardDir, *, resumed: bool) -> Iterator[str]:
    """The plan, for ``--dry-run``: the shards (the first and last few), sizes, what is done."""
    markers = shard_dir.markers(plan) if resumed else {}
    yield (f"plan: {len(plan.inputs)} input(s), {plan.total_bytes / 2**30:.3f} GiB, {len(plan.shards)} shard(s) of "
           f"<= {plan.shard_bytes / 2**20:.0f} MiB, {len(markers)} done; shards in {shard_dir.root}")
    shown = list(plan.shards[:5]) + (list(plan.shards[-3:]) if len(plan.shards) > 8 else list(plan.shards[5:]))
    for i, shard in enumerate(shown):
        if i == 5 and len(plan.shards) > 8:
            yield f"  ... {len(plan.shards) - 8} more"
        part = "whole" if shard.part is None else (
            f"row groups {shard.part[0]}-{shard.part[1]}" if shard.format == "parquet"
            else f"bytes {shard.part[0]}-{shard.part[1]}")
        yield (f"  shard {shard.index:5d}  {shard.path} ({shard.format}, {part}, {shard.bytes / 2**20:.1f} MiB)"
               + ("  done" if shard.index in markers else ""))

