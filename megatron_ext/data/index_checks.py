"""Megatron-Core's ``.bin``/``.idx`` pairs: reading an index's header and arrays (:class:`IndexReader`,
without Megatron), and the checks a pair passes before Megatron reads it.

Megatron's own failures on a bad pair are asserts, garbage samples or a hang, so every pair a run
reads is checked first, naming the file and what is wrong: missing files (with the prefixes its
folder does hold), a bad index header, a ``.bin`` whose size disagrees with its index, corrupt
sequence pointers or document boundaries, a token dtype that cannot hold the tokenizer's ids, and
ids outside the vocab (a whole-file scan, for datasets small enough). Reading the index needs no
dataset built: the dataset builders (``training.datasets``) and the dry run use these checks.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

from megatron_ext.config_loading import UserError
from megatron_ext.tokenizer import EncoderTokenizer

_INDEX_PREAMBLE = struct.Struct("<9sQBQQ")  # header, version, dtype code, sequences, documents


@dataclass(frozen=True, kw_only=True)
class IndexFile:
    """What a checked ``.idx`` says about its ``.bin``."""

    prefix: str
    dtype: np.dtype
    tokens_before: np.ndarray
    """Tokens before each sequence, and the total at the end (length: sequences + 1)."""
    document_indices: np.ndarray
    """Index of each document's first sequence, and the sequence count at the end."""


def missing_prefix_problem(prefix: str) -> str | None:
    """What is missing of dataset ``prefix`` (its ``.bin``/``.idx``), naming the prefixes its folder
    does hold (``tools/preprocess_data.py`` names them ``{prefix}_{key}_document``, so a prefix
    given without that ending, or with another key, is a near miss); None when both files exist."""
    for path in (prefix + ".idx", prefix + ".bin"):
        if os.path.isfile(path):
            continue
        if prefix.endswith((".bin", ".idx")):
            return f"{path} does not exist (give the prefix, without .bin/.idx)"
        folder = os.path.dirname(os.path.abspath(prefix))
        present = sorted(os.path.join(os.path.dirname(prefix), name[:-4]) for name in
                         (os.listdir(folder) if os.path.isdir(folder) else []) if name.endswith(".idx"))
        if not present:
            return f"{path} does not exist, and {folder} holds no dataset (.idx)"
        shown = ", ".join(present[:5]) + (f" and {len(present) - 5} more" if len(present) > 5 else "")
        return f"{path} does not exist; the prefixes in {folder}: {shown}"
    return None


INDEX_HEADER = b"MMIDIDX\x00\x00"
"""The first bytes of a Megatron-Core ``.idx`` (its ``indexed_dataset._INDEX_HEADER``, tested equal),
stated here so that reading a header imports no Megatron."""

INDEX_ARRAYS_OFFSET = _INDEX_PREAMBLE.size
"""Where an ``.idx``'s arrays start: ``int32`` sequence lengths, ``int64`` pointers, ``int64``
document starts (in sequences)."""


def read_index_header(idx_path: str, *, header: bytes = INDEX_HEADER) -> tuple[int, int, int]:
    """``(dtype code, sequences, documents)`` of a Megatron ``.idx`` after checking its header,
    version and size against those counts; ``UserError`` naming the file otherwise. The one reader
    of the header: the data checks (:func:`read_index`) and the dry run's document lengths use it."""
    idx_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        preamble = f.read(_INDEX_PREAMBLE.size)
    if preamble[:9] != header:
        raise UserError(f"{idx_path}: not a Megatron index; expected it to start with {header!r}, got {preamble[:9]!r}")
    if len(preamble) < _INDEX_PREAMBLE.size:
        raise UserError(f"{idx_path}: truncated header ({idx_size} bytes)")
    _, version, code, n_sequences, n_documents = _INDEX_PREAMBLE.unpack(preamble)
    if version != 1:
        raise UserError(f"{idx_path}: index version {version}; Megatron-Core reads version 1")
    expected = _INDEX_PREAMBLE.size + 12 * n_sequences + 8 * n_documents
    if idx_size < expected:
        raise UserError(
            f"{idx_path}: {idx_size} bytes, expected {expected} for {n_sequences} sequences and "
            f"{n_documents} document boundaries (truncated?)"
        )
    return code, n_sequences, n_documents


DTYPE_CODES: dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                                7: np.float32, 8: np.uint16}
"""Megatron-Core's token dtype codes (its ``indexed_dataset.DType``, tested equal), stated here so
that a worker reads and writes datasets without importing Megatron (and torch: seconds per process)."""

READ_BLOCK = 1 << 16
"""Entries :meth:`IndexReader.tokens` reads at a time (256 KB of lengths)."""


class IndexReader:
    """An ``.idx``'s arrays read block by block from the file (no memory map: mapped pages count
    in a process's resident memory, which would grow with the index); the header read and checked
    by :func:`read_index_header`. Used by the corpus-scale preprocessing (``indexed_writer``'s
    merge, a shard's token count), which imports no Megatron."""

    def __init__(self, prefix: str) -> None:
        self.path = prefix + ".idx"
        code, self.sequences, self.documents = read_index_header(self.path)
        if code not in DTYPE_CODES:
            raise UserError(f"{self.path}: unknown token dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])

    def _read(self, offset: int, dtype, start: int, stop: int) -> np.ndarray:
        with open(self.path, "rb") as f:
            f.seek(offset + start * np.dtype(dtype).itemsize)
            return np.fromfile(f, dtype=dtype, count=stop - start)

    def lengths(self, start: int, stop: int) -> np.ndarray:
        """Sequence lengths ``[start, stop)``."""
        return self._read(INDEX_ARRAYS_OFFSET, np.int32, start, stop)

    def document_starts(self, start: int, stop: int) -> np.ndarray:
        """Document boundaries ``[start, stop)`` (0 first, the sequence count last): after the
        ``int32`` lengths and the ``int64`` pointers, 12 bytes a sequence."""
        return self._read(INDEX_ARRAYS_OFFSET + 12 * self.sequences, np.int64, start, stop)

    def tokens(self, block: int = READ_BLOCK) -> int:
        """The dataset's token count, its lengths read ``block`` at a time."""
        return sum(int(self.lengths(i, min(i + block, self.sequences)).sum(dtype=np.int64))
                   for i in range(0, self.sequences, block))


def read_index(prefix: str) -> IndexFile:
    """Check ``prefix``'s ``.idx`` header and sizes and its ``.bin`` size, as Megatron will read them."""
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType, _IndexReader

    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    if (problem := missing_prefix_problem(prefix)) is not None:
        raise UserError(f"data_path {prefix!r}: {problem}")
    code, n_sequences, _ = read_index_header(idx_path, header=_INDEX_HEADER)
    try:
        dtype = np.dtype(DType.dtype_from_code(code))
    except ValueError:
        raise UserError(f"{idx_path}: unknown token dtype code {code}") from None
    # The arrays as Megatron-Core reads them (its IndexedDataset's reader; the dataset itself asserts
    # on a corrupt document index instead of naming the file, so the checks below come first).
    index = _IndexReader(idx_path, multimodal=False)
    lengths, pointers = index.sequence_lengths, index.sequence_pointers
    documents = np.array(index.document_indices)  # kept: the reader's buffer closes when it is collected
    if n_sequences and int(lengths.min()) < 0:
        bad = int(np.flatnonzero(lengths < 0)[0])
        raise UserError(f"{idx_path}: corrupt index: sequence {bad} has length {int(lengths[bad])}")
    tokens_before = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    n_tokens = int(tokens_before[-1])
    bin_size = os.path.getsize(bin_path)
    if bin_size != n_tokens * dtype.itemsize:
        raise UserError(
            f"{bin_path}: {bin_size} bytes, but {idx_path} lists {n_tokens} {dtype.name} tokens = "
            f"{n_tokens * dtype.itemsize} bytes (truncated, or not the pair of this index?)"
        )
    _check_document_indices(idx_path, documents, n_sequences)
    # Megatron reads sequence i at byte pointers[i] of the .bin; its writer lays sequences end to
    # end, so each pointer is the byte size of everything before it. Anything else (a zeroed or
    # random pointer area) would read other documents' tokens, or past the file.
    expected_pointers = tokens_before[:-1] * dtype.itemsize
    wrong = np.flatnonzero(pointers != expected_pointers)
    if wrong.size:
        sequence = int(wrong[0])
        document = int(np.searchsorted(documents, sequence, side="right")) - 1
        raise UserError(
            f"{idx_path}: corrupt index: sequence {sequence} (document {document}) points at byte "
            f"{int(pointers[sequence])} of {bin_path}, expected {int(expected_pointers[sequence])} "
            f"({wrong.size} of {n_sequences} pointers wrong); re-run tools/preprocess_data.py or copy the file again"
        )
    return IndexFile(prefix=prefix, dtype=dtype, tokens_before=tokens_before, document_indices=documents)


def _check_document_indices(idx_path: str, documents: np.ndarray, n_sequences: int) -> None:
    """Document boundaries: 0 first, the sequence count last, never decreasing."""
    if documents.size == 0 or int(documents[0]) != 0 or int(documents[-1]) != n_sequences:
        ends = (int(documents[0]), int(documents[-1])) if documents.size else "none"
        raise UserError(f"{idx_path}: corrupt index: document boundaries must run from 0 to the sequence count "
                         f"{n_sequences}, got {ends}")
    falling = np.flatnonzero(np.diff(documents) < 0)
    if falling.size:
        document = int(falling[0]) + 1
        raise UserError(f"{idx_path}: corrupt index: document {document} starts at sequence "
                         f"{int(documents[document])}, before document {document - 1} "
                         f"(sequence {int(documents[document - 1])})")


def check_token_dtype(index: IndexFile, tokenizer: EncoderTokenizer) -> None:
    dtype = index.dtype
    if dtype.kind not in "iu" or np.iinfo(dtype).max < tokenizer.vocab_size - 1:
        raise UserError(
            f"{index.prefix}.bin: token dtype {dtype.name} cannot hold the ids [0, {tokenizer.vocab_size}) "
            f"of tokenizer {tokenizer.name}; the data was made with another tokenizer?"
        )


def scan_token_ids(index: IndexFile, tokenizer: EncoderTokenizer) -> None:
    """Fail on any id outside ``[0, vocab_size)`` in the whole ``.bin``, naming its document."""
    n_tokens = int(index.tokens_before[-1])
    if n_tokens == 0:
        return
    tokens = np.memmap(index.prefix + ".bin", mode="r", dtype=index.dtype, shape=(n_tokens,))
    vocab = tokenizer.vocab_size
    if int(tokens.max()) < vocab and int(tokens.min()) >= 0:
        return
    position = int(np.flatnonzero((tokens >= vocab) | (tokens < 0))[0])
    sequence = int(np.searchsorted(index.tokens_before, position, side="right")) - 1
    document = int(np.searchsorted(index.document_indices, sequence, side="right")) - 1
    raise UserError(
        f"{index.prefix}.bin: token id {int(tokens[position])} (document {document}, token "
        f"{position - int(index.tokens_before[sequence])} of its sequence {sequence}) is outside the vocab "
        f"[0, {vocab}) of tokenizer {tokenizer.name}; the data was made with another tokenizer?"
    )
