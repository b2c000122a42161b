"""What ``training.datasets`` reads of Megatron-Core's datasets beyond their documented use: private
helpers, formulas and thresholds of ``GPTDataset``, ``BlendedDataset`` and
``BlendedMegatronDatasetBuilder``, each checked against megatron-core
:data:`~megatron_ext.megatron_compat.MEGATRON_CORE_VERSION` (0.19.2).

They let the trainer plan without building anything (the splits' token counts before Megatron cuts
them, a run's sample order key, what each data span reads from each source) and read a source as
its own stream, one ``GPTDataset`` epoch at a time, exactly as Megatron would build it. Under
another release each one is read against Megatron's code again:

- :func:`split_ranges`: the rounding of ``BlendedMegatronDatasetBuilder._build_megatron_dataset_splits``.
- :func:`weighted_train_samples`: ``blended_megatron_dataset_builder._get_size_per_split_per_dataset``
  (private) with ``BlendedMegatronDatasetConfig.mid_level_dataset_surplus``'s default.
- :func:`extra_token`: ``GPTDatasetConfig.add_extra_token_to_sequence``'s default, read from the
  dataclass's fields.
- :func:`samples_per_epoch`: ``GPTDataset``'s sample count of one epoch (``helpers.cpp``'s
  ``build_sample_idx``).
- :func:`gpt_dataset_epochs` and :data:`FINAL_EPOCH_APART_BELOW`: ``GPTDataset._get_num_epochs``
  and the threshold of ``_build_document_sample_shuffle_indices``.
- :func:`blending_index`: the C++ ``helpers.build_blending_indices`` called with
  ``BlendedDataset._build_indices``' positional arguments and its ``int16`` source index.
- :func:`build_one_epoch`: ``BlendedMegatronDatasetBuilder`` with no sizes builds each split over
  exactly one epoch (``GPTDataset._get_num_epochs`` returns 1 for ``num_samples`` None).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig


def split_ranges(split: str, n_sequences: int) -> list[tuple[int, int] | None]:
    """The sequence ranges Megatron gives each split (train, valid, test) of ``n_sequences``
    sequences under ``split`` (None: the split has no share)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    # The rounding of BlendedMegatronDatasetBuilder._build_megatron_dataset_splits (0.19.2).
    n = float(n_sequences)
    return [None if b is None else (int(round(b[0] * n)), int(round(b[1] * n))) for b in matrix]


def weighted_train_samples(weights: list[float], train_samples: int) -> list[int]:
    """Samples each dataset of a weighted blend is built for when the blend's train split is asked
    for ``train_samples``: its weight's share plus Megatron's surplus (0.19.2's private
    ``_get_size_per_split_per_dataset`` with the config's default ``mid_level_dataset_surplus``)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import _get_size_per_split_per_dataset
    from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
    from megatron.core.datasets.utils import normalize

    surplus = BlendedMegatronDatasetConfig.__dataclass_fields__["mid_level_dataset_surplus"].default
    return [per_split[0] for per_split in _get_size_per_split_per_dataset(
        normalize(weights), [train_samples, 0, 0], surplus=surplus)]


def extra_token() -> int:
    """1: GPTDataset reads ``seq_length + 1`` tokens a sample (``GPTDatasetConfig``'s default
    ``add_extra_token_to_sequence``, 0.19.2), the next sample's first token its last label."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    return int(GPTDatasetConfig.__dataclass_fields__["add_extra_token_to_sequence"].default)


def samples_per_epoch(tokens: int, seq_length: int) -> int:
    """Samples of one epoch of ``tokens`` tokens at ``seq_length`` (``GPTDataset``'s sample index,
    0.19.2: each sample reads one token more than its length, the next sample's first)."""
    return max(0, (tokens - extra_token()) // seq_length)


FINAL_EPOCH_APART_BELOW = 0.80
"""``GPTDataset``'s threshold (``_build_document_sample_shuffle_indices``, megatron-core 0.19.2): a
final epoch read for less than this share of its samples is shuffled apart from the others."""


def gpt_dataset_epochs(samples: int, tokens: int, seq_length: int) -> tuple[int, bool]:
    """``(epochs, final epoch shuffled apart)`` of a ``GPTDataset`` of ``samples`` samples at
    ``seq_length`` over a split of ``tokens`` tokens an epoch (0.19.2's ``_get_num_epochs`` and
    :data:`FINAL_EPOCH_APART_BELOW`)."""
    extra = extra_token()
    epochs = max(1, -(-(samples * seq_length + extra) // tokens))
    apart = False
    if epochs > 1:
        from_final = samples - ((epochs - 1) * tokens - extra) // seq_length
        apart = from_final < int(FINAL_EPOCH_APART_BELOW * ((tokens - extra) // seq_length))
    return epochs, apart


def blending_index(shares: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's blending index of ``size`` samples at ``shares`` (``BlendedDataset``'s greedy
    rule, Megatron's own C++ helper, called as 0.19.2's ``BlendedDataset._build_indices`` calls it):
    per sample, its source and its sample within the source."""
    from megatron.core.datasets import helpers
    from megatron.core.datasets.utils import normalize

    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    if size:
        helpers.build_blending_indices(dataset_index, dataset_sample_index, normalize(shares), len(shares), size,
                                       False)
    return dataset_index, dataset_sample_index


def build_one_epoch(config: GPTDatasetConfig) -> GPTDataset:
    """The train split of ``config`` (one prefix) as Megatron's ``GPTDataset`` over exactly one
    epoch: the builder given no sizes (0.19.2: ``num_samples`` None, one epoch), its length
    :func:`samples_per_epoch` of the split's tokens."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True, config).build()
    return train
