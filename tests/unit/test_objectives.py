"""MLM/CLM objectives: masking statistics, determinism, the GPTDataset contract, the loss sums."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_ext.objectives import (
    IGNORE_INDEX,
    MaskingConfig,
    apply_clm,
    apply_mlm,
)

# all-MiniLM-L6-v2's WordPiece vocabulary.
PAD, CLS, SEP, MASK, VOCAB = 0, 101, 102, 103, 30522
SPECIALS = (PAD, CLS, SEP)


@pytest.fixture(scope="module")
def wordpiece(minilm_dir):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    # The sentence-transformers file truncates to 128 tokens and pads batches: whole documents.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    assert [tokenizer.token_to_id(t) for t in ("[PAD]", "[CLS]", "[SEP]", "[MASK]")] == [
        PAD, CLS, SEP, MASK,
    ]
    return tokenizer


@pytest.fixture(scope="module")
def news_batch(wordpiece, news_texts) -> torch.Tensor:
    """Real news text as [CLS] doc [SEP] ... packed into [64, 512]; 8 rows end in padding."""
    ids = []
    for encoding in wordpiece.encode_batch(news_texts, add_special_tokens=False):
        ids += [CLS, *encoding.ids, SEP]
    tokens = torch.tensor(ids[: 64 * 512]).view(64, 512)
    tokens[-8:, -100:] = PAD
    return tokens


def _mlm(tokens, seed=0, **config):
    config.setdefault("mask_ratio", 0.4)
    return apply_mlm(
        tokens,
        config=MaskingConfig(**config),
        mask_id=MASK,
        vocab_size=VOCAB,
        special_ids=SPECIALS,
        generator=torch.Generator().manual_seed(seed),
    )


@pytest.mark.parametrize("ratio", [0.2, 0.3, 0.4, 0.5])
def test_exact_masked_count_per_sequence(news_batch, ratio):
    out = _mlm(news_batch, mask_ratio=ratio)
    eligible = ~torch.isin(news_batch, torch.tensor([*SPECIALS, MASK]))
    selected = out.loss_mask.bool()
    expected = torch.floor(eligible.sum(1).double() * ratio + 0.5).long()
    assert torch.equal(selected.sum(1), expected)
    assert not (selected & ~eligible).any()
    assert abs(selected.sum().item() / eligible.sum().item() - ratio) < 1e-3
    # 100 % <mask> replacement by default; labels only (and exactly) at selected positions.
    assert (out.input_ids[selected] == MASK).all()
    assert torch.equal(out.input_ids[~selected], news_batch[~selected])
    assert torch.equal(out.labels[selected], news_batch[selected])
    assert (out.labels[~selected] == IGNORE_INDEX).all()
    assert out.loss_mask.dtype == torch.float32 and out.causal is False
    # The host-side bound the LM head selects by: never below a row's count, reached by a row
    # with nothing excluded.
    assert out.max_scored_per_sequence >= int(selected.sum(1).max())
    full_row = _mlm(torch.full((1, news_batch.shape[1]), 100), mask_ratio=ratio)
    assert out.max_scored_per_sequence == int(full_row.loss_mask.sum())


def test_selection_is_uniform_over_positions(news_batch):
    """Per position bucket the selected share of eligible tokens stays within 5 sigma of 0.4."""
    out = _mlm(news_batch)
    eligible = ~torch.isin(news_batch, torch.tensor([*SPECIALS, MASK]))
    for bucket in range(8):
        cols = slice(64 * bucket, 64 * (bucket + 1))
        n = eligible[:, cols].sum().item()
        share = out.loss_mask[:, cols].sum().item() / n
        assert abs(share - 0.4) < 5 * math.sqrt(0.4 * 0.6 / n), (bucket, share)


def test_80_10_10_split_within_binomial_bounds(news_batch):
    out = _mlm(news_batch, mask_replace_prob=0.8, random_replace_prob=0.1)
    selected = out.loss_mask.bool()
    n = selected.sum().item()
    new, old = out.input_ids[selected], news_batch[selected]
    to_mask = new == MASK
    to_random = ~to_mask & (new != old)
    kept = new == old  # includes the ~n * 0.1 / VOCAB random draws that hit the original token
    for count, p in ((to_mask, 0.8), (to_random, 0.1), (kept, 0.1)):
        assert abs(count.sum().item() - n * p) < 5 * math.sqrt(n * p * (1 - p))
    randoms = new[to_random]
    assert not torch.isin(randoms, torch.tensor([*SPECIALS, MASK])).any()
    assert randoms.min() >= 0 and randoms.max() < VOCAB
    assert torch.equal(out.input_ids[~selected], news_batch[~selected])


def test_random_replacement_is_uniform_over_the_allowed_ids():
    """Random ids are drawn over every id but the special ones and the mask (here at both ends of
    a small vocabulary and side by side), each about equally often."""
    vocab, mask, specials = 12, 6, (0, 5, 11)
    tokens = torch.full((64, 640), 1)
    out = apply_mlm(tokens, config=MaskingConfig(mask_ratio=0.5, mask_replace_prob=0.0, random_replace_prob=1.0),
                    mask_id=mask, vocab_size=vocab, special_ids=specials, generator=torch.Generator().manual_seed(0))
    drawn = out.input_ids[out.loss_mask.bool()]
    counts = torch.bincount(drawn, minlength=vocab)
    allowed = [i for i in range(vocab) if i not in (*specials, mask)]
    assert counts[[*specials, mask]].sum() == 0
    n, p = drawn.numel(), 1 / len(allowed)
    assert all(abs(counts[i].item() - n * p) < 5 * math.sqrt(n * p * (1 - p)) for i in allowed), counts.tolist()


def test_keep_only_leaves_input_unchanged(news_batch):
    out = _mlm(news_batch, mask_replace_prob=0.0)
    assert torch.equal(out.input_ids, news_batch)
    assert out.loss_mask.sum() > 0


def test_specials_and_existing_masks_never_selected():
    tokens = torch.full((4, 64), MASK)
    tokens[:, ::2] = SEP
    tokens[:, 1] = 2000
    out = _mlm(tokens, mask_ratio=0.5, mask_replace_prob=0.5, random_replace_prob=0.5)
    assert out.loss_mask.nonzero()[:, 1].unique().tolist() == [1]


def test_same_seed_same_output_other_seed_differs(news_batch):
    a, b, c = _mlm(news_batch, 7), _mlm(news_batch, 7), _mlm(news_batch, 8)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.loss_mask, c.loss_mask)


def test_maskable_excludes_rows(news_batch):
    maskable = torch.ones(64, 1, dtype=torch.bool)
    maskable[:3] = False
    out = apply_mlm(
        news_batch,
        config=MaskingConfig(mask_ratio=0.4),
        mask_id=MASK,
        vocab_size=VOCAB,
        special_ids=SPECIALS,
        generator=torch.Generator().manual_seed(0),
        maskable=maskable,
    )
    assert out.loss_mask[:3].sum() == 0 and (out.loss_mask[3:].sum(1) > 0).all()


def test_paper_sized_batch_with_a_llama3_vocabulary():
    """[8, 2048] with a Llama-3-sized vocabulary: the exact count per row, no special id drawn
    (its speed: benchmarks/masking.py)."""
    tokens = torch.randint(128_000, (8, 2048), generator=torch.Generator().manual_seed(0))
    specials = tuple(range(128_000, 128_256))
    out = apply_mlm(tokens, config=MaskingConfig(mask_ratio=0.4, mask_replace_prob=0.8, random_replace_prob=0.1),
                    mask_id=128_002, vocab_size=128_256, special_ids=specials,
                    generator=torch.Generator().manual_seed(0))
    assert (out.loss_mask.sum(1) == round(0.4 * 2048)).all()
    assert not torch.isin(out.input_ids, torch.tensor([s for s in specials if s != 128_002])).any()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"mask_ratio": 0.0}, "mask_ratio"),
        ({"mask_ratio": 1.0}, "mask_ratio"),
        ({"mask_ratio": 0.4, "mask_replace_prob": 1.5}, "mask_replace_prob"),
        ({"mask_ratio": 0.4, "random_replace_prob": -0.1}, "random_replace_prob"),
        (
            {"mask_ratio": 0.4, "mask_replace_prob": 0.8, "random_replace_prob": 0.3},
            "random_replace_prob",
        ),
    ],
)
def test_masking_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        MaskingConfig(**kwargs)


def test_apply_mlm_argument_errors():
    tokens = torch.zeros(2, 8, dtype=torch.long)
    common = dict(config=MaskingConfig(mask_ratio=0.4), generator=torch.Generator())
    with pytest.raises(ValueError, match="mask_id"):
        apply_mlm(tokens, mask_id=VOCAB, vocab_size=VOCAB, special_ids=(), **common)
    with pytest.raises(ValueError, match="special_ids"):
        apply_mlm(tokens, mask_id=MASK, vocab_size=VOCAB, special_ids=(-1,), **common)
    with pytest.raises(ValueError, match="tokens"):
        apply_mlm(tokens.int(), mask_id=MASK, vocab_size=VOCAB, special_ids=(), **common)


@pytest.fixture(scope="module")
def gpt_dataset(wordpiece, news_texts, tmp_path_factory):
    """Megatron's own GPTDataset over real news text, EOD = [SEP], eod_mask_loss on."""
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    from megatron.core.datasets.utils import Split
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    prefix = str(tmp_path_factory.mktemp("gpt") / "news")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for encoding in wordpiece.encode_batch(news_texts[:40], add_special_tokens=False):
        document = torch.tensor([*encoding.ids, SEP], dtype=torch.int32)
        builder.add_document(document, [len(document)])
    builder.finalize(prefix + ".idx")
    indexed = IndexedDataset(prefix)
    config = GPTDatasetConfig(
        random_seed=1,
        sequence_length=256,
        tokenizer=NullTokenizer(VOCAB, eod_id=SEP, pad_id=PAD),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=True,
    )
    documents = np.arange(len(indexed), dtype=np.int32)
    return GPTDataset(indexed, prefix, documents, None, Split.train, config)


def _collate(samples):
    return {
        key: torch.stack([s[key] for s in samples])
        for key in ("tokens", "labels", "loss_mask")
    }


def test_clm_on_gpt_dataset_output(gpt_dataset):
    batch = _collate([gpt_dataset[i] for i in range(8)] + [gpt_dataset[None]])
    out = apply_clm(batch["tokens"], batch["labels"], loss_mask=batch["loss_mask"])
    assert out.causal is True and out.input_ids is batch["tokens"]
    scored = out.loss_mask > 0
    assert torch.equal(out.labels[scored], batch["labels"][scored])
    assert (out.labels[~scored] == IGNORE_INDEX).all()
    # Next-token labels, nothing scored after an EOD input (eod_mask_loss) or in batch padding.
    assert torch.equal(batch["labels"][:8, :-1], batch["tokens"][:8, 1:])
    assert (batch["tokens"] == SEP).any()
    assert (out.labels[batch["tokens"] == SEP] == IGNORE_INDEX).all()
    assert out.loss_mask[-1].sum() == 0 and out.loss_mask[:-1].sum() > 0
    assert out.max_scored_per_sequence == batch["tokens"].shape[1]  # the LM head runs everywhere


def test_mlm_on_gpt_dataset_output(gpt_dataset):
    batch = _collate([gpt_dataset[i] for i in range(8)] + [gpt_dataset[None]])
    out = apply_mlm(
        batch["tokens"],
        config=MaskingConfig(mask_ratio=0.3),
        mask_id=MASK,
        vocab_size=VOCAB,
        special_ids=SPECIALS,
        generator=torch.Generator().manual_seed(0),
        maskable=batch["loss_mask"].sum(-1, keepdim=True) > 0,
    )
    assert out.causal is False
    assert out.loss_mask[-1].sum() == 0, "the batch-padding sample must not be trained on"
    assert (out.loss_mask[batch["tokens"] == SEP] == 0).all()
    n_eligible = (batch["tokens"][:-1] != SEP).sum(1).double()
    assert torch.equal(out.loss_mask[:-1].sum(1).long(), torch.floor(n_eligible * 0.3 + 0.5).long())


def test_apply_clm_shape_error():
    with pytest.raises(ValueError, match="loss_mask"):
        ids = torch.zeros(2, 8, dtype=torch.long)
        apply_clm(ids, ids, loss_mask=torch.ones(2, 7))
