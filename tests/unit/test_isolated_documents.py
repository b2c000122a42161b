"""Isolated documents (``data.reset_attention_mask`` / ``data.reset_position_ids``): the packed
pattern (``cu_seqlens``), the local spec's per-document attention against the explicit mask, the
``PackedSeqParams`` Transformer Engine gets, a packed row's logits against each document run
alone, the objectives at document ends, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from helpers import tiny_recipe
from megatron_ext import process_group
from megatron_ext.config_loading import UserError
from megatron_ext.model import build_encoder_model, preset
from megatron_ext.model.attention import (
    THD_MAX_SEQLEN_MULTIPLE,
    attention_pattern,
    document_cu_seqlens,
    explicit_document_mask,
    packed_seq_params_for,
    per_document_attention,
)
from megatron_ext.objectives import CLM, IGNORE_INDEX, MLM, MNTP, PhaseProgress, SpanMLM, Vocabulary, WholeWordMLM
from megatron_ext.objectives.span import select_spans
from megatron_ext.tokenizer import MissingSpecialTokenError, TokenizerConfig, build_tokenizer
from megatron_ext.training.batches import with_document_ends
from megatron_ext.training.datasets import document_end_id
from megatron_ext.training.recipe import run_config_from_dict

EOD = 2


def _rows(s: int) -> torch.Tensor:
    """Rows of ids in [3, 50) with EODs placed: a document cut by each row edge, a one-token
    document (two EODs in a row), a row ending with an EOD, and a row with none."""
    ids = torch.randint(3, 50, (4, s), generator=torch.Generator().manual_seed(0))
    ids[0, [5, 17]] = EOD  # documents [0, 5] (the tail of one before), [6, 17], [18, s) (cut at the edge)
    ids[1, [0, 9, 10, s - 1]] = EOD  # a one-token document at the start, another at 10; ends with EOD
    return ids  # rows 2 and 3: no EOD, one document each


def _documents(row: torch.Tensor) -> list[slice]:
    ends = [i + 1 for i in (row == EOD).nonzero().flatten().tolist()]
    bounds = [0, *[e for e in ends if e < len(row)], len(row)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def test_cu_seqlens_start_documents_at_rows_and_after_each_eod():
    ids = _rows(24)
    expected = []
    for b, row in enumerate(ids):
        expected += [b * 24 + d.start for d in _documents(row)]
    cu = document_cu_seqlens(ids == EOD)
    assert cu.dtype == torch.int32 and cu.tolist() == [*expected, 4 * 24]
    assert expected[:3] == [0, 6, 18] and expected[3:7] == [24, 25, 34, 35]  # the layouts _rows promises


@pytest.mark.parametrize("causal", [False, True])
def test_per_document_attention_equals_the_explicit_mask(causal):
    s, b, heads, groups, d = 40, 4, 4, 2, 8
    ids = _rows(s)
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(s, b, heads, d, generator=generator, requires_grad=True)
    k, v = (torch.randn(s, b, groups, d, generator=generator, requires_grad=True) for _ in range(2))
    packed = per_document_attention(q, k, v, document_cu_seqlens(ids == EOD), causal=causal, enable_gqa=True)
    mask = explicit_document_mask(ids == EOD, causal=causal)
    reference = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), attn_mask=~mask,
                                               enable_gqa=True).permute(2, 0, 1, 3).reshape(s, b, -1)
    torch.testing.assert_close(packed, reference)
    weights = torch.randn(packed.shape, generator=generator)
    grads = torch.autograd.grad((packed * weights).sum(), (q, k, v))
    expected = torch.autograd.grad((reference * weights).sum(), (q, k, v))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


def test_transformer_engine_gets_thd_packed_seq_params_without_padding():
    ids = _rows(100)
    cu = document_cu_seqlens(ids == EOD)
    params = packed_seq_params_for(cu, 100)
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q is cu and params.cu_seqlens_kv is cu  # self-attention: one layout
    assert params.cu_seqlens_q_padded is None and params.cu_seqlens_kv_padded is None  # contiguous tokens
    assert params.max_seqlen_q == params.max_seqlen_kv == 128  # the row, rounded up as TE rounds
    assert 128 % THD_MAX_SEQLEN_MULTIPLE == 0
    # The pattern that reaches TE's core attention: the documents and the direction.
    for causal in (False, True):
        pattern = attention_pattern(causal=causal, document_ends=ids == EOD)
        assert pattern.causal == causal and torch.equal(pattern.documents, cu)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    process_group.init_process_group_and_model_parallel(
        init_method=f"file://{tmp_path_factory.mktemp('pg')}/rendezvous", rank=0, world_size=1)
    torch.manual_seed(0)
    yield build_encoder_model(preset("tiny", vocab_size=1024, num_layers=2, hidden_size=64, ffn_hidden_size=128,
                                     num_attention_heads=4, num_query_groups=2)).eval()
    process_group.destroy_process_group_and_model_parallel()


def _reset_positions(ids: torch.Tensor) -> torch.Tensor:
    """GPTDataset's ``reset_position_ids``: 0 at each document's first token."""
    positions = torch.empty_like(ids)
    for b, row in enumerate(ids):
        for document in _documents(row):
            positions[b, document] = torch.arange(document.stop - document.start)
    return positions


@pytest.mark.parametrize("causal", [True, False], ids=["clm", "mlm"])
def test_a_packed_rows_logits_equal_each_document_run_alone(model, bpe_and_news, causal):
    """Both settings on, fp32: every document of every row (cut by the row edge, one token long,
    the whole row) gives the logits it gives alone."""
    tokenizer, packed = bpe_and_news
    eod = tokenizer.eod
    ids = packed[:3, :96].clone()
    ids[1, 40:42] = eod  # a one-token document (the second EOD)
    ids[2] = torch.where(ids[2] == eod, 5, ids[2])  # a row with no end of document
    with torch.no_grad():
        logits = model(ids, packed_seq_params=attention_pattern(causal=causal, document_ends=ids == eod),
                       position_ids=_reset_positions(torch.where(ids == eod, EOD, 0)))
        seen = 0
        for b, row in enumerate(torch.where(ids == eod, EOD, 0)):
            for document in _documents(row):
                alone = model(ids[b:b + 1, document], packed_seq_params=attention_pattern(causal=causal))
                torch.testing.assert_close(logits[b:b + 1, document], alone)
                seen += 1
        assert seen >= 5  # row 0 holds an end of document, row 1 a one-token document
        crossing = model(ids, packed_seq_params=attention_pattern(causal=causal))  # the paper's setting: documents attend across
        assert (crossing - logits).abs().amax() > 1e-3


@pytest.fixture(scope="module")
def bpe_and_news(tiny_corpus, news_texts):
    """The news BPE and the articles packed (document + EOD) into [8, 128] rows, as GPTDataset does."""
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_model=tiny_corpus["tokenizer"]))
    ids = []
    for document in tokenizer.tokenize_batch(news_texts[:40]):
        ids += [*document, tokenizer.eod]
    return tokenizer, torch.tensor(ids[: 8 * 128]).view(8, 128)


def _batch(tokens: torch.Tensor, document_end_id: int | None) -> dict[str, torch.Tensor]:
    """GPTDataset's micro-batch as the trainer hands it to the objectives (``training.batches``)."""
    batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, dims=1), "loss_mask": torch.ones(tokens.shape)}
    return with_document_ends(batch, document_end_id)


def _make(objective, tokens, vocabulary, seed=0, *, document_end_id=None):
    return objective.make_batch(_batch(tokens, document_end_id), progress=PhaseProgress(step=0, steps=1),
                                vocabulary=vocabulary, generator=torch.Generator().manual_seed(seed))


def test_clm_does_not_predict_across_a_document_end_when_isolated(bpe_and_news):
    tokenizer, tokens = bpe_and_news
    at_eod = tokens == tokenizer.eod
    assert at_eod.any()
    crossing = _make(CLM(), tokens, Vocabulary(tokenizer, size=1024))
    assert crossing.loss_mask.all() and crossing.document_ends is None  # the paper's setting
    isolated = _make(CLM(), tokens, Vocabulary(tokenizer, size=1024), document_end_id=tokenizer.eod)
    assert torch.equal(isolated.document_ends, at_eod)
    assert torch.equal(isolated.loss_mask == 0, at_eod)
    assert (isolated.labels[at_eod] == IGNORE_INDEX).all()


@pytest.mark.parametrize("objective", [MLM(mask_ratio=0.5, mask_replace_prob=0.5, random_replace_prob=0.5),
                                       WholeWordMLM(mask_ratio=0.5), SpanMLM(mask_ratio=0.5, span_unit="token"),
                                       MNTP(mask_ratio=0.5, mask_replace_prob=0.5, random_replace_prob=0.5)],
                         ids=lambda o: o.tag)
def test_masking_never_selects_nor_forges_an_end_of_document(bpe_and_news, objective):
    tokenizer, tokens = bpe_and_news
    vocabulary = Vocabulary(tokenizer, size=1024)
    at_eod = tokens == tokenizer.eod
    for seed in range(4):
        batch = _make(objective, tokens, vocabulary, seed, document_end_id=tokenizer.eod)
        assert torch.equal(batch.document_ends, at_eod) and not batch.causal
        assert torch.equal(batch.input_ids == tokenizer.eod, at_eod)  # kept where they were, none drawn
        selected = batch.labels != IGNORE_INDEX
        assert selected.any()
        if objective.prediction_offset == 0:
            assert not (selected & at_eod).any()
        else:  # MNTP: position p predicts p + 1, never across an end (p an EOD) nor an EOD itself
            assert not (selected & at_eod).any() and not (selected[:, :-1] & at_eod[:, 1:]).any()


def test_spans_never_cover_two_documents(bpe_and_news):
    tokenizer, tokens = bpe_and_news
    eod = tokenizer.eod
    eligible = tokens != eod
    ends = (tokens == eod).long()
    document = ends.cumsum(dim=1) - ends
    crossed = {False: 0, True: 0}
    for split in (False, True):
        for seed in range(6):
            picked = select_spans(tokens, eligible, mask_ratio=0.6, generator=torch.Generator().manual_seed(seed),
                                  span_p=0.05, max_span_length=30, word_boundaries=None,
                                  document_end_id=eod if split else None)
            unit = picked.replaced_together
            for b in range(tokens.shape[0]):
                for u in unit[b][picked.positions[b]].unique().tolist():
                    members = picked.positions[b] & (unit[b] == u)
                    crossed[split] += int(document[b][members].unique().numel() > 1)
    assert crossed[False] > 0  # long spans do cross an end when not cut there
    assert crossed[True] == 0


def test_rows_without_a_document_end_keep_their_spans(bpe_and_news):
    tokenizer, tokens = bpe_and_news
    row = torch.where(tokens[:1] == tokenizer.eod, 5, tokens[:1])
    picks = [select_spans(row, torch.ones_like(row, dtype=torch.bool), mask_ratio=0.4,
                          generator=torch.Generator().manual_seed(0), span_p=0.2, max_span_length=10,
                          word_boundaries=None, document_end_id=eod) for eod in (None, tokenizer.eod)]
    assert torch.equal(picks[0].positions, picks[1].positions)


def _gpt2_without_eod(tmp_path):
    vocab = {chr(c): i for i, c in enumerate(range(ord("a"), ord("z") + 1))}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    return {"vocab_file": str(tmp_path / "vocab.json"), "merge_file": str(tmp_path / "merges.txt"),
            "tokenizer_type": "GPT2BPETokenizer"}


def test_a_tokenizer_without_an_end_of_document_is_refused_naming_the_setting(tmp_path, tiny_corpus):
    from megatron_ext.training.preflight import check_tokenizer_serves

    tokenizer = build_tokenizer(TokenizerConfig(**_gpt2_without_eod(tmp_path)))
    config = run_config_from_dict(tiny_recipe(tiny_corpus, tmp_path, data={"reset_attention_mask": True},
                                              phases=[{"objective": "clm", "share": 1.0}],
                                              training={"train_iters": 8, "eval_interval": 0}))
    with pytest.raises(MissingSpecialTokenError) as refused:
        check_tokenizer_serves(config, tokenizer)
    message = str(refused.value)
    assert "\n" not in message and "data.reset_attention_mask" in message and "end-of-document" in message
    with pytest.raises(MissingSpecialTokenError, match="data.reset_attention_mask.*has no eod token"):
        document_end_id(config.data, tokenizer)  # what the trainer's batches ask before the first step
    assert Vocabulary(tokenizer, size=32).eod_id is None


@pytest.mark.parametrize("key", ["document_mask", "eod_token_id"])
def test_the_old_model_keys_are_refused_pointing_at_the_data_setting(tmp_path, tiny_corpus, key):
    recipe = tiny_recipe(tiny_corpus, tmp_path)
    recipe["model"][key] = True if key == "document_mask" else 2
    with pytest.raises(UserError) as refused:
        run_config_from_dict(recipe)
    message = str(refused.value)
    assert "\n" not in message and f"unknown key(s) ['{key}'] ({key} is now data.reset_attention_mask" in message


def test_flags_with_megatrons_names_set_both_settings(tmp_path, tiny_corpus):
    import argparse

    from megatron_ext.training.recipe import add_override_flags, apply_overrides

    parser = argparse.ArgumentParser()
    dests = add_override_flags(parser)
    raw = apply_overrides(tiny_recipe(tiny_corpus, tmp_path),
                          parser.parse_args(["--reset-attention-mask", "--reset-position-ids"]), dests)
    data = run_config_from_dict(raw).data
    assert data.reset_attention_mask and data.reset_position_ids


def test_the_study_planner_takes_isolation_as_an_axis(tmp_path):
    """``reset_attention_mask: [false, true]`` plans every run both ways; the isolated ones branch
    only from isolated runs (the setting is part of what a step computes)."""
    from pathlib import Path

    import yaml

    from megatron_ext.config_loading import ConfigError
    from megatron_ext.study.plan import plan_study
    from megatron_ext.study.spec import read_study

    base = Path(__file__).resolve().parents[2] / "examples/recipes/base/610m.yaml"
    study = {"name": "t", "sizes": [{"name": "610m", "base": str(base)}], "budgets": [12000, 42000],
             "objectives": [{"objective": "clm"}], "reset_attention_mask": [False, True]}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    plan = plan_study(read_study(path), path)
    runs = {run.name: run for run in plan.runs}
    assert set(runs) == {"610m_clm_12k", "610m_clm_42k", "610m_clm_12k_iso", "610m_clm_42k_iso"}
    assert [runs[n].config.data.reset_attention_mask for n in sorted(runs)] == [False, True, False, True]
    parents = {segment.run: segment.parent for segment in plan.segments}
    assert parents["610m_clm_12k_iso"] == "610m_clm_42k_iso" and parents["610m_clm_12k"] == "610m_clm_42k"
    path.write_text(yaml.safe_dump({**study, "overrides": {"data": {"reset_attention_mask": True}}}))
    with pytest.raises(ConfigError, match="reset_attention_mask"):
        plan_study(read_study(path), path)


@pytest.mark.parametrize("flag", ["--document-mask", "--eod-token-id"])
def test_the_old_flags_are_gone(flag):
    import argparse

    from megatron_ext.training.recipe import add_override_flags

    parser = argparse.ArgumentParser()
    add_override_flags(parser)
    assert flag not in parser.format_help() and "--reset-attention-mask" in parser.format_help()
