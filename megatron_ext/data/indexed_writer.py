"""A Megatron-Core ``.bin``/``.idx`` writer whose memory does not grow with the document count.

Megatron's ``IndexedDatasetBuilder`` keeps every sequence length and document boundary in Python
lists until ``finalize`` (~80 bytes a document while writing, more at the final write: hundreds of
GB for the billions of documents of a 10 TB corpus). This writer appends them to two side files as
it goes (``<idx>.lengths``, ``<idx>.documents``, a bounded buffer in memory) and streams the index
from them at :meth:`IndexedWriter.finalize`, block by block. The bytes are Megatron's (tested equal
with its builder): header, version 1, dtype code, counts, ``int32`` sequence lengths, ``int64``
sequence pointers (bytes before each sequence), ``int64`` document starts (0 first, the sequence
count last).

:func:`merge_indexed` concatenates finished pairs into one through the same writer: the ``.bin``
files copied, the index arrays read (``index_checks.IndexReader``) and shifted block by block.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Sequence

import numpy as np

from megatron_ext.config_loading import UserError
from megatron_ext.data.index_checks import DTYPE_CODES, INDEX_HEADER, IndexReader

BLOCK = 1 << 16
"""Entries buffered, and streamed, per block (256-512 KB): the writer's whole memory."""


def optimal_dtype(vocab_size: int | None) -> type:
    """The token dtype Megatron's ``DType.optimal_dtype`` picks (tested equal): uint16 below 65,500 ids."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def _dtype_code(dtype: np.dtype) -> int:
    return next(code for code, kind in DTYPE_CODES.items() if np.dtype(kind) == np.dtype(dtype))


class IndexedWriter:
    """Writes ``bin_path`` as documents come and ``idx_path`` at :meth:`finalize`; the side files
    beside ``idx_path`` are removed by :meth:`finalize` and :meth:`close`."""

    def __init__(self, bin_path: str, idx_path: str, dtype) -> None:
        self.dtype = np.dtype(dtype)
        self.idx_path = idx_path
        self.side_paths = (idx_path + ".lengths", idx_path + ".documents")
        self.data_file = open(bin_path, "wb")
        self._lengths_file = open(self.side_paths[0], "wb")
        self._documents_file = open(self.side_paths[1], "wb")
        self._lengths = np.empty(BLOCK, dtype=np.int32)
        self._documents = np.empty(BLOCK, dtype=np.int64)
        self._n_lengths = self._n_documents = 0
        self.sequences = 0
        """Sequences written so far."""
        self.documents = 0
        """Documents written so far."""

    def add_document(self, ids: np.ndarray, lengths: Sequence[int]) -> None:
        """One document: its tokens and its sequences' lengths (one per sentence, or one)."""
        self.data_file.write(np.asarray(ids, dtype=self.dtype).tobytes(order="C"))
        lengths = np.asarray(lengths, dtype=np.int32)
        if self._n_lengths + len(lengths) > BLOCK or self._n_documents == BLOCK:
            self._flush()
        if len(lengths) > BLOCK:  # a document of more sentences than a block: straight to the side file
            self._lengths_file.write(lengths.tobytes())
        else:
            self._lengths[self._n_lengths:self._n_lengths + len(lengths)] = lengths
            self._n_lengths += len(lengths)
        self.sequences += len(lengths)
        self.documents += 1
        self._documents[self._n_documents] = self.sequences
        self._n_documents += 1

    def add_index(self, lengths: np.ndarray, document_ends: np.ndarray) -> None:
        """Many documents whose tokens were written to :attr:`data_file` by the caller: their
        sequence lengths and each one's end (in sequences, counted from the first of ``lengths``)."""
        self._flush()
        self._lengths_file.write(np.asarray(lengths, dtype=np.int32).tobytes())
        self._documents_file.write((np.asarray(document_ends, dtype=np.int64) + self.sequences).tobytes())
        self.sequences += len(lengths)
        self.documents += len(document_ends)

    def _flush(self) -> None:
        self._lengths_file.write(self._lengths[:self._n_lengths].tobytes())
        self._documents_file.write(self._documents[:self._n_documents].tobytes())
        self._n_lengths = self._n_documents = 0

    def finalize(self) -> None:
        """Close the ``.bin`` and write the ``.idx``, streaming the side files."""
        self._flush()
        for f in (self.data_file, self._lengths_file, self._documents_file):
            f.close()
        itemsize = self.dtype.itemsize
        with open(self.idx_path, "wb") as out:
            out.write(INDEX_HEADER + struct.pack("<QBQQ", 1, _dtype_code(self.dtype), self.sequences, self.documents + 1))
            with open(self.side_paths[0], "rb") as f:
                shutil.copyfileobj(f, out, BLOCK * 4)
            start = 0
            for lengths in _blocks(self.side_paths[0], np.int32):
                ends = np.cumsum(lengths, dtype=np.int64) * itemsize + start
                out.write(np.concatenate([[start], ends[:-1]]).astype(np.int64).tobytes())
                start = int(ends[-1])
            out.write(np.zeros(1, dtype=np.int64).tobytes())
            with open(self.side_paths[1], "rb") as f:
                shutil.copyfileobj(f, out, BLOCK * 8)
        self.close()

    def close(self) -> None:
        """Close every file and remove the side files (the ``.bin`` and ``.idx`` stay)."""
        for f in (self.data_file, self._lengths_file, self._documents_file):
            f.close()
        for path in self.side_paths:
            if os.path.exists(path):
                os.unlink(path)


def _blocks(path: str, dtype) -> "np.ndarray":
    """The array stored in ``path``, block by block."""
    with open(path, "rb") as f:
        while chunk := f.read(BLOCK * np.dtype(dtype).itemsize):
            yield np.frombuffer(chunk, dtype=dtype)


def merge_indexed(prefixes: Sequence[str], bin_path: str, idx_path: str) -> tuple[int, int]:
    """Concatenate the datasets ``prefixes`` (same token dtype), in order, into ``bin_path`` and
    ``idx_path``; returns ``(documents, tokens)``. Memory: one block, whatever the sizes."""
    readers = [IndexReader(prefix) for prefix in prefixes]
    if len({reader.dtype for reader in readers}) > 1:
        raise UserError("merge: the shards have different token dtypes: "
                        + ", ".join(f"{p} {r.dtype.name}" for p, r in zip(prefixes, readers)))
    writer = IndexedWriter(bin_path, idx_path, readers[0].dtype)
    tokens = 0
    try:
        for prefix, reader in zip(prefixes, readers):
            with open(prefix + ".bin", "rb") as f:
                shutil.copyfileobj(f, writer.data_file, BLOCK * 16)
            tokens += reader.tokens(BLOCK)
            for start in range(1, reader.documents, BLOCK):  # the first boundary, 0, ends no document
                bounds = reader.document_starts(start - 1, min(start + BLOCK, reader.documents))
                first = int(bounds[0])
                writer.add_index(reader.lengths(first, int(bounds[-1])), bounds[1:] - first)
        writer.finalize()
    finally:
        writer.close()
    return writer.documents, tokens
