"""Which samples each data-parallel rank reads, in micro-batches: Megatron's pretraining sampler.

Batches follow Megatron's ``MegatronPretrainingSampler``: global batch ``k`` is samples
``[k * global_batch_size, (k + 1) * global_batch_size)`` of the dataset order, cut into chunks of
``micro_batch_size * dp_size`` consecutive samples, data-parallel rank ``r`` taking the ``r``-th
``micro_batch_size`` slice of each chunk.

The datasets are a dataset provider's (``training.datasets``): sized, their samples GPTDataset's
dicts, and, like Megatron's datasets, naming their tokenizer (``config.tokenizer``) and their source
(``dataset_path``, or a ``BlendedDataset``'s datasets): every batch's ids are checked against the
vocab, an id outside it refused in one line naming the sample and where it comes from.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from megatron_ext.config_loading import UserError
from megatron_ext.training.config import DataConfig

if TYPE_CHECKING:
    from torch.utils.data import Dataset  # a Megatron GPTDataset or BlendedDataset, or a provider's


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


def _micro_batches(dataset: Dataset, sampler: _MicroBatchSampler, config: DataConfig, *,
                   split: str) -> Iterator[dict]:
    """The collated batches of ``sampler``'s indices into ``dataset`` (the ``split`` named in errors)."""
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
                    f"token id {int(bad)} in {key} of {split} sample {indices[row]}, "
                    f"from {_source(dataset, indices[row])}, is outside the vocab "
                    f"[0, {tokenizer.vocab_size}) of tokenizer {tokenizer.name}; the data was made with "
                    "another tokenizer?"
                )
        yield batch


def _source(dataset: Dataset, index: int) -> str:
    """Where sample ``index`` of ``dataset`` comes from: its ``dataset_path``, or for a
    ``BlendedDataset`` that of the dataset the sample is drawn from."""
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
    return _micro_batches(dataset, sampler, config, split="train")


def build_valid_iterator(
    dataset: Dataset | None, *, config: DataConfig, dp_rank: int, dp_size: int, split: str = "valid"
) -> Iterator[dict]:
    """Micro-batches of one evaluation: the first ``eval_iters`` global batches of ``dataset``, the
    ``split`` (``valid``, or ``test``: evaluated once, at the end of training) of the dataset provider's splits.

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
    return _micro_batches(dataset, sampler, config, split=split)


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
        yield from _micro_batches(dataset, sampler, config, split="train")
