"""Raw corpora -> Megatron-Core indexed datasets (``.bin``/``.idx``).

Behaviour follows Megatron-LM's ``tools/preprocess_data.py`` so existing launch scripts and
datasets carry over: the same flags where they overlap, output ``{prefix}_{key}_document`` (or
``_sentence`` with sentence splitting), one index "sequence" per sentence, EOD appended to the last
sentence, dtype ``DType.optimal_dtype(vocab_size)``, and tokens from the same tokenizer call
(``add_special_tokens`` as Megatron's default ``include_special_tokens``).

Where it differs, and why:
- documents that tokenize to nothing are skipped and counted (Megatron writes an empty document,
  which only inflates the index);
- the index is streamed to disk as documents come (``indexed_writer``), not held in lists: memory
  does not grow with the document count;
- output is written under temporary names and renamed when complete, so an interrupted run or a
  crash never leaves a ``.bin``/``.idx`` pair that looks finished;
- the order of documents is the input order for any ``--workers`` (Megatron's ``imap`` also keeps
  order; we test the bytes are identical for 1 and N workers);
- the tokenizer's own thread pool is disabled: parallelism comes from ``--workers`` only, so the
  flag means what it says on a shared node.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import re
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron_ext.config_loading import UserError
from megatron_ext.data import provenance
from megatron_ext.data.readers import TEXT_MODES, InputError, Record, decode_record, detect_format, expand_inputs, iter_records
from megatron_ext.data.sentences import SentenceSplitter, build_splitter
from megatron_ext.progress import progress
from megatron_ext.tokenizer import EncoderTokenizer, TokenizerConfig, build_tokenizer

logger = logging.getLogger(__name__)

CHUNK_DOCUMENTS = 256
"""Documents per unit of work sent to a worker: large enough to amortise pickling."""


@dataclass(frozen=True, kw_only=True)
class PreprocessConfig:
    """What to read, how to tokenize it, and where to write."""

    inputs: tuple[str, ...]
    """Input files, globs, directories, HF ``save_to_disk`` dirs or hub ids, read in order."""
    output_prefix: str
    """Outputs are ``{output_prefix}_{key}_{document|sentence}.{bin,idx}``."""
    tokenizer: TokenizerConfig
    """Which tokenizer to use (see :mod:`megatron_ext.tokenizer`)."""
    json_keys: tuple[str, ...] = ("text",)
    """Fields to tokenize; one output dataset per key."""
    input_format: str = "auto"
    """``auto`` (from the file name), ``jsonl``, ``text``, ``parquet`` or ``hf``."""
    text_mode: str = "line"
    """Plain text: ``line`` = one document per line, ``paragraph`` = one per run of lines between
    blank lines, ``file`` = one document per file."""
    hf_split: str = "train"
    """Split to read from Hugging Face datasets."""
    workers: int = 1
    """Tokenizer processes; the output is byte-identical for any value."""
    append_eod: bool = False
    """End every non-empty document with the tokenizer's EOD id: appended, unless the tokenizer's
    own special tokens already end it there (a BERT tokenizer's EOD is ``[SEP]``, which
    ``add_special_tokens`` puts last: one ``[SEP]``, not two)."""
    add_special_tokens: bool = True
    """Let the tokenizer add its own specials (BOS/CLS...) per text, like Megatron's default."""
    split_sentences: bool = False
    """Split documents into sentences with nltk Punkt (one index sequence per sentence)."""
    keep_newlines: bool = False
    """With sentence splitting, keep the newlines between sentences."""
    lang: str = "english"
    """Punkt language for sentence splitting."""
    skip_invalid: bool = False
    """Skip (and count) invalid JSON lines instead of stopping at the first one."""
    overwrite: bool = False
    """Replace existing outputs; without it an existing output is an error."""
    progress: bool = True
    """Report progress on stderr: a bar on a terminal, else a line every 10% or 5 minutes."""

    def __post_init__(self) -> None:
        if not self.inputs:
            raise UserError("inputs: at least one --input is required")
        if self.workers < 1:
            raise UserError(f"workers: expected >= 1, got {self.workers}")
        if self.text_mode not in TEXT_MODES:
            raise UserError(f"text_mode: expected one of {list(TEXT_MODES)}, got {self.text_mode!r}")
        if not self.json_keys:
            raise UserError("json_keys: at least one key is required")
        if self.keep_newlines and not self.split_sentences:
            raise UserError("keep_newlines only applies with split_sentences")

    @property
    def level(self) -> str:
        return "sentence" if self.split_sentences else "document"

    def output_prefix_for(self, key: str) -> str:
        return f"{self.output_prefix}_{key}_{self.level}"


@dataclass(kw_only=True)
class PreprocessSummary:
    """Counts reported at the end of a run."""

    documents: int = 0
    """Documents written (per key they may differ; this counts the first key)."""
    tokens: int = 0
    """Tokens written over all keys."""
    empty_skipped: int = 0
    """Documents (per key) that tokenized to nothing and were left out."""
    invalid_skipped: int = 0
    """Invalid input lines skipped under ``skip_invalid``."""
    characters: int = 0
    """Characters of text tokenized."""
    seconds: float = 0.0
    """Wall time, start-up included."""
    startup_seconds: float = 0.0
    """Until the first document could be read: imports, tokenizer loading, worker start-up."""
    outputs: dict[str, str] = field(default_factory=dict)
    """Key -> output prefix of its ``.bin``/``.idx``."""
    dtype: str = ""
    splitter: str = "none"

    @property
    def tokens_per_second(self) -> float:
        """Steady-state throughput: tokens over the time after start-up (as Megatron-LM reports)."""
        busy = self.seconds - self.startup_seconds
        return self.tokens / busy if busy > 0 else 0.0

    def format(self) -> str:
        lines = [
            f"documents written   {self.documents:,}",
            f"tokens written      {self.tokens:,} ({self.dtype})",
            f"characters          {self.characters:,}",
            f"empty docs skipped  {self.empty_skipped:,}",
            f"invalid skipped     {self.invalid_skipped:,}",
            f"sentence splitter   {self.splitter}",
            f"time                {self.seconds:.2f} s, of which start-up {self.startup_seconds:.2f} s",
            f"throughput          {self.tokens_per_second:,.0f} tokens/s after start-up",
        ]
        lines += [f"output [{k}]  {p}.bin / .idx" for k, p in self.outputs.items()]
        return "\n".join(lines)


# --- worker side -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EncodedChunk:
    """The tokens of a chunk of documents for one json key, as flat arrays (cheap to pickle)."""

    ids: np.ndarray
    """All token ids of the chunk, document after document (int32)."""
    sentence_lengths: np.ndarray
    """Tokens per non-empty sentence, in order."""
    sentences_per_doc: np.ndarray
    """Non-empty sentences per document; 0 = the document tokenized to nothing."""


_worker: "ChunkEncoder | None" = None


class ChunkEncoder:
    """Turns chunks of records into token arrays; one instance per worker process (and one per
    shard worker: ``shards.shard_encoder``)."""

    def __init__(self, config: PreprocessConfig, splitter: SentenceSplitter | None) -> None:
        # One thread per worker: --workers is the only source of parallelism.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        self.config = config
        self.splitter = splitter
        self.tokenizer: EncoderTokenizer = build_tokenizer(config.tokenizer)
        self.eod = self.tokenizer.eod if config.append_eod else None

    def encode_chunk(self, records: list[Record]) -> tuple[dict[str, EncodedChunk], list[bool], int]:
        """Encode ``records``: per key an :class:`EncodedChunk`, per record an invalid flag, chars."""
        keys = self.config.json_keys
        decoded: list[dict[str, str] | None] = []
        for record in records:
            try:
                decoded.append(decode_record(record, keys))
            except InputError:
                if not self.config.skip_invalid:
                    raise
                decoded.append(None)
        valid = [fields for fields in decoded if fields is not None]
        chars = sum(len(fields[key]) for fields in valid for key in keys)
        return {key: self._encode_key([f[key] for f in valid]) for key in keys}, [f is None for f in decoded], chars

    def _encode_key(self, texts: list[str]) -> EncodedChunk:
        sentences = [self.splitter.split(t) if self.splitter else [t] for t in texts]
        # One batch call over every sentence of the chunk: the tokenizer's fast path.
        flat = self.tokenizer.tokenize_batch(
            [s for doc in sentences for s in doc], add_special_tokens=self.config.add_special_tokens
        )
        ids: list[int] = []
        sentence_lengths: list[int] = []
        sentences_per_doc: list[int] = []
        k = 0
        for doc in sentences:
            n_before = len(sentence_lengths)
            for piece in flat[k : k + len(doc)]:
                if piece:  # Megatron drops sentences that tokenize to nothing
                    ids.extend(piece)
                    sentence_lengths.append(len(piece))
            k += len(doc)
            if self.eod is not None and len(sentence_lengths) > n_before and ids[-1] != self.eod:
                ids.append(self.eod)
                sentence_lengths[-1] += 1
            sentences_per_doc.append(len(sentence_lengths) - n_before)
        return EncodedChunk(
            ids=np.asarray(ids, dtype=np.int32),
            sentence_lengths=np.asarray(sentence_lengths, dtype=np.int64),
            sentences_per_doc=np.asarray(sentences_per_doc, dtype=np.int64),
        )


def _init_worker(config: PreprocessConfig, splitter: SentenceSplitter | None, ready) -> None:
    global _worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle, once
    _worker = ChunkEncoder(config, splitter)
    ready.put(os.getpid())


def _encode_in_worker(records: list[Record]):
    assert _worker is not None
    return _worker.encode_chunk(records)


# --- driver side -------------------------------------------------------------------------------


def _all_records(config: PreprocessConfig, paths: Sequence[str]) -> Iterator[Record]:
    for path in paths:
        yield from iter_records(
            path, fmt=config.input_format, json_keys=config.json_keys,
            text_mode=config.text_mode, hf_split=config.hf_split,
        )


def chunked(records: Iterator[Record], size: int) -> Iterator[list[Record]]:
    """``records`` in lists of ``size`` (the last one shorter): the units of work of the encoders."""
    while chunk := list(itertools.islice(records, size)):
        yield chunk


def _training_texts(config: PreprocessConfig, paths: Sequence[str]) -> Iterator[str]:
    for record in _all_records(config, paths):
        try:
            fields = decode_record(record, config.json_keys)
        except InputError:
            continue  # reported properly by the main pass
        yield from fields.values()


def _check_outputs(config: PreprocessConfig) -> None:
    for key in config.json_keys:
        prefix = config.output_prefix_for(key)
        existing = [p for p in (prefix + ".bin", prefix + ".idx") if os.path.exists(p)]
        if existing and not config.overwrite:
            raise UserError(f"output {existing[0]} already exists; pass --overwrite to replace it")
    parent = Path(config.output_prefix).parent
    _remove_stale_temporaries(config)
    if not parent.exists():
        raise InputError(f"--output-prefix {config.output_prefix!r}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise InputError(f"--output-prefix {config.output_prefix!r}: directory {parent} is not writable")


_TEMPORARY = re.compile(r"\.(bin|idx|tokenizer\.json)\.tmp(\d+)(\.lengths|\.documents)?$")


def _remove_stale_temporaries(config: PreprocessConfig) -> None:
    """Remove ``<prefix>.bin.tmp<pid>`` / ``.idx.tmp<pid>`` (and its ``.lengths``/``.documents`` side
    files) / ``.tokenizer.json.tmp<pid>`` files of this run's outputs that a killed run left behind
    (their process is gone), saying so."""
    for key in config.json_keys:
        prefix = Path(config.output_prefix_for(key))
        if not prefix.parent.is_dir():
            continue
        for path in prefix.parent.glob(prefix.name + ".*.tmp*"):
            match = _TEMPORARY.search(path.name)
            if not match or path.name[: match.start()] != prefix.name or _process_alive(int(match[2])):
                continue
            logger.warning("removing %s, left by an interrupted run (process %s is gone)", path, match[2])
            path.unlink()


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def preprocess(config: PreprocessConfig) -> PreprocessSummary:
    """Tokenize ``config.inputs`` into one Megatron indexed dataset per json key."""
    start = time.perf_counter()
    paths = expand_inputs(config.inputs)
    formats = [detect_format(path, config.input_format) for path in paths]  # fail fast on unusable inputs
    _check_outputs(config)

    tokenizer = build_tokenizer(config.tokenizer)
    if config.append_eod:
        tokenizer.eod  # raises with the fix when the tokenizer has no EOD
    splitter = None
    if config.split_sentences:
        splitter = build_splitter(
            lang=config.lang, keep_newlines=config.keep_newlines,
            training_texts=_training_texts(config, paths),
        )
    pool = None
    if config.workers > 1:
        # Start the workers first: they load the tokenizer while this process imports Megatron.
        ctx = multiprocessing.get_context("spawn")  # fork is unsafe with torch/tokenizer threads
        ready = ctx.Queue()
        pool = ctx.Pool(config.workers, initializer=_init_worker, initargs=(config, splitter, ready))
    summary = PreprocessSummary(splitter=splitter.source if splitter else "none")
    bar = _progress(config.progress, _input_bytes(paths, formats))
    try:
        chunks = chunked(_all_records(config, paths), CHUNK_DOCUMENTS)
        if pool is None:
            results = map(ChunkEncoder(config, splitter).encode_chunk, chunks)
        else:
            for _ in range(config.workers):
                ready.get()
            results = pool.imap(_encode_in_worker, chunks)  # imap keeps input order
        summary.startup_seconds = time.perf_counter() - start
        write_datasets(config, results, {key: config.output_prefix_for(key) for key in config.json_keys},
                       tokenizer=tokenizer, summary=summary, on_chars=bar.update, inputs=", ".join(paths))
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    summary.seconds = time.perf_counter() - start
    return summary


def write_datasets(config: PreprocessConfig, results: Iterator[tuple[dict[str, EncodedChunk], list[bool], int]],
                   prefixes: dict[str, str], *, tokenizer: EncoderTokenizer, summary: PreprocessSummary,
                   on_chars=None, inputs: str | None = None) -> None:
    """Write the encoded chunks ``results`` as one dataset per json key at ``prefixes[key]``, each
    with its tokenizer record, published whole (renamed from ``.tmp<pid>`` names once complete).
    ``inputs``: what was read, for the refusal of a run that found no document; None: no documents
    is fine (an empty pair is written; a shard of a corpus may hold none)."""
    from megatron_ext.data.indexed_writer import IndexedWriter, optimal_dtype

    dtype = optimal_dtype(tokenizer.vocab_size)
    summary.dtype = np.dtype(dtype).name
    staged = {key: StagedDataset(prefixes[key]) for key in config.json_keys}
    writers: dict[str, IndexedWriter] = {}
    try:
        for key in config.json_keys:
            writers[key] = IndexedWriter(staged[key].bin_path, staged[key].idx_path, dtype)
        for encoded, invalid, chars in results:
            summary.characters += chars
            summary.invalid_skipped += sum(invalid)
            for key, chunk in encoded.items():
                _write_chunk(writers[key], chunk, tokenizer.vocab_size, summary, count_docs=key == config.json_keys[0])
            if on_chars is not None:
                on_chars(chars)
        if summary.documents == 0 and inputs is not None:
            raise InputError(f"no documents in {inputs} (every input was empty"
                             + (f", or {summary.invalid_skipped:,} invalid line(s) skipped" if summary.invalid_skipped
                                else "") + "); nothing written")
        for key, writer in writers.items():
            writer.finalize()
            provenance.write_record(prefixes[key], tokenizer, suffix=staged[key].suffix)
        for key in config.json_keys:
            staged[key].publish()
            summary.outputs[key] = prefixes[key]
    finally:
        for key, writer in writers.items():
            writer.close()
        for dataset in staged.values():
            dataset.remove()


@dataclass(frozen=True)
class StagedDataset:
    """A dataset's files (``.bin``, ``.idx``, tokenizer record) written under temporary names
    (``<name>.tmp<pid>``) and renamed by :meth:`publish` once complete: the preprocessing's
    outputs, a shard's, the merge of a corpus's shards (``shards.merge``)."""

    prefix: str
    pid: int = field(default_factory=os.getpid)

    @property
    def suffix(self) -> str:
        return f".tmp{self.pid}"

    @property
    def bin_path(self) -> str:
        return f"{self.prefix}.bin{self.suffix}"

    @property
    def idx_path(self) -> str:
        return f"{self.prefix}.idx{self.suffix}"

    @property
    def record_path(self) -> str:
        return f"{provenance.record_path(self.prefix)}{self.suffix}"

    def publish(self) -> None:
        """Rename the three files to their final names: any old index dropped first, then the
        tokenizer record, the ``.bin``, the ``.idx``. Readers need both files, so at every instant
        the pair is either the old complete one, incomplete, or the new one, and a complete new
        pair has its record."""
        if os.path.exists(self.prefix + ".idx"):
            os.unlink(self.prefix + ".idx")
        os.replace(self.record_path, str(provenance.record_path(self.prefix)))
        os.replace(self.bin_path, self.prefix + ".bin")
        os.replace(self.idx_path, self.prefix + ".idx")

    def remove(self) -> None:
        """Remove what is left of the temporary files (all of them, unless published)."""
        for path in (self.bin_path, self.idx_path, self.record_path):
            if os.path.exists(path):
                os.unlink(path)


def _write_chunk(builder, chunk: EncodedChunk, vocab_size: int, summary: PreprocessSummary, *, count_docs: bool) -> None:
    if chunk.ids.size and int(chunk.ids.max()) >= vocab_size:
        raise UserError(
            f"token id {int(chunk.ids.max())} >= vocab size {vocab_size}: the tokenizer reports a "
            "vocab smaller than the ids it produces"
        )
    token_start = sentence_start = 0
    for n_sentences in chunk.sentences_per_doc.tolist():
        if n_sentences == 0:
            summary.empty_skipped += 1
            continue
        lengths = chunk.sentence_lengths[sentence_start : sentence_start + n_sentences]
        n_tokens = int(lengths.sum())
        builder.add_document(chunk.ids[token_start : token_start + n_tokens], lengths)
        token_start += n_tokens
        sentence_start += n_sentences
        summary.tokens += n_tokens
        summary.documents += count_docs


def _input_bytes(paths: Sequence[str], formats: Sequence[str]) -> int | None:
    """The total the progress counts characters against: the inputs' bytes when every input is an
    uncompressed JSONL or text file (characters ~ bytes for mostly-ASCII text); None otherwise
    (gzip, Parquet, Hugging Face datasets, directories: their bytes are not the text's size)."""
    plain = all(fmt in ("jsonl", "text") and os.path.isfile(path) and not path.endswith(".gz")
                for path, fmt in zip(paths, formats, strict=True))
    return sum(os.path.getsize(path) for path in paths) if plain else None


def _progress(enabled: bool, total_bytes: int | None):
    """A bar on a terminal; into a log file, a line every 10% of the input or 5 minutes (a job of
    hours under a batch system says where it is), and the amount, time and rate at the end."""
    return progress(total=total_bytes or None, unit="B", unit_scale=True, desc="preprocess", enabled=enabled,
                    mininterval=1.0)
