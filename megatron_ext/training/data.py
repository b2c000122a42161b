"""The training data pipeline: Megatron-Core ``GPTDataset`` splits and data-parallel micro-batches.

Datasets are built by Megatron-Core's own code (``BlendedMegatronDatasetBuilder`` + ``GPTDataset``)
from ``--data-path``/``--split`` exactly as Megatron-LM does, so sample order, blending and the index
caches agree with it. With ``torch.distributed`` initialised the builder builds the caches on global
rank 0 first and the other ranks load them after a barrier (the cache directory must then be
shared); without it, the one process builds them.

Before Megatron reads anything, every ``.bin``/``.idx`` pair is checked, because Megatron's own
failures are asserts, garbage samples or a hang: missing files, a bad index header, a ``.bin`` whose
size disagrees with its index, a token dtype that cannot hold the tokenizer's ids, ids outside the
vocab (a whole-file scan for small datasets, a per-batch check always), and a split that gets no
tokens (``GPTDataset`` loops forever in ``_get_num_epochs`` on one).

Batches follow Megatron's ``MegatronPretrainingSampler``: global batch ``k`` is samples
``[k * global_batch_size, (k + 1) * global_batch_size)`` of the dataset order, cut into chunks of
``micro_batch_size * dp_size`` consecutive samples, data-parallel rank ``r`` taking the ``r``-th
``micro_batch_size`` slice of each chunk.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from megatron_ext.config_loading import UserError
from megatron_ext.training.config import DataConfig, split_proportions
from megatron_ext.tokenizer import EncoderTokenizer, MissingSpecialTokenError

if TYPE_CHECKING:
    from torch.utils.data import Dataset  # a Megatron GPTDataset or BlendedDataset

SPLIT_NAMES = ("train", "valid", "test")
_INDEX_PREAMBLE = struct.Struct("<9sQBQQ")  # header, version, dtype code, sequences, documents


# --- validating .bin/.idx pairs ---------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _Index:
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
    of the header: the data checks (:func:`_read_index`) and the dry run's document lengths use it."""
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


def _read_index(prefix: str) -> _Index:
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
    return _Index(prefix=prefix, dtype=dtype, tokens_before=tokens_before, document_indices=documents)


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


def _check_token_dtype(index: _Index, tokenizer: EncoderTokenizer) -> None:
    dtype = index.dtype
    if dtype.kind not in "iu" or np.iinfo(dtype).max < tokenizer.vocab_size - 1:
        raise UserError(
            f"{index.prefix}.bin: token dtype {dtype.name} cannot hold the ids [0, {tokenizer.vocab_size}) "
            f"of tokenizer {tokenizer.name}; the data was made with another tokenizer?"
        )


def _scan_token_ids(index: _Index, tokenizer: EncoderTokenizer) -> None:
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


def _split_ranges(split: str, n_sequences: int) -> list[tuple[int, int] | None]:
    """The sequence ranges Megatron gives each split (None: the split has no share)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    # The rounding of BlendedMegatronDatasetBuilder._build_megatron_dataset_splits.
    n = float(n_sequences)
    return [None if b is None else (int(round(b[0] * n)), int(round(b[1] * n))) for b in matrix]


def _short_splits(split: str, indexes: list[_Index], min_tokens: int) -> list[str]:
    """One line per (prefix, split) that would get fewer than ``min_tokens`` tokens."""
    problems = []
    for index in indexes:
        tokens_before = index.tokens_before
        n = len(tokens_before) - 1
        for name, bounds in zip(SPLIT_NAMES, _split_ranges(split, n)):
            if bounds is not None and tokens_before[bounds[1]] - tokens_before[bounds[0]] < min_tokens:
                n_tokens = int(tokens_before[bounds[1]] - tokens_before[bounds[0]])
                problems.append(
                    f"{index.prefix}: {name} gets sequences [{bounds[0]}, {bounds[1]}) of {n} "
                    f"= {n_tokens} tokens"
                )
    return problems


def _suggest_split(split: str, indexes: list[_Index], min_tokens: int) -> str:
    shared = [i for i, share in enumerate(split_proportions(split)[1:3], start=1) if share > 0]
    for percent in range(1, 100 // (len(shared) + 1) + 1):
        candidate = [100 - percent * len(shared), *(percent if i in shared else 0 for i in (1, 2))]
        candidate_split = ",".join(map(str, candidate))
        if not _short_splits(candidate_split, indexes, min_tokens):
            return f"--split {candidate_split}"
    return "--split 100,0,0 with eval_iters 0, or more data"


def _check_splits(config: DataConfig, indexes: list[_Index], *, weighted: bool) -> None:
    # A weighted (or single) dataset repeats its split until it has the samples asked for: it needs
    # one token (zero tokens never reach enough: the hang). An unweighted blend takes one pass over
    # each split, and Megatron asserts when one of them yields no whole sample.
    min_tokens = 1 if weighted or len(indexes) == 1 else config.seq_length + 1
    problems = _short_splits(config.split, indexes, min_tokens)
    if problems:
        need = (
            "some tokens (GPTDataset never finishes building an empty split)" if min_tokens == 1
            else f"seq_length + 1 = {min_tokens} tokens (one sample; an unweighted blend is one pass)"
        )
        raise UserError(
            f"split {config.split!r}: each split with a share needs {need} in every dataset, split by "
            "sequence (documents, or sentences with --split-sentences): " + "; ".join(problems)
            + f". Try {_suggest_split(config.split, indexes, min_tokens)}"
        )


# --- building -----------------------------------------------------------------------------------


def document_end_id(config: DataConfig, tokenizer: EncoderTokenizer) -> int:
    """The tokenizer's end-of-document id, which every sample ends documents with and
    ``reset_attention_mask`` isolates documents at; a tokenizer without one is refused in one line
    naming the setting that needs it."""
    try:
        return tokenizer.eod
    except MissingSpecialTokenError as err:
        need = ("data.reset_attention_mask (documents end at it)" if config.reset_attention_mask
                else "GPTDataset (it ends every document)")
        raise MissingSpecialTokenError(f"{need} needs an end-of-document token: {err}") from None


def _files_fingerprint(prefixes: list[str]) -> str:
    """Short hash of the data files' sizes and modification times.

    Megatron keys its index caches by path, seed and split only, so re-preprocessing into the same
    prefix would silently reuse indices built for the old files; a cache folder per fingerprint
    avoids that.
    """
    digest = hashlib.sha1()
    for prefix in prefixes:
        for suffix in (".bin", ".idx"):
            stat = os.stat(prefix + suffix)
            digest.update(f"{os.path.abspath(prefix)}{suffix}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return digest.hexdigest()[:12]


def build_datasets(
    config: DataConfig, *, tokenizer: EncoderTokenizer, train_samples: int, valid_samples: int, seed: int,
    test_samples: int = 0,
) -> tuple[Dataset, Dataset | None, Dataset | None]:
    """Megatron-Core ``GPTDataset`` (or ``BlendedDataset``) train, valid and test splits, as
    Megatron's ``BlendedMegatronDatasetBuilder`` returns them.

    ``train_samples``/``valid_samples``/``test_samples`` are the samples that will be read (e.g.
    train_iters x global_batch_size, eval_iters x global_batch_size for both evaluations); each
    dataset has at least that many. Returns ``(train, valid, test)``; valid is None when ``split``
    gives it no share (then ``valid_samples`` must be 0), test likewise (``test_samples`` is then
    ignored: a split without a test share has nothing to evaluate at the end). Must be called on
    every rank when ``torch.distributed`` is initialised (the builder synchronises the ranks with
    barriers). ``seed`` (the run's ``training.seed``) seeds Megatron's document and sample shuffling.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    if train_samples < 1:
        raise UserError(f"train_samples: expected >= 1, got {train_samples}")
    for name, samples in (("valid_samples", valid_samples), ("test_samples", test_samples)):
        if samples < 0:
            raise UserError(f"{name}: expected >= 0, got {samples}")
    document_end_id(config, tokenizer)  # GPTDataset needs the EOD for every sample; raises with the fix
    prefixes, weights = config.blend
    indexes = [_read_index(prefix) for prefix in prefixes]
    for index in indexes:
        _check_token_dtype(index, tokenizer)
        if int(index.tokens_before[-1]) <= config.max_tokens_to_scan:
            _scan_token_ids(index, tokenizer)
    _check_splits(config, indexes, weighted=weights is not None)

    cache = config.data_cache_path or os.path.join(
        os.path.dirname(os.path.abspath(prefixes[0])), "cache", _files_fingerprint(prefixes)
    )
    gpt_config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=config.seq_length,
        blend=(prefixes, weights),
        split=config.split,
        path_to_cache=cache,
        tokenizer=tokenizer,
        reset_position_ids=config.reset_position_ids,
        reset_attention_mask=config.reset_attention_mask,
        eod_mask_loss=config.eod_mask_loss,
        # No [s, s] mask per sample: the model reads the documents from the tokens' EODs
        # (model.attention.document_cu_seqlens), with data.reset_attention_mask.
        create_attention_mask=False,
    )
    if gpt_config.split_matrix[1] is None and valid_samples > 0:
        raise UserError(
            f"split {config.split!r} gives the valid split no share, but valid_samples={valid_samples}; "
            "give it a share (e.g. 98,2,0) or set data.eval_iters: 0 (no validation)"
        )
    # A size for every split, 0 rather than None: Megatron asserts that weighted blends get one.
    sizes = [train_samples, valid_samples, test_samples if gpt_config.split_matrix[2] is not None else 0]
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, gpt_config).build()
    for name, dataset, wanted in zip(SPLIT_NAMES, (train, valid, test), sizes):
        if dataset is not None and len(dataset) < wanted:
            # Only unweighted blends stop short: Megatron caps them at one pass over each dataset.
            raise UserError(
                f"data_path: the {name} blend has {len(dataset)} samples, {wanted} are needed; an "
                "unweighted blend is one pass over its datasets: give weights to repeat them"
            )
    return train, valid, test


FINAL_EPOCH_APART_BELOW = 0.80
"""``GPTDataset``'s threshold (``_build_document_sample_shuffle_indices``, megatron-core 0.19.2): a
final epoch read for less than this share of its samples is shuffled apart from the others."""


def sample_order(config: DataConfig, *, train_samples: int) -> tuple[tuple[str, int, bool], ...]:
    """What the order of the training samples depends on through the run length: per dataset of the
    blend, ``(prefix, epochs, final epoch shuffled apart)`` of the ``GPTDataset`` that
    ``build_datasets`` builds for ``train_samples`` samples.

    Megatron's document, sample and shuffle indices are functions of the split's documents, the
    sequence length, the seed and these two numbers (``_build_document_sample_shuffle_indices``:
    the documents are shuffled over ``epochs`` copies, the last one apart when it is read for less
    than ``FINAL_EPOCH_APART_BELOW`` of it); a blend interleaves its datasets the same way at any
    length (Megatron's greedy ``build_blending_indices`` is prefix-stable), each asked for its
    weight's share plus Megatron's surplus, and an unweighted blend reads one pass over each
    whatever the length. So two lengths of a run with the same data, split, sequence length and
    seed read the same samples in the same order up to the shorter one exactly when their keys
    are equal. Computed from the ``.idx`` files (checked as ``build_datasets`` checks them),
    without building Megatron's indices.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import _get_size_per_split_per_dataset
    from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.datasets.utils import normalize

    prefixes, weights = config.blend
    if weights is None and len(prefixes) > 1:  # Megatron builds one pass over each, at any length
        return tuple((prefix, 1, False) for prefix in prefixes)
    if weights is None:
        samples = [train_samples]
    else:
        surplus = BlendedMegatronDatasetConfig.__dataclass_fields__["mid_level_dataset_surplus"].default
        samples = [per_split[0] for per_split in _get_size_per_split_per_dataset(
            normalize(weights), [train_samples, 0, 0], surplus=surplus)]
    extra = int(GPTDatasetConfig.__dataclass_fields__["add_extra_token_to_sequence"].default)
    length = config.seq_length
    order = []
    for prefix, wanted in zip(prefixes, samples):
        index = _read_index(prefix)
        begin, end = _split_ranges(config.split, len(index.tokens_before) - 1)[0]
        tokens = int(index.tokens_before[end] - index.tokens_before[begin])  # one epoch (GPTDataset)
        if tokens == 0:
            raise UserError(f"data_path {prefix!r}: the train split of {config.split!r} holds no tokens")
        epochs = max(1, -(-(wanted * length + extra) // tokens))  # GPTDataset._get_num_epochs
        apart = False
        if epochs > 1:
            from_final = wanted - ((epochs - 1) * tokens - extra) // length
            apart = from_final < int(FINAL_EPOCH_APART_BELOW * ((tokens - extra) // length))
        order.append((prefix, epochs, apart))
    return tuple(order)


# --- iterating ---------------------------------------------------------------------------------


class _MicroBatchSampler:
    """``MegatronPretrainingSampler`` over whole global batches in ``[start, stop)``."""

    def __init__(self, *, start: int, stop: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> None:
        self.start, self.stop = start, stop
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __iter__(self) -> Iterator[list[int]]:
        for chunk in range(self.start, self.stop, self.micro_batch_size * self.dp_size):
            first = chunk + self.dp_rank * self.micro_batch_size
            yield list(range(first, first + self.micro_batch_size))

    def __len__(self) -> int:
        return (self.stop - self.start) // (self.micro_batch_size * self.dp_size)


def _micro_batches(dataset: Dataset, sampler: _MicroBatchSampler, config: DataConfig) -> Iterator[dict]:
    import torch

    from megatron_ext import hardware

    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=config.num_workers,
        pin_memory=hardware.on_gpu(),
    )
    tokenizer = dataset.config.tokenizer
    for indices, batch in zip(sampler, loader, strict=True):
        for key in ("tokens", "labels"):
            ids = batch[key]
            if int(ids.max()) >= tokenizer.vocab_size or int(ids.min()) < 0:
                row = int(((ids >= tokenizer.vocab_size) | (ids < 0)).any(dim=1).nonzero()[0])
                bad = ids[row][(ids[row] >= tokenizer.vocab_size) | (ids[row] < 0)][0]
                raise UserError(
                    f"token id {int(bad)} in {key} of {dataset.index_split.name} sample {indices[row]}, "
                    f"from {_source(dataset, indices[row])}, is outside the vocab "
                    f"[0, {tokenizer.vocab_size}) of tokenizer {tokenizer.name}; the data was made with "
                    "another tokenizer?"
                )
        yield batch


def blend_shares(config: DataConfig, train: Dataset | None, *, train_samples: int) -> list[dict]:
    """Per dataset of the blend, in ``data_path`` order: ``{"prefix", "weight", "share"}``, the
    weight normalised (None for an unweighted blend) and the share of the run's ``train_samples``
    training samples it gives (Megatron's blending index, read as the run will read it; None without
    ``train``: a run whose phases read other lengths builds a dataset per length as it reaches it)."""
    prefixes, weights = config.blend
    total = sum(weights) if weights else None
    if train is None:
        shares = [None] * len(prefixes)
    elif hasattr(train, "dataset_index"):  # BlendedDataset
        read = np.asarray(train.dataset_index[:train_samples])  # its datasets in data_path's order
        shares = (np.bincount(read, minlength=len(prefixes)) / len(read)).tolist()
    else:
        shares = [1.0]
    return [{"prefix": prefix, "weight": None if total is None else weights[i] / total, "share": shares[i]}
            for i, prefix in enumerate(prefixes)]


def format_blend(shares: list[dict], *, train_samples: int) -> str:
    """One line: each dataset's weight and realised share of the training samples."""
    return f"blend of {len(shares)} datasets over {train_samples:,} training samples: " + ", ".join(
        f"{os.path.basename(entry['prefix'])} "
        + ("" if entry["weight"] is None else f"weight {100 * entry['weight']:.1f}% -> ")
        + ("(share read per phase length)" if entry["share"] is None else f"{100 * entry['share']:.1f}%")
        for entry in shares)


def _source(dataset: Dataset, index: int) -> str:
    """The dataset path behind sample ``index`` of a GPTDataset or BlendedDataset."""
    if hasattr(dataset, "dataset_index"):  # BlendedDataset
        return dataset.datasets[int(dataset.dataset_index[index])].dataset_path
    return dataset.dataset_path


def _check_dp(config: DataConfig, dp_rank: int, dp_size: int) -> None:
    """The rank is one of the group's. That ``global_batch_size`` divides by ``micro_batch_size x
    dp_size`` is the pre-flight's rule (``training.layout.check_layout``, checked before a run
    starts)."""
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise UserError(f"dp_rank {dp_rank} / dp_size {dp_size}: expected 0 <= dp_rank < dp_size")


def build_train_iterator(
    dataset: Dataset, *, config: DataConfig, dp_rank: int, dp_size: int, consumed_samples: int
) -> Iterator[dict]:
    """Micro-batches of data-parallel rank ``dp_rank`` from sample ``consumed_samples`` on.

    Each is GPTDataset's samples collated: ``tokens``, ``labels``, ``loss_mask``, ``position_ids``
    (``[micro_batch_size, seq_length]``), plus ``dataset_id`` for blends. Every step takes ``global_batch_size / (micro_batch_size * dp_size)``
    micro-batches; resuming with ``consumed_samples = steps * global_batch_size`` continues exactly
    where an uninterrupted run would be. Ends after the last whole global batch of ``dataset``.
    """
    _check_dp(config, dp_rank, dp_size)
    gbs = config.global_batch_size
    stop = len(dataset) // gbs * gbs
    if consumed_samples < 0 or consumed_samples % gbs:
        raise UserError(
            f"consumed_samples: expected a multiple of global_batch_size {gbs} (steps x {gbs}), "
            f"got {consumed_samples}"
        )
    if consumed_samples >= stop:
        raise UserError(
            f"consumed_samples {consumed_samples}: the train dataset has only {stop // gbs} global batches "
            f"of {gbs}; build it with more train_samples"
        )
    sampler = _MicroBatchSampler(
        start=consumed_samples, stop=stop, micro_batch_size=config.micro_batch_size,
        dp_rank=dp_rank, dp_size=dp_size,
    )
    return _micro_batches(dataset, sampler, config)


def build_valid_iterator(
    dataset: Dataset | None, *, config: DataConfig, dp_rank: int, dp_size: int, split: str = "valid"
) -> Iterator[dict]:
    """Micro-batches of one evaluation: the first ``eval_iters`` global batches of ``dataset``, the
    ``split`` (``valid``, or ``test``: evaluated once, at the end of training) of ``build_datasets``.

    Call it once per evaluation: every evaluation then sees the same samples (unlike Megatron-LM,
    whose validation iterator moves on), so evaluation losses are comparable over training.
    """
    _check_dp(config, dp_rank, dp_size)
    stop = config.eval_iters * config.global_batch_size
    if stop == 0:
        return iter(())
    if dataset is None or len(dataset) < stop:
        have = f"no {split} dataset" if dataset is None else f"{len(dataset)} {split} samples"
        raise UserError(
            f"eval_iters {config.eval_iters} x global_batch_size {config.global_batch_size} = {stop} "
            f"samples needed, {have}; build with {split}_samples >= {stop} and a split with a {split} share"
        )
    sampler = _MicroBatchSampler(
        start=0, stop=stop, micro_batch_size=config.micro_batch_size, dp_rank=dp_rank, dp_size=dp_size
    )
    return _micro_batches(dataset, sampler, config)


def build_phase_iterator(dataset: Dataset, *, reads: list[tuple[int, int, int, int]], config: DataConfig,
                         dp_rank: int, dp_size: int) -> Iterator[dict]:
    """Micro-batches of data-parallel rank ``dp_rank`` over consecutive sample ranges of ``dataset``,
    each ``(micro_batch_size, global_batch_size, start, stop)``: the phases of one sequence length
    (``training.context``), which may differ in batch sizes. Global batch ``k`` of a range is its
    samples ``[start + k x global_batch_size, ...)``, cut as ``build_train_iterator`` cuts them."""
    _check_dp(config, dp_rank, dp_size)
    for micro_batch_size, global_batch_size, start, stop in reads:
        if (stop - start) % global_batch_size or start < 0:
            raise ValueError(f"samples [{start}, {stop}) are not whole global batches of {global_batch_size}")
        if stop > len(dataset):
            raise UserError(f"the train dataset has {len(dataset)} samples, samples up to {stop} are needed; "
                            "build it with more train_samples")
        sampler = _MicroBatchSampler(start=start, stop=stop, micro_batch_size=micro_batch_size,
                                     dp_rank=dp_rank, dp_size=dp_size)
        yield from _micro_batches(dataset, sampler, config)
