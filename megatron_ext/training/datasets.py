"""The run's datasets, behind a seam: a dataset provider builds the train, valid and test splits
for the run's data config; Megatron-Core's ``GPTDataset`` is the default.

A provider (:class:`DatasetProvider`) is what ``training.loop.pretrain`` takes, as torchtitan's
train spec names its dataloader builder and Megatron-Bridge's dataset providers build a run's
datasets: the trainer asks it for splits of so many samples and for the blend report, and reads
the splits in micro-batches itself (``training.samplers``), so sample order per step, resumes and
data parallelism are the trainer's, whatever the provider.

The default, :data:`GPT_DATASETS`, builds Megatron-Core's own datasets
(``BlendedMegatronDatasetBuilder`` + ``GPTDataset``) from ``--data-path``/``--split`` exactly as
Megatron-LM does, so sample order, blending and the index caches agree with it. With
``torch.distributed`` initialised the builder builds the caches on global rank 0 first and the
other ranks load them after a barrier (the cache directory must then be shared); without it, the
one process builds them. Before Megatron reads anything, every ``.bin``/``.idx`` pair is checked
(``data.index_checks``), and so is each split: one that gets no tokens would never finish building
(``GPTDataset`` loops forever in ``_get_num_epochs`` on one).

What the splits' checks, the sample order key and the streams read of Megatron-Core beyond its
documented use (private helpers, formulas, thresholds) is in ``megatron_compat.datasets``, checked
against one release.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from megatron_ext.config_loading import UserError
from megatron_ext.data.index_checks import IndexFile, check_token_dtype, read_index, scan_token_ids
from megatron_ext.megatron_compat.datasets import (
    blending_index,
    build_one_epoch,
    gpt_dataset_epochs,
    samples_per_epoch,
    split_ranges,
    weighted_train_samples,
)
from megatron_ext.training.config import DataConfig, split_proportions
from megatron_ext.training.context import DatasetSpan
from megatron_ext.training.mixtures import SpanReads, check_enough_data, epoch_seed, plan_reads
from megatron_ext.tokenizer import EncoderTokenizer, MissingSpecialTokenError

if TYPE_CHECKING:
    from torch.utils.data import Dataset  # a Megatron GPTDataset or BlendedDataset, or a provider's

SPLIT_NAMES = ("train", "valid", "test")


class DatasetProvider(Protocol):
    """What the trainer asks of the run's data: its splits, and the blend report of the training one.

    The datasets it returns are sized, map a sample index to GPTDataset's sample (``tokens``,
    ``labels``, ``loss_mask``, ``position_ids``, each ``data.seq_length`` long, as numpy arrays or
    tensors), and say, as Megatron's datasets do, the tokenizer their ids are of
    (``config.tokenizer``) and where they come from (``dataset_path``; a Megatron ``BlendedDataset``
    names its datasets'): ``training.samplers`` checks every batch's ids against the vocab and
    names the sample's source when one is outside it.

    The first two serve every run. :meth:`plan_source_reads` and :meth:`build_span_dataset` serve
    a run whose phases set their own ``data_path`` or ``temperature`` (``training.mixtures``): the
    trainer plans the spans once at start and builds each span's dataset at its first step. The
    dry run plans with the default provider (the module's :func:`plan_source_reads`), whatever
    provider a run is given."""

    def build_datasets(
        self, config: DataConfig, *, tokenizer: EncoderTokenizer, train_samples: int, valid_samples: int,
        seed: int, test_samples: int = 0,
    ) -> tuple[Dataset, Dataset | None, Dataset | None]:
        """``(train, valid, test)`` with at least ``train_samples``, ``valid_samples`` and
        ``test_samples`` samples, in an order that ``seed`` (the run's ``training.seed``) decides
        and is the same at every call with the same arguments (a resume rebuilds them). None for a
        split the data gives no share: the valid split's then needs ``valid_samples`` 0 (refused in
        one line otherwise), the test split's ignores ``test_samples`` (nothing evaluated at the
        end). Called on every rank, with the same arguments."""
        ...

    def blend_shares(self, config: DataConfig, train: Dataset | None, *, train_samples: int) -> list[dict]:
        """Per source of the training data: ``{"prefix", "weight", "share"}`` (the report
        :func:`format_blend` prints and the metrics header records), ``train`` the training split
        or None (shares not known yet: a run whose phases read several lengths); empty for data
        that is not read from ``data.data_path``'s prefixes."""
        ...

    def plan_source_reads(self, config: DataConfig, spans: Sequence[DatasetSpan]) -> tuple[SpanReads, ...]:
        """For a run whose phases set their own data (``training.mixtures``): what each data span
        reads from each source (``mixtures.plan_reads`` carries each source's cursor from span to
        span), each span's ``samples`` its ``last_sample - first_sample``; computed without
        building anything. Called once, on every rank, with the same arguments."""
        ...

    def build_span_dataset(self, config: DataConfig, reads: SpanReads, *, tokenizer: EncoderTokenizer,
                           seed: int) -> Dataset:
        """The samples of one span of :meth:`plan_source_reads` (``reads``), in order, at least
        ``reads.samples`` of them (``config`` at the span's length); the same at every call with
        the same arguments (a resume rebuilds the span it starts in)."""
        ...


# --- checking the splits GPTDataset will cut ------------------------------------------------------


def _short_splits(split: str, indexes: list[IndexFile], min_tokens: int) -> list[str]:
    """One line per (prefix, split) that would get fewer than ``min_tokens`` tokens."""
    problems = []
    for index in indexes:
        tokens_before = index.tokens_before
        n = len(tokens_before) - 1
        for name, bounds in zip(SPLIT_NAMES, split_ranges(split, n)):
            if bounds is not None and tokens_before[bounds[1]] - tokens_before[bounds[0]] < min_tokens:
                n_tokens = int(tokens_before[bounds[1]] - tokens_before[bounds[0]])
                problems.append(
                    f"{index.prefix}: {name} gets sequences [{bounds[0]}, {bounds[1]}) of {n} "
                    f"= {n_tokens} tokens"
                )
    return problems


def _suggest_split(split: str, indexes: list[IndexFile], min_tokens: int) -> str:
    shared = [i for i, share in enumerate(split_proportions(split)[1:3], start=1) if share > 0]
    for percent in range(1, 100 // (len(shared) + 1) + 1):
        candidate = [100 - percent * len(shared), *(percent if i in shared else 0 for i in (1, 2))]
        candidate_split = ",".join(map(str, candidate))
        if not _short_splits(candidate_split, indexes, min_tokens):
            return f"--split {candidate_split}"
    return "--split 100,0,0 with eval_iters 0, or more data"


def _check_splits(config: DataConfig, indexes: list[IndexFile], *, weighted: bool, cut: str | None = None) -> None:
    """Each split ``cut`` (default ``data.split``) gives a share gets enough tokens of each index."""
    # A weighted (or single) dataset repeats its split until it has the samples asked for: it needs
    # one token (zero tokens never reach enough: the hang). An unweighted blend takes one pass over
    # each split, and Megatron asserts when one of them yields no whole sample.
    cut = cut or config.split
    min_tokens = 1 if weighted or len(indexes) == 1 else config.seq_length + 1
    problems = _short_splits(cut, indexes, min_tokens)
    if problems:
        need = (
            "some tokens (GPTDataset never finishes building an empty split)" if min_tokens == 1
            else f"seq_length + 1 = {min_tokens} tokens (one sample; an unweighted blend is one pass)"
        )
        if config.per_split:
            raise UserError(f"each per-split blend needs {need} in every dataset: " + "; ".join(problems))
        raise UserError(
            f"split {cut!r}: each split with a share needs {need} in every dataset, split by "
            "sequence (documents, or sentences with --split-sentences): " + "; ".join(problems)
            + f". Try {_suggest_split(cut, indexes, min_tokens)}"
        )


# --- building GPTDataset ------------------------------------------------------------------------


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


def _gpt_dataset_config(config: DataConfig, tokenizer: EncoderTokenizer, seed: int):
    """Megatron's ``GPTDatasetConfig`` of ``config.data_path`` at ``config.seq_length``."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    blends = [config.split_blend(name) for name in SPLIT_NAMES]
    prefixes = list(dict.fromkeys(prefix for blend in blends if blend for prefix in blend[0]))
    cache = config.data_cache_path or os.path.join(
        os.path.dirname(os.path.abspath(prefixes[0])), "cache", _files_fingerprint(prefixes)
    )
    # With per-split paths, Megatron's blend_per_split (each split's blend read whole, no split).
    where = dict(blend_per_split=blends) if config.per_split else dict(blend=config.blend, split=config.split)
    return GPTDatasetConfig(
        random_seed=seed,
        sequence_length=config.seq_length,
        **where,
        path_to_cache=cache,
        tokenizer=tokenizer,
        reset_position_ids=config.reset_position_ids,
        eod_mask_loss=config.eod_mask_loss,
        # No [s, s] mask per sample, which is all GPTDataset's reset_attention_mask shapes: with
        # data.reset_attention_mask the batches carry where documents end (training.batches), from
        # which the model's attention pattern is built per micro-batch.
        reset_attention_mask=False,
        create_attention_mask=False,
    )


def check_prefix(prefix: str, tokenizer: EncoderTokenizer, *, max_tokens_to_scan: int) -> IndexFile:
    """``prefix``'s index as Megatron will read it (``data.index_checks.read_index``), its token dtype
    able to hold ``tokenizer``'s ids and, at most ``max_tokens_to_scan`` tokens (``data.max_tokens_to_scan``),
    every id within its vocab; each refused in one line naming the file."""
    index = read_index(prefix)
    check_token_dtype(index, tokenizer)
    if int(index.tokens_before[-1]) <= max_tokens_to_scan:
        scan_token_ids(index, tokenizer)
    return index


def check_split_blends(config: DataConfig, tokenizer: EncoderTokenizer) -> None:
    """What :func:`build_datasets` checks before Megatron reads anything: the EOD every sample needs,
    each prefix (:func:`check_prefix`), and that each split with a share gets enough tokens of each."""
    document_end_id(config, tokenizer)  # GPTDataset needs the EOD for every sample; raises with the fix
    for name in SPLIT_NAMES if config.per_split else ("train",):  # one blend cut by data.split, or one each
        if (blend := config.split_blend(name)) is None:
            continue
        prefixes, weights = blend
        indexes = [check_prefix(prefix, tokenizer, max_tokens_to_scan=config.max_tokens_to_scan) for prefix in prefixes]
        _check_splits(config, indexes, weighted=weights is not None,
                      cut=config.split_cut(name) if config.per_split else None)


def phase_validation_data(config: DataConfig, valid_data_path: tuple[str, ...]) -> DataConfig:
    """The data of a phase's own validation blend (``phases[i].valid_data_path``): its valid split as
    ``data.split`` cuts it, or read whole with Megatron's per-split paths."""
    if config.per_split:
        return dataclasses.replace(config, valid_data_path=valid_data_path, test_data_path=())
    return dataclasses.replace(config, data_path=valid_data_path, data_args_path=None)


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
    from megatron.core.datasets.gpt_dataset import GPTDataset

    if train_samples < 1:
        raise UserError(f"train_samples: expected >= 1, got {train_samples}")
    for name, samples in (("valid_samples", valid_samples), ("test_samples", test_samples)):
        if samples < 0:
            raise UserError(f"{name}: expected >= 0, got {samples}")
    check_split_blends(config, tokenizer)
    gpt_config = _gpt_dataset_config(config, tokenizer, seed)
    has_split = [config.split_blend(name) is not None if config.per_split else gpt_config.split_matrix[i] is not None
                 for i, name in enumerate(SPLIT_NAMES)]
    if not has_split[1] and valid_samples > 0:
        raise UserError(
            "no valid_data_path, but valid_samples={valid_samples}; give one or set data.eval_iters: 0"
            if config.per_split else
            f"split {config.split!r} gives the valid split no share, but valid_samples={valid_samples}; "
            "give it a share (e.g. 98,2,0) or set data.eval_iters: 0 (no validation)"
        )
    # A size for every split, 0 rather than None: Megatron asserts that weighted blends get one.
    sizes = [train_samples, valid_samples, test_samples if has_split[2] else 0]
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, gpt_config).build()
    for name, dataset, wanted in zip(SPLIT_NAMES, (train, valid, test), sizes):
        if dataset is not None and len(dataset) < wanted:
            # Only unweighted blends stop short: Megatron caps them at one pass over each dataset.
            raise UserError(
                f"data_path: the {name} blend has {len(dataset)} samples, {wanted} are needed; an "
                "unweighted blend is one pass over its datasets: give weights to repeat them"
            )
    return train, valid, test


def sample_order(config: DataConfig, *, train_samples: int) -> tuple[tuple[str, int, bool], ...]:
    """What the order of the training samples depends on through the run length: per dataset of the
    blend, ``(prefix, epochs, final epoch shuffled apart)`` of the ``GPTDataset`` that
    ``build_datasets`` builds for ``train_samples`` samples.

    Megatron's document, sample and shuffle indices are functions of the split's documents, the
    sequence length, the seed and these two numbers (``_build_document_sample_shuffle_indices``:
    the documents are shuffled over ``epochs`` copies, the last one apart when it is read for less
    than ``megatron_compat.datasets.FINAL_EPOCH_APART_BELOW`` of it); a blend interleaves its
    datasets the same way at any length (Megatron's greedy ``build_blending_indices`` is
    prefix-stable), each asked for its weight's share plus Megatron's surplus, and an unweighted
    blend reads one pass over each whatever the length. So two lengths of a run with the same data, split, sequence length and
    seed read the same samples in the same order up to the shorter one exactly when their keys
    are equal. Computed from the ``.idx`` files (checked as ``build_datasets`` checks them),
    without building Megatron's indices.
    """
    prefixes, weights = config.blend
    if weights is None and len(prefixes) > 1:  # Megatron builds one pass over each, at any length
        return tuple((prefix, 1, False) for prefix in prefixes)
    samples = [train_samples] if weights is None else weighted_train_samples(weights, train_samples)
    return tuple((prefix, *gpt_dataset_epochs(wanted, train_split_tokens(prefix, config.split_cut("train")),
                                              config.seq_length))  # one epoch: the train split's tokens
                 for prefix, wanted in zip(prefixes, samples))


def train_split_tokens(prefix: str, split: str) -> int:
    """Tokens of the train split of ``prefix`` under ``split`` (the sequences Megatron gives it):
    one epoch of its ``GPTDataset``; a split that holds none refused naming the prefix."""
    index = read_index(prefix)
    begin, end = split_ranges(split, len(index.tokens_before) - 1)[0]
    tokens = int(index.tokens_before[end] - index.tokens_before[begin])
    if tokens == 0:
        raise UserError(f"data_path {prefix!r}: the train split of {split!r} holds no tokens")
    return tokens


# --- sources read as streams (training.mixtures) ------------------------------------------------


def blend_counts(shares: list[float], size: int) -> list[int]:
    """Samples of each source among the first ``size`` of :func:`blending_index`."""
    return np.bincount(blending_index(shares, size)[0], minlength=len(shares)).tolist()


def build_source_epoch(config: DataConfig, prefix: str, *, tokenizer: EncoderTokenizer, seed: int) -> Dataset:
    """One epoch of the train split of ``prefix`` at ``config.seq_length``: Megatron's
    ``GPTDataset`` built for no set number of samples (one epoch), shuffled with ``seed``
    (``training.mixtures.epoch_seed``). Checked first (:func:`check_source`)."""
    check_source(config, prefix, tokenizer)
    # The prefix alone, cut as the run's training blend is cut (its train share; whole with per-split paths).
    source = dataclasses.replace(config, data_path=(prefix,), data_args_path=None, train_data_path=(), valid_data_path=(),
                                 test_data_path=(), split=config.split_cut("train"), eval_iters=0)
    return build_one_epoch(_gpt_dataset_config(source, tokenizer, seed))


def check_source(config: DataConfig, prefix: str, tokenizer: EncoderTokenizer) -> None:
    """What :func:`build_source_epoch` checks of a source before Megatron reads it: the EOD, the
    prefix (:func:`check_prefix`), and its train split not empty."""
    document_end_id(config, tokenizer)
    index = check_prefix(prefix, tokenizer, max_tokens_to_scan=config.max_tokens_to_scan)
    _check_splits(config, [index], weighted=True, cut=config.split_cut("train"))


def plan_source_reads(config: DataConfig, spans: Sequence[DatasetSpan]) -> tuple[SpanReads, ...]:
    """What each data span of a run whose phases set their own data reads from each source
    (``training.mixtures.plan_reads`` over the ``.idx`` files' train splits)."""
    tokens = functools.cache(lambda prefix: train_split_tokens(prefix, config.split_cut("train")))
    plans = plan_reads(spans, samples_per_epoch=lambda prefix, length: samples_per_epoch(tokens(prefix), length),
                       blend_counts=blend_counts, sample_count=lambda span: span.last_sample - span.first_sample)
    check_enough_data(plans)
    return plans


class SpanDataset:
    """The samples of one data span (``training.mixtures``), in order: sample ``j`` is source
    ``dataset_index[j]``'s stream sample ``first_sample + dataset_sample_index[j]`` (Megatron's
    blending index at the span's shares), read from the epoch it falls in. Like Megatron's
    ``BlendedDataset`` it has ``datasets``, ``dataset_index`` (a sample's source names it in
    errors) and adds ``dataset_id`` (the source's position in the span's ``data_path``)."""

    def __init__(self, reads: SpanReads, epochs: dict[tuple[int, int], Dataset]) -> None:
        self.reads = reads
        self.epochs = epochs
        """``(source, epoch)`` -> that epoch's ``GPTDataset``, for each epoch the span reads."""
        self.dataset_index, self.dataset_sample_index = blending_index([s.share for s in reads.sources], reads.samples)
        self.datasets = [next((d for (i, _), d in epochs.items() if i == s), None) for s in range(len(reads.sources))]
        self.config = next(iter(epochs.values())).config  # the tokenizer the samples' ids are of

    def __len__(self) -> int:
        return self.reads.samples

    def __getitem__(self, index: int) -> dict:
        s = int(self.dataset_index[index])
        source = self.reads.sources[s]
        epoch, sample = divmod(source.first_sample + int(self.dataset_sample_index[index]), source.samples_per_epoch)
        return {"dataset_id": s, **self.epochs[(s, epoch)][sample]}


def build_span_dataset(config: DataConfig, reads: SpanReads, *, tokenizer: EncoderTokenizer, seed: int) -> SpanDataset:
    """:class:`SpanDataset` of ``reads`` (``config`` at the span's length), each epoch it reads
    built (:func:`build_source_epoch`) and checked to hold the samples the plan counted."""
    epochs = {}
    for s, source in enumerate(reads.sources):
        for epoch in source.epochs:
            dataset = build_source_epoch(config, source.prefix, tokenizer=tokenizer, seed=epoch_seed(seed, epoch))
            if len(dataset) != source.samples_per_epoch:
                raise RuntimeError(f"{source.prefix}: Megatron's epoch holds {len(dataset)} samples of "
                                   f"{config.seq_length}, the plan counted {source.samples_per_epoch}")
            epochs[(s, epoch)] = dataset
    return SpanDataset(reads, epochs)


# --- the blend report ----------------------------------------------------------------------------


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


# --- the default provider -------------------------------------------------------------------------


class GPTDatasetProvider:
    """Megatron-Core's ``GPTDataset`` (and ``BlendedDataset``) over the run's ``data.data_path``:
    :func:`build_datasets`, :func:`blend_shares`, :func:`plan_source_reads` and
    :func:`build_span_dataset`."""

    def build_datasets(
        self, config: DataConfig, *, tokenizer: EncoderTokenizer, train_samples: int, valid_samples: int,
        seed: int, test_samples: int = 0,
    ) -> tuple[Dataset, Dataset | None, Dataset | None]:
        return build_datasets(config, tokenizer=tokenizer, train_samples=train_samples,
                              valid_samples=valid_samples, seed=seed, test_samples=test_samples)

    def blend_shares(self, config: DataConfig, train: Dataset | None, *, train_samples: int) -> list[dict]:
        return blend_shares(config, train, train_samples=train_samples)

    def plan_source_reads(self, config: DataConfig, spans: Sequence[DatasetSpan]) -> tuple[SpanReads, ...]:
        return plan_source_reads(config, spans)

    def build_span_dataset(self, config: DataConfig, reads: SpanReads, *, tokenizer: EncoderTokenizer,
                           seed: int) -> Dataset:
        return build_span_dataset(config, reads, tokenizer=tokenizer, seed=seed)


GPT_DATASETS: DatasetProvider = GPTDatasetProvider()
"""The run's datasets unless ``training.loop.pretrain`` is given another provider."""
