"""The run's seams (``model.provider``, ``training.datasets``): a model provider and a dataset provider
other than the defaults, given to ``pretrain``, are what a short real run builds, trains and reads.

The model provider builds the encoder with one layer (the recipe says two); the dataset provider
cuts samples from in-memory token arrays: real text of the demo corpus through the demo tokenizer,
none of it from the recipe's ``data_path``. It implements the whole ``DatasetProvider`` protocol: the
splits, and for phases that set their own ``data_path`` the plan of each span's reads and the span's
samples (its "sources" are in-memory streams, named by prefixes the pre-flight finds present).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
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
from megatron_ext.training.context import DatasetSpan
from megatron_ext.training.datasets import DatasetProvider
from megatron_ext.training.loop import pretrain
from megatron_ext.training.mixtures import SpanReads, check_enough_data, plan_reads
from megatron_ext.training.recipe import run_config_from_dict


@dataclass(frozen=True)
class _TokenizerOnly:
    """What the samplers read of a dataset's config, as of a Megatron dataset's: its tokenizer."""

    tokenizer: EncoderTokenizer


def document_stream(documents: list[np.ndarray], tokenizer: EncoderTokenizer) -> np.ndarray:
    """The documents, each ended by the EOD, laid end to end."""
    return np.concatenate([np.append(doc, tokenizer.eod) for doc in documents]).astype(np.int64)


def token_windows(stream: np.ndarray, seq_length: int) -> np.ndarray:
    """``stream`` cut into ``seq_length + 1`` token windows, each starting where the one before ends
    (its last token the next one's first): one epoch of samples."""
    return np.stack([stream[i * seq_length:(i + 1) * seq_length + 1] for i in range((len(stream) - 1) // seq_length)])


def gpt_sample(window: np.ndarray) -> dict[str, torch.Tensor]:
    """GPTDataset's sample of one window."""
    window = torch.from_numpy(window)
    length = len(window) - 1
    return {"tokens": window[:-1], "labels": window[1:], "loss_mask": torch.ones(length),
            "position_ids": torch.arange(length)}


class InMemoryTokens(torch.utils.data.Dataset):
    """GPTDataset's samples over documents held in memory: the documents (each ended by the EOD)
    laid end to end and cut into ``seq_length + 1`` token windows, read in an order ``seed``
    shuffles, repeated until ``samples`` are read."""

    def __init__(self, documents: list[np.ndarray], *, tokenizer: EncoderTokenizer, seq_length: int,
                 samples: int, seed: int, name: str) -> None:
        stream = document_stream(documents, tokenizer)
        windows = (len(stream) - 1) // seq_length
        if windows < 1:
            raise ValueError(f"{name}: {len(stream)} tokens make no sample of {seq_length + 1}")
        self.windows = token_windows(stream, seq_length)
        rng = np.random.default_rng(seed)
        epochs = -(-samples // windows)
        self.order = np.concatenate([rng.permutation(windows) for _ in range(epochs)])[:samples]
        self.config = _TokenizerOnly(tokenizer)
        self.dataset_path = f"in-memory:{name}"

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return gpt_sample(self.windows[self.order[index]])


def blend_order(shares: Sequence[float], samples: int) -> np.ndarray:
    """Per sample of a span, its source: the one furthest behind its share so far (the greedy rule
    of Megatron's ``BlendedDataset``, written out; ties to the first)."""
    read = np.zeros(len(shares))
    order = np.empty(samples, dtype=np.int64)
    for j in range(samples):
        order[j] = int(np.argmax(np.asarray(shares) * (j + 1) - read))
        read[order[j]] += 1
    return order


def epoch_order(windows: int, *, seed: int, epoch: int) -> np.ndarray:
    """The order a source's epoch ``epoch`` reads its windows in."""
    return np.random.default_rng([seed, epoch]).permutation(windows)


class InMemorySpan(torch.utils.data.Dataset):
    """The samples of one data span: sample ``j`` is source ``blend_order[j]``'s next stream sample,
    from ``first_sample`` on (``SpanReads``), each epoch of a source its windows in
    :func:`epoch_order`."""

    def __init__(self, reads: SpanReads, streams: Mapping[str, np.ndarray], *, tokenizer: EncoderTokenizer,
                 seed: int) -> None:
        self.reads = reads
        self.windows = [token_windows(streams[source.prefix], reads.seq_length) for source in reads.sources]
        self.source_of = blend_order([source.share for source in reads.sources], reads.samples)
        self.stream_sample = np.empty(reads.samples, dtype=np.int64)  # per sample, its source's stream sample
        cursor = [source.first_sample for source in reads.sources]
        for j, s in enumerate(self.source_of):
            self.stream_sample[j] = cursor[s]
            cursor[s] += 1
        self.config = _TokenizerOnly(tokenizer)
        self.dataset_path = f"in-memory:steps[{reads.start},{reads.end})"
        self.seed = seed

    def __len__(self) -> int:
        return self.reads.samples

    def __getitem__(self, index: int) -> dict:
        s = int(self.source_of[index])
        windows = self.windows[s]
        epoch, sample = divmod(int(self.stream_sample[index]), len(windows))
        return {"dataset_id": s, **gpt_sample(windows[epoch_order(len(windows), seed=self.seed, epoch=epoch)[sample]])}


@dataclass
class InMemoryDatasets:
    """A dataset provider: training and validation documents as token arrays, no test split; and
    for phases with their own ``data_path``, ``sources``: each named source's token stream."""

    train_documents: list[np.ndarray]
    valid_documents: list[np.ndarray]
    sources: dict[str, np.ndarray] = field(default_factory=dict)
    """A source's documents, each ended by the EOD, end to end (:func:`document_stream`), by the
    prefix a phase's ``data_path`` names it with."""
    calls: list[dict] = field(default_factory=list)
    built: list[tuple[InMemoryTokens, InMemoryTokens | None]] = field(default_factory=list)
    plans: list[tuple[SpanReads, ...]] = field(default_factory=list)
    spans: list[InMemorySpan] = field(default_factory=list)

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

    def plan_source_reads(self, config: DataConfig, spans: Sequence[DatasetSpan]) -> tuple[SpanReads, ...]:
        plans = plan_reads(spans, samples_per_epoch=lambda prefix, length: (len(self.sources[prefix]) - 1) // length,
                           blend_counts=lambda shares, n: np.bincount(blend_order(shares, n), minlength=len(shares)),
                           sample_count=lambda span: span.last_sample - span.first_sample)
        check_enough_data(plans)
        self.plans.append(plans)
        return plans

    def build_span_dataset(self, config: DataConfig, reads: SpanReads, *, tokenizer: EncoderTokenizer,
                           seed: int) -> InMemorySpan:
        assert config.seq_length == reads.seq_length
        self.spans.append(InMemorySpan(reads, self.sources, tokenizer=tokenizer, seed=seed))
        return self.spans[-1]


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


def test_phases_with_their_own_data_read_the_providers_span_samples_in_plan_order(tmp_path, demo_tokenizer,
                                                                                   demo_documents):
    """Phases that set ``data_path`` (and ``temperature``) read through the provider's
    ``plan_source_reads`` and ``build_span_dataset``: the plan made once for the run, a dataset per
    data span built with that span's reads, and every one of its samples trained on, in order."""
    tokenizer, train_documents, valid_documents = demo_documents
    demo = assets.data_dir() / "demo_dataset"
    a, b = str(demo / "train_text_document"), str(demo / "valid_text_document")  # names the pre-flight finds
    corpus = {"tokenizer": str(demo_tokenizer), "data": a}
    recipe = tiny_recipe(corpus, tmp_path, model={"vocab_size": tokenizer.vocab_size}, checkpoint={"save": None},
                         phases=[{"objective": "clm", "share": 0.5, "data_path": [a]},
                                 {"objective": "clm", "share": 0.5, "data_path": ["3", a, "1", b], "temperature": 0.5}],
                         training={"train_iters": 4, "eval_interval": 4, "log_interval": 1})
    config = run_config_from_dict(recipe)
    sources = {a: document_stream(train_documents[:8], tokenizer), b: document_stream(train_documents[8:], tokenizer)}
    dataset_provider: DatasetProvider = InMemoryDatasets(train_documents, valid_documents, sources=sources)
    model_provider = OneLayerEncoder()

    result = pretrain(config, model_provider=model_provider, dataset_provider=dataset_provider)

    assert result.final_step == 4 and all(math.isfinite(loss) for loss in result.losses.values())
    # One plan for the run: two spans of 2 steps x 8 samples; a continues in the second where the first
    # left it, b starts at its beginning, at shares 3 ** 0.5 : 1.
    assert len(dataset_provider.plans) == 1
    first, second = dataset_provider.plans[0]
    assert [(p.start, p.end, p.samples) for p in (first, second)] == [(0, 2, 16), (2, 4, 16)]
    assert [(s.prefix, s.first_sample, s.samples) for s in first.sources] == [(a, 0, 16)]
    assert [s.prefix for s in second.sources] == [a, b] and sum(s.samples for s in second.sources) == 16
    assert second.sources[0].first_sample == 16 and second.sources[1].first_sample == 0
    assert second.sources[0].share == pytest.approx(3 ** 0.5 / (3 ** 0.5 + 1))
    # A dataset per span, built with the plan's reads, at the step its span starts.
    assert [span.reads for span in dataset_provider.spans] == [first, second]
    # What the model trained on: each span's samples, all of them, in order.
    expected = torch.stack([span[i]["tokens"] for span in dataset_provider.spans for i in range(len(span))])
    assert torch.equal(torch.cat(model_provider.trained_on), expected)
    # ... which are a's first 16 + k windows of its first epoch, then b's first ones: no window read twice.
    a_windows = token_windows(sources[a], config.data.seq_length)
    a_order = epoch_order(len(a_windows), seed=config.training.seed, epoch=0)
    a_read = second.sources[0].end_sample
    assert a_read <= len(a_windows)  # within a's first epoch
    from_a = [span[i] for span in dataset_provider.spans for i in range(len(span)) if span.source_of[i] == 0]
    assert torch.equal(torch.stack([row["tokens"] for row in from_a]),
                       torch.from_numpy(a_windows[a_order[:a_read], :-1]))
    # Validation still reads the provider's splits (the run's data, its length).
    assert dataset_provider.calls == [dict(train_samples=1, valid_samples=config.data.eval_iters * 8,
                                           seed=config.training.seed, seq_length=config.data.seq_length)]
