"""The run's seams (``model.provider``, ``training.datasets``): a model provider and a dataset provider
other than the defaults, given to ``pretrain``, are what a short real run builds, trains and reads.

The model provider builds the encoder with one layer (the recipe says two); the dataset provider
cuts samples from an in-memory list of token arrays: real text of the demo corpus through the demo
tokenizer, none of it from the recipe's ``data_path``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from helpers import tiny_recipe
from megatron_ext import assets
from megatron_ext.model import EncoderModelConfig
from megatron_ext.model.provider import ENCODER, ModelProvider
from megatron_ext.tokenizer import EncoderTokenizer, TokenizerConfig, build_tokenizer
from megatron_ext.training.config import DataConfig
from megatron_ext.training.datasets import DatasetProvider
from megatron_ext.training.loop import pretrain
from megatron_ext.training.recipe import run_config_from_dict


@dataclass(frozen=True)
class _TokenizerOnly:
    """What the samplers read of a dataset's config, as of a Megatron dataset's: its tokenizer."""

    tokenizer: EncoderTokenizer


class InMemoryTokens(torch.utils.data.Dataset):
    """GPTDataset's samples over documents held in memory: the documents (each ended by the EOD)
    laid end to end and cut into ``seq_length + 1`` token windows, read in an order ``seed``
    shuffles, repeated until ``samples`` are read."""

    def __init__(self, documents: list[np.ndarray], *, tokenizer: EncoderTokenizer, seq_length: int,
                 samples: int, seed: int, name: str) -> None:
        stream = np.concatenate([np.append(doc, tokenizer.eod) for doc in documents]).astype(np.int64)
        windows = (len(stream) - 1) // seq_length
        if windows < 1:
            raise ValueError(f"{name}: {len(stream)} tokens make no sample of {seq_length + 1}")
        self.windows = np.stack([stream[i * seq_length:(i + 1) * seq_length + 1] for i in range(windows)])
        rng = np.random.default_rng(seed)
        epochs = -(-samples // windows)
        self.order = np.concatenate([rng.permutation(windows) for _ in range(epochs)])[:samples]
        self.config = _TokenizerOnly(tokenizer)
        self.dataset_path = f"in-memory:{name}"

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = torch.from_numpy(self.windows[self.order[index]])
        length = len(window) - 1
        return {"tokens": window[:-1], "labels": window[1:], "loss_mask": torch.ones(length),
                "position_ids": torch.arange(length)}


@dataclass
class InMemoryDatasets:
    """A dataset provider: training and validation documents as token arrays, no test split."""

    train_documents: list[np.ndarray]
    valid_documents: list[np.ndarray]
    calls: list[dict] = field(default_factory=list)
    built: list[tuple[InMemoryTokens, InMemoryTokens | None]] = field(default_factory=list)

    def build_datasets(self, config: DataConfig, *, tokenizer: EncoderTokenizer, train_samples: int,
                       valid_samples: int, seed: int, test_samples: int = 0):
        self.calls.append(dict(train_samples=train_samples, valid_samples=valid_samples, seed=seed,
                               seq_length=config.seq_length))
        common = dict(tokenizer=tokenizer, seq_length=config.seq_length, seed=seed)
        train = InMemoryTokens(self.train_documents, samples=train_samples, name="train", **common)
        valid = (InMemoryTokens(self.valid_documents, samples=valid_samples, name="valid", **common)
                 if valid_samples else None)
        self.built.append((train, valid))
        return train, valid, None

    def blend_shares(self, config: DataConfig, train, *, train_samples: int) -> list[dict]:
        return []  # one source, not a blend


@dataclass
class OneLayerEncoder:
    """A model provider: the encoder of the run's config with one layer, recording what the trainer
    asked for and the token ids each forward pass read (training and evaluation apart)."""

    calls: list[dict] = field(default_factory=list)
    models: list[torch.nn.Module] = field(default_factory=list)
    trained_on: list[torch.Tensor] = field(default_factory=list)
    evaluated_on: list[torch.Tensor] = field(default_factory=list)

    def build_model(self, config: EncoderModelConfig, *, pre_process: bool, post_process: bool,
                    transformer_overrides: Mapping[str, Any]) -> torch.nn.Module:
        self.calls.append(dict(num_layers=config.num_layers, pre_process=pre_process, post_process=post_process,
                               overrides=dict(transformer_overrides)))
        model = ENCODER.build_model(dataclasses.replace(config, num_layers=1), pre_process=pre_process,
                                    post_process=post_process, transformer_overrides=transformer_overrides)

        def record(module, args, kwargs):
            input_ids = args[0] if args else kwargs["input_ids"]
            (self.trained_on if module.training else self.evaluated_on).append(input_ids.detach().cpu().clone())

        model.register_forward_pre_hook(record, with_kwargs=True)
        self.models.append(model)
        return model


@pytest.fixture(scope="module")
def demo_documents(demo_tokenizer) -> tuple[EncoderTokenizer, list[np.ndarray], list[np.ndarray]]:
    """The demo tokenizer, and the demo corpus's 19 validation articles through it: 15 to train on, 4 to
    validate on."""
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_model=str(demo_tokenizer)))
    lines = (assets.data_dir() / "demo_corpus" / "valid.jsonl").read_text(encoding="utf-8").splitlines()
    documents = [np.asarray(ids, dtype=np.int64)
                 for ids in tokenizer.tokenize_batch([json.loads(line)["text"] for line in lines])]
    assert len(documents) == 19
    return tokenizer, documents[:15], documents[15:]


def test_a_run_builds_trains_and_reads_what_its_providers_give(tmp_path, demo_tokenizer, demo_documents):
    tokenizer, train_documents, valid_documents = demo_documents
    corpus = {"tokenizer": str(demo_tokenizer),
              "data": str(assets.data_dir() / "demo_dataset" / "train_text_document")}
    recipe = tiny_recipe(corpus, tmp_path, model={"vocab_size": tokenizer.vocab_size},
                         phases=[{"objective": "clm", "share": 1.0}], checkpoint={"save": None},
                         training={"train_iters": 4, "eval_interval": 2, "log_interval": 1})
    config = run_config_from_dict(recipe)
    model_provider: ModelProvider = OneLayerEncoder()
    dataset_provider: DatasetProvider = InMemoryDatasets(train_documents, valid_documents)

    result = pretrain(config, model_provider=model_provider, dataset_provider=dataset_provider)

    assert result.final_step == 4 and all(math.isfinite(loss) for loss in result.losses.values())
    assert set(result.valid) == {2, 4}
    # The model is the provider's, built once for the one pipeline stage with the run's overrides.
    assert model_provider.calls == [dict(num_layers=2, pre_process=True, post_process=True,
                                         overrides=model_provider.calls[0]["overrides"])]
    assert model_provider.calls[0]["overrides"]["calculate_per_token_loss"] is True
    assert len(model_provider.models[0].decoder.layers) == 1
    # The datasets are the provider's, sized for the run: 4 steps of 8 samples, 1 batch of 8 per evaluation.
    d = config.data
    assert dataset_provider.calls == [dict(train_samples=4 * d.global_batch_size, seed=config.training.seed,
                                           valid_samples=d.eval_iters * d.global_batch_size, seq_length=d.seq_length)]
    # What the model trained on is the provider's training samples, in their order (CLM reads the
    # tokens as they are), and what each evaluation read (CLM, then MLM: masked) its validation samples.
    train, valid = dataset_provider.built[0]
    expected = torch.stack([train[i]["tokens"] for i in range(len(train))])
    assert torch.equal(torch.cat(model_provider.trained_on), expected)
    held_out = torch.stack([valid[i]["tokens"] for i in range(d.eval_iters * d.global_batch_size)])
    per_pass = d.eval_iters * d.global_batch_size // d.micro_batch_size
    passes = [torch.cat(model_provider.evaluated_on[i:i + per_pass])
              for i in range(0, len(model_provider.evaluated_on), per_pass)]
    assert len(passes) == 2 * len(config.validation_objectives())  # at steps 2 and 4
    assert torch.equal(passes[0], held_out)  # clm
    for read in passes:
        assert torch.equal(torch.where(read == tokenizer.mask, held_out, read), held_out)
