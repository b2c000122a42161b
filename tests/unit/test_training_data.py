"""The default dataset provider (megatron_ext.training.datasets: Megatron-Core datasets over real preprocessed
news), its index checks (megatron_ext.data.index_checks), DP batching (megatron_ext.training.samplers), bad input."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_ext import assets
from megatron_ext.data.preprocess import PreprocessConfig, preprocess
from megatron_ext.tokenizer import TokenizerConfig, build_tokenizer
from megatron_ext.training.config import DataConfig
from megatron_ext.training.datasets import build_datasets
from megatron_ext.training.samplers import build_train_iterator, build_valid_iterator

REPO = Path(__file__).resolve().parents[2]
SEQ, MBS, GBS = 32, 2, 8


@pytest.fixture(scope="module")
def sp_model() -> str:
    return str(assets.member("mistral-common", "mistral_common/data/tokenizer.model.v1"))


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, news_texts, sp_model) -> dict[str, str]:
    """Prefixes of real news tokenized with Mistral's SentencePiece model: halves A and B, 30 docs."""
    root = tmp_path_factory.mktemp("corpora")
    prefixes = {}
    for name, texts in (("a", news_texts[:150]), ("b", news_texts[150:]), ("small", news_texts[:30])):
        source = root / f"{name}.jsonl"
        source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
        config = PreprocessConfig(
            inputs=(str(source),), output_prefix=str(root / name), append_eod=True, progress=False,
            tokenizer=TokenizerConfig(tokenizer_model=sp_model),
        )
        preprocess(config)
        prefixes[name] = config.output_prefix_for("text")
    return prefixes


@pytest.fixture(scope="module")
def tokenizer(sp_model):
    return build_tokenizer(TokenizerConfig(tokenizer_model=sp_model))


def _config(tmp_path: Path, *data_path: str, **kwargs) -> DataConfig:
    kwargs.setdefault("data_cache_path", str(tmp_path / "cache"))
    kwargs.setdefault("eval_iters", 2)
    return DataConfig(
        data_path=data_path, seq_length=SEQ, micro_batch_size=MBS, global_batch_size=GBS,
        **kwargs,
    )


def _steps(dataset, config: DataConfig, *, dp_rank=0, dp_size=1, consumed=0, steps=3) -> list[torch.Tensor]:
    """Per step, this rank's token rows ``[GBS / dp_size, SEQ]`` in micro-batch order."""
    iterator = build_train_iterator(
        dataset, config=config, dp_rank=dp_rank, dp_size=dp_size, consumed_samples=consumed
    )
    per_step = GBS // (MBS * dp_size)
    batches = [next(iterator)["tokens"] for _ in range(steps * per_step)]
    return [torch.cat(batches[i : i + per_step]) for i in range(0, len(batches), per_step)]


def _copy_pair(prefix: str, tmp_path: Path) -> str:
    out = str(tmp_path / "copy")
    for suffix in (".bin", ".idx"):
        shutil.copy(prefix + suffix, out + suffix)
    return out


def test_samples_have_seq_length_and_a_seeded_order(tmp_path, corpora, tokenizer):
    config = _config(tmp_path, corpora["a"])
    train, valid, _ = build_datasets(config, tokenizer=tokenizer, train_samples=40, valid_samples=16, seed=1234)
    assert len(train) >= 40 and len(valid) >= 16
    sample = train[0]
    assert sample["tokens"].shape == sample["labels"].shape == sample["loss_mask"].shape == (SEQ,)
    assert sample["tokens"][1:].tolist() == sample["labels"][:-1].tolist()
    assert "attention_mask" not in sample  # never: documents are read from the tokens
    assert any(Path(config.data_cache_path).glob("*GPTDataset-train-shuffle_index.npy"))

    # Same seed, fresh cache: the same shuffled order. Another seed: another order.
    again, _, _ = build_datasets(
        _config(tmp_path, corpora["a"], data_cache_path=str(tmp_path / "other")),
        tokenizer=tokenizer, train_samples=40, valid_samples=16, seed=1234)
    reseeded, _, _ = build_datasets(
        _config(tmp_path, corpora["a"]), tokenizer=tokenizer, train_samples=40, valid_samples=16, seed=7
    )
    first = [train[i]["tokens"].tolist() for i in range(10)]
    assert first == [again[i]["tokens"].tolist() for i in range(10)]
    assert first != [reseeded[i]["tokens"].tolist() for i in range(10)]


def test_document_flags_reach_gpt_dataset(tmp_path, corpora, tokenizer):
    """Positions restart and EOD inputs score nothing as Megatron does; no [b, 1, s, s] mask is
    built (the trainer's batches carry where documents end, the EODs: the same boundaries)."""
    from megatron_ext.model.attention import document_cu_seqlens
    from megatron_ext.training.batches import with_document_ends

    flags = {"reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True}
    config = _config(tmp_path, corpora["a"], **flags)
    train, _, _ = build_datasets(config, tokenizer=tokenizer, train_samples=40, valid_samples=16, seed=1234)
    iterator = build_train_iterator(train, config=config, dp_rank=0, dp_size=1, consumed_samples=0)
    # The first micro-batch with a document boundary that is not the last token of its row.
    batch = next(b for b in iterator if (b["tokens"][:, :-1] == tokenizer.eod).any())
    assert "attention_mask" not in batch
    eod = batch["tokens"] == tokenizer.eod
    assert (batch["loss_mask"][eod] == 0).all() and (batch["loss_mask"][~eod] == 1).all()
    row, col = (int(i) for i in (eod[:, :-1]).nonzero()[0])
    assert batch["position_ids"][row, col + 1] == 0
    starts = document_cu_seqlens(with_document_ends(batch, tokenizer.eod)["document_ends"]).tolist()
    assert row * SEQ + col + 1 in starts and row * SEQ + col not in starts  # the next document starts after it
    assert batch["position_ids"][row, col] > 0 or row * SEQ + col in starts


def test_blend_weights_parse_and_the_blend_follows_them(tmp_path, corpora, tokenizer):
    config = _config(tmp_path, "0.25", corpora["a"], "0.75", corpora["b"])
    assert config.blend == ([corpora["a"], corpora["b"]], [0.25, 0.75])
    train, valid, _ = build_datasets(config, tokenizer=tokenizer, train_samples=400, valid_samples=16, seed=1234)
    assert type(train).__name__ == "BlendedDataset" and len(train) == 400
    counts = np.bincount(np.asarray(train.dataset_index), minlength=2)
    assert abs(counts[0] - 100) <= 1 and abs(counts[1] - 300) <= 1
    batch = next(build_train_iterator(train, config=config, dp_rank=0, dp_size=1, consumed_samples=0))
    assert batch["tokens"].shape == (MBS, SEQ) and batch["dataset_id"].shape == (MBS,)

    unweighted = _config(tmp_path, corpora["a"], corpora["b"])
    assert unweighted.blend == ([corpora["a"], corpora["b"]], None)
    train, _, _ = build_datasets(unweighted, tokenizer=tokenizer, train_samples=400, valid_samples=16, seed=1234)
    assert len(train) == 400
    with pytest.raises(ValueError, match="an unweighted blend is one pass over its datasets"):
        build_datasets(unweighted, tokenizer=tokenizer, train_samples=100_000, valid_samples=16, seed=1234)


def test_resume_continues_exactly_where_an_uninterrupted_run_is(tmp_path, corpora, tokenizer):
    config = _config(tmp_path, corpora["a"])
    train, _, _ = build_datasets(config, tokenizer=tokenizer, train_samples=5 * GBS, valid_samples=16, seed=1234)
    uninterrupted = _steps(train, config, steps=5)
    # A restarted job rebuilds the dataset (from the cache) and may use loader workers.
    with_workers = _config(tmp_path, corpora["a"], num_workers=1)
    restarted, _, _ = build_datasets(with_workers, tokenizer=tokenizer, train_samples=5 * GBS, valid_samples=16,
                                     seed=1234)
    resumed = _steps(restarted, config, consumed=2 * GBS, steps=3)
    for expected, got in zip(uninterrupted[2:], resumed, strict=True):
        assert torch.equal(expected, got)
    # Step k is samples [k * GBS, (k + 1) * GBS) of the dataset order.
    assert torch.equal(uninterrupted[1], torch.stack([train[i]["tokens"] for i in range(GBS, 2 * GBS)]))
    with pytest.raises(ValueError, match="consumed_samples: expected a multiple of global_batch_size"):
        build_train_iterator(train, config=config, dp_rank=0, dp_size=1, consumed_samples=3)


def test_data_parallel_ranks_split_each_global_batch(tmp_path, corpora, tokenizer):
    config = _config(tmp_path, corpora["a"])
    train, _, _ = build_datasets(config, tokenizer=tokenizer, train_samples=3 * GBS, valid_samples=16, seed=1234)
    single = _steps(train, config)
    ranks = [_steps(train, config, dp_rank=r, dp_size=2) for r in range(2)]
    for step, whole in enumerate(single):
        parts = [ranks[r][step] for r in range(2)]
        assert sorted(torch.cat(parts).tolist()) == sorted(whole.tolist())
        assert not set(map(tuple, parts[0].tolist())) & set(map(tuple, parts[1].tolist()))
        # Megatron's layout: chunks of MBS x dp consecutive samples, rank r takes the r-th MBS slice.
        assert torch.equal(parts[1][:MBS], whole[MBS : 2 * MBS])


def test_validation_sees_the_same_samples_every_time(tmp_path, corpora, tokenizer):
    config = _config(tmp_path, corpora["a"])
    _, valid, _ = build_datasets(config, tokenizer=tokenizer, train_samples=GBS, valid_samples=2 * GBS, seed=1234)
    first = [b["tokens"] for b in build_valid_iterator(valid, config=config, dp_rank=1, dp_size=2)]
    second = [b["tokens"] for b in build_valid_iterator(valid, config=config, dp_rank=1, dp_size=2)]
    assert len(first) == config.eval_iters * GBS // (MBS * 2)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    too_many = len(valid) // GBS + 1
    longer = dataclasses.replace(config, eval_iters=too_many)
    with pytest.raises(ValueError, match=f"build with valid_samples >= {too_many * GBS}"):
        build_valid_iterator(valid, config=longer, dp_rank=0, dp_size=1)


def test_a_test_share_builds_the_test_split_of_its_own_documents(tmp_path, corpora, tokenizer):
    """Megatron's builder gives [train, valid, test]: the split's third share is built (from its own
    documents, none of the validation's) with the samples asked for; without a share it is None."""
    config = _config(tmp_path, corpora["a"], split="80,10,10")
    _, valid, test = build_datasets(config, tokenizer=tokenizer, train_samples=GBS, valid_samples=2 * GBS,
                                    test_samples=2 * GBS, seed=1234)
    assert test.index_split.name == "test" and len(test) >= 2 * GBS
    batches = list(build_valid_iterator(test, config=config, dp_rank=0, dp_size=1, split="test"))
    assert len(batches) == config.eval_iters * GBS // MBS
    assert set(test.indices.tolist()).isdisjoint(valid.indices.tolist()) and len(test.indices) > 0
    _, _, none = build_datasets(_config(tmp_path, corpora["a"]), tokenizer=tokenizer, train_samples=GBS,
                                valid_samples=2 * GBS, test_samples=2 * GBS, seed=1234)
    assert none is None  # the default split, 98,2,0, has no test share
    with pytest.raises(ValueError, match=r"no test dataset; build with test_samples >= 16 and a split with a test "):
        build_valid_iterator(none, config=config, dp_rank=0, dp_size=1, split="test")


def test_ranks_of_a_gloo_group_build_and_split_the_same_data(tmp_path, corpora, tokenizer):
    """Two processes over torch.distributed: rank 0 builds the caches, rank 1 loads them."""
    script = textwrap.dedent(f"""
        import os, sys, torch, torch.distributed as dist
        from megatron_ext.tokenizer import TokenizerConfig, build_tokenizer
        from megatron_ext.training.config import DataConfig
        from megatron_ext.training.datasets import build_datasets
        from megatron_ext.training.samplers import build_train_iterator
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        config = DataConfig(data_path=({corpora["a"]!r},), seq_length={SEQ}, micro_batch_size={MBS},
                            global_batch_size={GBS}, data_cache_path={str(tmp_path / "dist")!r})
        tokenizer = build_tokenizer(TokenizerConfig(**{tokenizer.reference()!r}))
        train, _, _ = build_datasets(config, tokenizer=tokenizer, train_samples={GBS}, valid_samples={GBS}, seed=1234)
        it = build_train_iterator(train, config=config, dp_rank=rank, dp_size=2, consumed_samples=0)
        tokens = torch.cat([next(it)["tokens"] for _ in range({GBS // (2 * MBS)})])
        torch.save(tokens, os.path.join({str(tmp_path)!r}, f"rank{{rank}}.pt"))
        dist.destroy_process_group()
    """)
    port = str(29500 + os.getpid() % 1000)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2"}
    procs = [
        subprocess.Popen([sys.executable, "-W", "ignore", "-c", script], env={**env, "RANK": str(r)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    config = _config(tmp_path, corpora["a"])
    train, _, _ = build_datasets(config, tokenizer=tokenizer, train_samples=GBS, valid_samples=GBS, seed=1234)
    whole = _steps(train, config, steps=1)[0]
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert sorted(torch.cat(parts).tolist()) == sorted(whole.tolist())


# --- bad input -----------------------------------------------------------------------------------


def _build_small(tmp_path: Path, prefix: str, tokenizer, *, valid_samples: int = 8, **kwargs):
    config = _config(tmp_path, prefix, **kwargs)
    return build_datasets(config, tokenizer=tokenizer, train_samples=8, valid_samples=valid_samples, seed=1234)


@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_missing_file_is_named(tmp_path, corpora, tokenizer, suffix):
    prefix = _copy_pair(corpora["small"], tmp_path)
    os.unlink(prefix + suffix)
    with pytest.raises(ValueError, match=re.escape(f"{prefix}{suffix} does not exist")):
        _build_small(tmp_path, prefix, tokenizer)
    with pytest.raises(ValueError, match="without .bin/.idx"):
        _build_small(tmp_path, prefix + ".bin", tokenizer)


def test_corrupt_index_header(tmp_path, corpora, tokenizer):
    prefix = _copy_pair(corpora["small"], tmp_path)
    with open(prefix + ".idx", "r+b") as f:
        f.write(b"GARBAGE!!")
    with pytest.raises(ValueError, match=re.escape(f"{prefix}.idx: not a Megatron index") + ".*MMIDIDX"):
        _build_small(tmp_path, prefix, tokenizer)


def test_truncated_bin(tmp_path, corpora, tokenizer):
    prefix = _copy_pair(corpora["small"], tmp_path)
    size = os.path.getsize(prefix + ".bin")
    os.truncate(prefix + ".bin", size - 10)
    message = re.escape(f"{prefix}.bin: {size - 10} bytes, but ") + f".* = {size} bytes"
    with pytest.raises(ValueError, match=message):
        _build_small(tmp_path, prefix, tokenizer)


@pytest.mark.timeout(60)  # without the check, Megatron's GPTDataset loops forever here
def test_split_with_no_tokens_is_refused_with_a_working_suggestion(tmp_path, corpora, tokenizer):
    empty_valid = r"valid gets sequences \[30, 30\) of 30 = 0 tokens\. Try --split \S+"
    with pytest.raises(ValueError, match=empty_valid) as err:
        _build_small(tmp_path, corpora["small"], tokenizer, split="99,1,0")
    suggested = str(err.value).rsplit("--split ", 1)[1]
    _, valid, _ = _build_small(tmp_path, corpora["small"], tokenizer, split=suggested)
    assert len(valid) >= 8


def test_valid_samples_without_a_valid_share(tmp_path, corpora, tokenizer):
    # Refused with the recipe (the dry run sees it), where Megatron-LM would skip validation silently.
    with pytest.raises(ValueError, match="gives the valid split no share, but data.eval_iters=2 asks for validation"):
        _build_small(tmp_path, corpora["small"], tokenizer, split="100,0,0")
    with pytest.raises(ValueError, match="gives the valid split no share, but valid_samples=8"):
        _build_small(tmp_path, corpora["small"], tokenizer, split="100,0,0", eval_iters=0)
    train, valid, _ = _build_small(tmp_path, corpora["small"], tokenizer, split="100,0,0", eval_iters=0,
                                   valid_samples=0)
    assert valid is None and len(train) >= 8


def test_token_ids_beyond_the_vocab(tmp_path, corpora):
    # Data tokenized with Mistral's 32k vocab, read with a 1000-piece SentencePiece model.
    model = assets.member("sentencepiece-sdist", "sentencepiece-0.2.3/test/botchan_en_bpe_1000.model")
    small = build_tokenizer(TokenizerConfig(tokenizer_model=str(model)))
    prefix = corpora["small"]
    at_start = re.escape(f"{prefix}.bin: token id ") + r"\d+ \(document 0, .* outside the vocab \[0, 1000\)"
    with pytest.raises(ValueError, match=at_start):
        _build_small(tmp_path, prefix, small)
    # Too large to scan at start-up: the per-batch check catches it.
    config = _config(tmp_path, prefix, max_tokens_to_scan=0)
    train, _, _ = build_datasets(config, tokenizer=small, train_samples=8, valid_samples=8, seed=1234)
    iterator = build_train_iterator(train, config=config, dp_rank=0, dp_size=1, consumed_samples=0)
    in_batch = r"token id \d+ in tokens of train sample 0, from " + re.escape(prefix) + ", is outside"
    with pytest.raises(ValueError, match=in_batch):
        next(iterator)


def test_token_dtype_too_small_for_the_vocab(tmp_path, news_texts, tokenizer):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    # A byte-level (uint8) dataset cannot have been made with a 32k-piece tokenizer.
    prefix = str(tmp_path / "bytes")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint8)
    for text in news_texts[:20]:
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        builder.add_document(ids, [len(ids)])
    builder.finalize(prefix + ".idx")
    message = re.escape(f"{prefix}.bin: token dtype uint8 cannot hold the ids [0, 32000)")
    with pytest.raises(ValueError, match=message):
        _build_small(tmp_path, prefix, tokenizer)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"data_path": ()}, "give data_path .* or train_data_path .*not neither"),
        ({"data_path": ("0.3", "x", "y")}, "either only prefixes or alternating 'weight prefix' pairs"),
        ({"data_path": ("0", "x", "1", "y")}, "blend weights must be > 0"),
        ({"split": "98;2"}, "split: expected 'train,valid,test'"),
        ({"split": "0,100,0"}, "split: expected 'train,valid,test'"),
        ({"seq_length": 0}, "seq_length: expected >= 1"),
        ({"num_workers": -1}, "num_workers: expected >= 0"),
    ],
)
def test_config_errors_name_the_field(change, message):
    fields = {"data_path": ("x",), "seq_length": SEQ, "micro_batch_size": MBS, "global_batch_size": GBS}
    with pytest.raises(ValueError, match=message):
        DataConfig(**{**fields, **change})


@pytest.mark.parametrize("data_path", [("a",), ("a", "b"), ("a", "b", "c"), ("0.3", "a", "0.7", "b"),
                                       ("1", " a "), ("2e-1", "a", "3", "b", "5", "c"), ("x1", "a")])
def test_blend_reads_data_path_as_megatron_does(data_path):
    from megatron.core.datasets.utils import get_blend_from_list

    fields = {"seq_length": SEQ, "micro_batch_size": MBS, "global_batch_size": GBS}
    prefixes, weights = DataConfig(data_path=data_path, **fields).blend
    expected_prefixes, expected_weights = get_blend_from_list(list(data_path))
    assert (prefixes, weights) == (list(expected_prefixes), expected_weights and list(expected_weights))


def _zero_pointers(prefix: str) -> None:
    with open(prefix + ".idx", "r+b") as f:
        header = f.read(34)
        n_sequences = int(np.frombuffer(header[18:26], dtype=np.int64)[0])
        f.seek(34 + 4 * n_sequences)
        f.write(b"\0" * 8 * n_sequences)


def test_zeroed_pointer_area_is_refused_naming_the_first_bad_document(tmp_path, corpora, tokenizer):
    """What a crashed copy or a sparse-file hole leaves: sizes intact, every pointer 0. Megatron
    would read every document from the start of the .bin."""
    prefix = _copy_pair(corpora["small"], tmp_path)
    _zero_pointers(prefix)
    message = re.escape(f"{prefix}.idx: corrupt index: sequence 1 (document 1) points at byte 0 of {prefix}.bin")
    with pytest.raises(ValueError, match=message):
        _build_small(tmp_path, prefix, tokenizer)


# Byte ranges of a .idx: the 34-byte preamble, then int32 lengths, int64 pointers, int64 document indices.
def _index_regions(prefix: str) -> dict[str, tuple[int, int]]:
    with open(prefix + ".idx", "rb") as f:
        header = f.read(34)
    n_sequences = int(np.frombuffer(header[18:26], dtype=np.int64)[0])
    n_documents = int(np.frombuffer(header[26:34], dtype=np.int64)[0])
    lengths_end = 34 + 4 * n_sequences
    pointers_end = lengths_end + 8 * n_sequences
    return {"header": (0, 34), "lengths": (34, lengths_end), "pointers": (lengths_end, pointers_end),
            "documents": (pointers_end, pointers_end + 8 * n_documents)}


def _all_tokens(prefix: str) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix, mmap=True)
    return [dataset[i].tolist() for i in range(len(dataset))]


@pytest.mark.parametrize("region", ["header", "lengths", "pointers", "documents"])
def test_corrupt_index_fuzz(tmp_path, corpora, tokenizer, region):
    """Random corruptions of one region of a real .idx (bytes zeroed, randomised, or the file cut
    there): every one either reads exactly the original tokens of every document, or stops in the
    start-up check (before any step) with a message naming the file."""
    from megatron_ext.data.index_checks import read_index

    original = _all_tokens(corpora["small"])
    reference = (Path(corpora["small"] + ".idx")).read_bytes()
    start, end = _index_regions(corpora["small"])[region]
    rng = np.random.default_rng(sum(map(ord, region)))
    refused = 0
    for trial in range(40):
        data = bytearray(reference)
        at = int(rng.integers(start, end))
        span = int(rng.integers(1, min(16, end - at) + 1))
        kind = ("zero", "random", "truncate")[trial % 3]
        if kind == "zero":
            data[at:at + span] = bytes(span)
        elif kind == "random":
            data[at:at + span] = rng.integers(0, 256, span, dtype=np.uint8).tobytes()
        else:
            data = data[:at]
        prefix = str(tmp_path / f"fuzz{trial}")
        shutil.copy(corpora["small"] + ".bin", prefix + ".bin")
        Path(prefix + ".idx").write_bytes(bytes(data))
        try:
            read_index(prefix)
        except ValueError as error:
            assert prefix + ".idx" in str(error) or prefix + ".bin" in str(error), str(error)
            refused += 1
            continue
        assert _all_tokens(prefix) == original, f"{kind} at byte {at} (+{span}) read other tokens"
    assert refused >= 20  # most corruptions change something


def test_the_index_header_read_without_megatron_is_megatrons():
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER

    from megatron_ext.data import index_checks

    assert index_checks.INDEX_HEADER == _INDEX_HEADER
