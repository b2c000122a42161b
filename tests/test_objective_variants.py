"""The objectives beyond CLM and plain MLM, on real news text: a masking-ratio schedule, whole-word
masking, span masking and MNTP (statistics of their corruption, their names, the study planner,
and an exactly resumed run through all four)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import unicodedata
from pathlib import Path

import pytest
import torch

from helpers import tiny_recipe
from megatron_ext.cli import plot_loss
from megatron_ext.config_loading import ConfigError, UserError
from megatron_ext.objectives import (
    IGNORE_INDEX, MLM, MNTP, PhaseProgress, SpanMLM, Vocabulary, WholeWordMLM,
)
from megatron_ext.objectives.span import mean_span_length, span_cap
from megatron_ext.tokenizer import TokenizerConfig, build_tokenizer

ROOT = Path(__file__).resolve().parents[1]
ROWS, SEQ = 64, 256


@pytest.fixture(scope="module")
def bpe(tiny_corpus):
    """Byte-level BPE (1,024 ids) trained on the news articles; word starts carry 'Ġ'."""
    return build_tokenizer(TokenizerConfig(tokenizer_model=tiny_corpus["tokenizer"]))


@pytest.fixture(scope="module")
def vocabulary(bpe):
    return Vocabulary(bpe, size=1024)


@pytest.fixture(scope="module")
def news(bpe, news_texts) -> dict[str, torch.Tensor]:
    """The articles packed as documents + EOD into [64, 256], as GPTDataset yields them."""
    ids = []
    for document in bpe.tokenize_batch(news_texts):
        ids += [*document, bpe.eod]
    tokens = torch.tensor(ids[: ROWS * SEQ]).view(ROWS, SEQ)
    return {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(ROWS, SEQ)}


def _eligible(tokens: torch.Tensor, vocabulary: Vocabulary) -> torch.Tensor:
    return ~torch.isin(tokens, torch.tensor(sorted({*vocabulary.special_ids, vocabulary.mask_id})))


def _apply(objective, news, vocabulary, *, seed=0, step=0, steps=1):
    return objective.make_batch(news, progress=PhaseProgress(step=step, steps=steps), vocabulary=vocabulary,
                                generator=torch.Generator().manual_seed(seed))


def test_mask_ratio_schedule_is_a_pure_function_of_the_step(news, vocabulary):
    linear = MLM(mask_ratio=0.3, mask_ratio_schedule="linear", final_mask_ratio=0.05)
    cosine = dataclasses.replace(linear, mask_ratio_schedule="cosine")
    assert (linear.name, cosine.name, cosine.study_kind) == ("mlm-30to5", "mlm-30to5-cosine", "mlm_30to5_cosine")

    def at(objective, step):
        return objective.mask_ratio_at(PhaseProgress(step=step, steps=11))

    assert [at(linear, s) for s in (0, 5, 10)] == pytest.approx([0.3, 0.175, 0.05])
    assert [at(cosine, s) for s in (0, 5, 10)] == pytest.approx([0.3, 0.175, 0.05])
    assert at(cosine, 2) > at(linear, 2) and at(cosine, 8) < at(linear, 8)  # cosine: flat at both ends
    eligible = _eligible(news["tokens"], vocabulary).sum(1).double()
    for step in (0, 4, 10):
        ratio = at(cosine, step)
        out = _apply(cosine, news, vocabulary, step=step, steps=11)
        assert torch.equal(out.loss_mask.sum(1).long(), torch.floor(eligible * ratio + 0.5).long())
        assert out.max_scored_per_sequence == math.floor(SEQ * ratio + 0.5)
        assert torch.equal(out.input_ids, _apply(cosine, news, vocabulary, step=step, steps=11).input_ids)
    # Memory holds the phase's largest share; a branch compares what each step computes: a constant
    # 0.3 phase is the same step as the schedule at its start only.
    assert cosine.peak_lm_head_share(seq_length=SEQ) == 0.3
    constant = MLM(mask_ratio=0.3)
    assert constant.step_identity(PhaseProgress(step=0, steps=11)) == cosine.step_identity(PhaseProgress(step=0, steps=11))
    assert constant.step_identity(PhaseProgress(step=1, steps=11)) != cosine.step_identity(PhaseProgress(step=1, steps=11))
    with pytest.raises(UserError, match="final_mask_ratio must be set exactly when"):
        MLM(mask_ratio=0.3, mask_ratio_schedule="linear")
    with pytest.raises(UserError, match=r"mask_ratio must be in \(0, 1\), got 1.2"):
        MLM(mask_ratio=0.3, mask_ratio_schedule="cosine", final_mask_ratio=1.2)


def test_a_stretched_schedule_is_another_run_from_its_second_step(tmp_path):
    """Branching compares the ratio at each step: the same schedule over 8 or 16 steps agrees at
    step 0 only."""
    from megatron_ext.training.branching import first_divergence
    from megatron_ext.training.config import run_config_from_dict

    phases = [{"objective": {"name": "mlm", "mask_ratio": 0.4, "mask_ratio_schedule": "linear",
                             "final_mask_ratio": 0.2}, "share": 1.0}]
    corpus = {"tokenizer": "unused", "data": "unused"}
    short, long = (run_config_from_dict(tiny_recipe(corpus, tmp_path, phases=phases, training={"train_iters": n}))
                   for n in (8, 16))
    found = first_divergence(short, long)
    assert found.step == 1
    assert "phase mlm 0.4->0.2 linear (steps 0-7) vs mlm 0.4->0.2 linear (steps 0-15)" in found.reason


def _bert_splits(c: str) -> bool:
    """Punctuation (Unicode P*, or non-alphanumeric printable ASCII) or a CJK ideograph, told
    apart by the character's Unicode category and name."""
    return (unicodedata.category(c).startswith("P") or (c.isascii() and c.isprintable() and not c.isalnum())
            or unicodedata.name(c, "").startswith(("CJK UNIFIED IDEOGRAPH", "CJK COMPATIBILITY IDEOGRAPH")))


def _bert_word_starts(text: str) -> set[int]:
    """Character offsets where BERT's words begin: text split at whitespace, around punctuation and
    around CJK ideographs, written independently of the tokenizer's vocabulary tables."""
    return {i for i, c in enumerate(text)
            if not c.isspace() and (i == 0 or _bert_splits(c) or text[i - 1].isspace() or _bert_splits(text[i - 1]))}


def _token_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and character spans of ``text``'s tokens."""
    if hasattr(tokenizer, "_backend"):
        encoding = tokenizer._backend.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets
    proto = tokenizer._sp.encode(text, return_type="proto")  # byte offsets into the UTF-8 text
    char_at = {len(text[:i].encode("utf-8")): i for i in range(len(text) + 1)}
    return [p.id for p in proto.pieces], [(char_at[p.begin], char_at[p.end]) for p in proto.pieces]


WORD_TEXT = ('Café owners (and "naïve" résumé-writers) said: élan, sorry... it\'s 2026!\n'
             "New line: [brackets] and {braces}; über-fast. 東京 and 北京, twice:  spaces.")


@pytest.mark.parametrize("kind", ["byte-level BPE", "SentencePiece", "WordPiece"])
def test_word_boundaries_are_berts_words(kind, bpe, minilm_dir, news_texts):
    """A token starts a word exactly where BERT's split (whitespace, punctuation) starts one in
    the text: on news articles with their punctuation and a line of accents, brackets, quotes and
    a newline. Byte-level BPE splits 'é' into two pieces, neither of them punctuation."""
    from megatron_ext import assets

    tokenizer = {
        "byte-level BPE": lambda: bpe,
        "SentencePiece": lambda: build_tokenizer(TokenizerConfig(tokenizer_model=str(
            assets.member("sentencepiece-sdist", "sentencepiece-0.2.3/test/botchan_en_bpe_1000.model")))),
        "WordPiece": lambda: build_tokenizer(TokenizerConfig(tokenizer_model=str(minilm_dir))),
    }[kind]()
    starts, ends = tokenizer.word_boundaries()
    assert all(starts[i] and ends[i] for i in tokenizer.special_ids)
    checked = split_characters = 0
    for text in [WORD_TEXT, *news_texts[:20]]:
        expected = _bert_word_starts(text)
        ids, spans = _token_offsets(tokenizer, text)
        for k, (token, (begin, end)) in enumerate(zip(ids, spans)):
            first = next((i for i in range(begin, end) if not text[i].isspace()), None)
            if first is None:  # whitespace alone: it starts the word after it
                assert starts[token] and not ends[token], (kind, repr(text[begin:end]))
                continue
            if token in tokenizer.special_ids or (k > 0 and ids[k - 1] in tokenizer.special_ids):
                continue  # next to an unknown character (a special token ends words)
            cut = k > 0 and (tokenizer.detokenize([ids[k - 1]]).endswith("\ufffd")
                             or tokenizer.detokenize([token]).startswith("\ufffd"))
            if cut and (_bert_splits(text[first]) or _bert_splits(text[first - 1])):
                continue  # next to an ideograph or punctuation cut into bytes (the documented limit)
            # (a word may begin at the whitespace token before it)
            after_whitespace = k > 0 and text[spans[k - 1][0]:spans[k - 1][1]].isspace()
            is_start = starts[token] or k == 0 or ends[ids[k - 1]] or after_whitespace
            if k > 0 and spans[k - 1][0] == begin and first < spans[k - 1][1]:
                should = False  # the second piece of a character split across tokens
                split_characters += 1
            else:
                should = first in expected
            checked += 1
            assert is_start == should, (kind, text[max(0, begin - 15): end + 15], tokenizer.detokenize([token]))
    assert checked > 3000
    assert split_characters > 0 or kind != "byte-level BPE", "the accents must be split into bytes"


def test_whole_word_masking_takes_whole_words(news, vocabulary, bpe):
    out = _apply(WholeWordMLM(mask_ratio=0.4), news, vocabulary)
    tokens, selected = news["tokens"], out.loss_mask.bool()
    eligible = _eligible(tokens, vocabulary)
    # A token continues a word unless it starts one or the token before it ends one (the tables
    # are checked against BERT's words in test_word_boundaries_are_berts_words).
    starts, ends = (torch.tensor(table) for table in bpe.word_boundaries())
    continues = ~starts[tokens[:, 1:]] & ~ends[tokens[:, :-1]] & eligible[:, 1:] & eligible[:, :-1]
    assert continues.float().mean() > 0.1, "the text must have multi-token words"
    assert torch.equal(selected[:, 1:][continues], selected[:, :-1][continues]), "a word was split"
    # At most MLM's exact count per row, short by less than one (longest) word; overall within 2 points.
    target = torch.floor(eligible.sum(1).double() * 0.4 + 0.5).long()
    counts = selected.sum(1)
    assert (counts <= target).all() and (counts > target - 12).all()
    share = selected.sum().item() / eligible.sum().item()
    assert 0.38 < share <= 0.4
    assert not (selected & ~eligible).any() and (out.input_ids[selected] == vocabulary.mask_id).all()
    assert out.max_scored_per_sequence == math.floor(SEQ * 0.4 + 0.5) and out.causal is False
    # Multi-token words are masked too, at about the same rate as their tokens' share.
    multi_token_word_tokens = torch.zeros_like(selected)
    multi_token_word_tokens[:, 1:] |= continues
    multi_token_word_tokens[:, :-1] |= continues
    assert abs(selected[multi_token_word_tokens].float().mean().item() - 0.4) < 0.05


def test_span_masking_follows_spanbert_lengths(news, vocabulary):
    objective = SpanMLM(mask_ratio=0.4)
    assert objective.name == "span-40" and mean_span_length(0.2, 10) == pytest.approx(3.797, abs=1e-3)
    eligible = _eligible(news["tokens"], vocabulary)
    lengths, selected_total = [], 0
    for seed in range(5):
        out = _apply(objective, news, vocabulary, seed=seed)
        selected = out.loss_mask.bool()
        assert not (selected & ~eligible).any()
        assert out.max_scored_per_sequence == span_cap(SEQ, 0.4, 10) and (selected.sum(1) <= span_cap(SEQ, 0.4, 10)).all()
        selected_total += selected.sum().item()
        # Runs of selected tokens inside eligible text, away from the row ends: whole spans.
        for row, keep in zip(selected.tolist(), eligible.tolist()):
            start = None
            for i, on in enumerate(row + [False]):
                if on and start is None:
                    start = i
                elif not on and start is not None:
                    if start > 0 and i < SEQ and keep[start - 1] and keep[i]:
                        lengths.append(i - start)
                    start = None
    share = selected_total / (5 * eligible.sum().item())
    assert abs(share - 0.4) < 0.015, share
    n = len(lengths)
    mean, sd = sum(lengths) / n, (sum((x - 3.797) ** 2 for x in lengths) / n) ** 0.5
    assert n > 5000 and abs(mean - 3.797) < 4 * sd / n**0.5, (n, mean)
    assert max(lengths) == 10 and min(lengths) == 1
    p1 = 0.2 / (1 - 0.8**10)  # SpanBERT's truncated law at length 1
    assert abs(lengths.count(1) / n - p1) < 4 * math.sqrt(p1 * (1 - p1) / n)
    with pytest.raises(UserError, match="above 0.792"):
        SpanMLM(mask_ratio=0.85)


def test_mntp_predicts_each_masked_token_from_the_previous_position(news, vocabulary):
    objective = MNTP(mask_ratio=0.2, mask_replace_prob=0.8, random_replace_prob=0.1)
    out = _apply(objective, news, vocabulary)
    tokens, scored = news["tokens"], out.loss_mask.bool()
    assert objective.name == "mntp-20" and out.causal is False and not scored[:, -1].any()
    rows, cols = scored.nonzero(as_tuple=True)
    assert torch.equal(out.labels[rows, cols], tokens[rows, cols + 1])  # the next position's original token
    assert (out.labels[~scored] == IGNORE_INDEX).all()
    changed = out.input_ids != tokens
    assert not changed[:, 0].any() and not (changed[:, 1:] & ~scored[:, :-1]).any()
    eligible = _eligible(tokens, vocabulary)
    eligible[:, 0] = False
    assert torch.equal(scored.sum(1), torch.floor(eligible.sum(1).double() * 0.2 + 0.5).long())
    predicted = out.input_ids[:, 1:][scored[:, :-1]]
    n = predicted.numel()
    masked = (predicted == vocabulary.mask_id).sum().item()
    assert abs(masked - 0.8 * n) < 5 * math.sqrt(n * 0.8 * 0.2)


def test_study_planner_accepts_every_objective(tmp_path):
    import yaml

    from megatron_ext.study.plan import plan_study
    from megatron_ext.study.spec import read_study

    study = {"name": "t", "sizes": [{"name": "610m", "base": str(ROOT / "examples/recipes/base/610m.yaml")}],
             "budgets": [12000], "objectives": [
                 {"objective": "wwm", "mask_ratio": 0.3},
                 {"objective": {"name": "span", "mask_ratio": 0.3}},
                 {"objective": "mntp", "mask_ratio": 0.2},
                 {"objective": {"name": "mlm", "mask_ratio": 0.3, "mask_ratio_schedule": "linear",
                                "final_mask_ratio": 0.05}}]}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    plan = plan_study(read_study(path), path)
    assert {run.name: run.config.resolved_phases[0].name for run in plan.runs} == {
        "610m_wwm_30_12k": "wwm-30", "610m_span_30_12k": "span-30", "610m_mntp_20_12k": "mntp-20",
        "610m_mlm_30to5_12k": "mlm-30to5"}
    # Biphasic runs and continuations take any objective too (LLM2Vec's MNTP continuation of a
    # decoder); MLM at a constant ratio keeps the paper's run names.
    study.update(objectives=[{"objective": "clm"}],
                 biphasic={"clm_shares": [0.5], "objective": {"name": "wwm", "mask_ratio": 0.3}},
                 cpt={"sources": ["clm"], "objective": {"name": "mntp", "mask_ratio": 0.2},
                      "continuations": [{"steps": 2000, "overrides": {
                          "schedule": {"lr_warmup_iters": 200, "lr_wsd_decay_iters": 200}}}]})
    path.write_text(yaml.safe_dump(study))
    plan = plan_study(read_study(path), path)
    assert {run.name: [phase.name for phase in run.config.resolved_phases] for run in plan.runs} == {
        "610m_clm_12k": ["clm"], "610m_biphasic_50_50_wwm_30_12k": ["clm", "wwm-30"],
        "610m_clm_12k_cpt_mntp_20_2k": ["mntp-20"]}
    for biphasic, kind in (({"mask_ratio": 0.3}, "biphasic_50_50"), ({"objective": "wwm", "mask_ratio": 0.3},
                                                                        "biphasic_50_50_wwm_30")):
        study["biphasic"] = {"clm_shares": [0.5], **biphasic}
        path.write_text(yaml.safe_dump(study))
        assert f"610m_{kind}_12k" in {run.name for run in plan_study(read_study(path), path).runs}

    for where, change, message in [
        ("biphasic", {"mask_ratio": 0.3, "objective": {"name": "wwm"}},
         r"study\.biphasic: give the objective's settings inside objective: \{name: \.\.\.\} or beside it"),
        ("biphasic", {"mask_ratio": 1.3}, r"study\.biphasic: mask_ratio must be in \(0, 1\), got 1\.3"),
        ("biphasic", {"clm_share": 0.3}, r"study\.biphasic: unknown key\(s\) \['clm_share'\]; valid keys: "
                                         r"\['clm_shares', 'objective'\] and the settings of objective 'mlm'"),
        ("biphasic", {"objective": "clm"}, r"study\.biphasic: objective: the phase after CLM must be bidirectional"),
        ("cpt", {"objective": {"name": "span", "mask_ratio": 0.9}}, r"study\.cpt\.objective: mask_ratio 0\.9 is above"),
        ("objectives", None, r"study\.objectives\[1\]: mask_ratio 0\.9 is above 0\.792"),
    ]:
        bad = json.loads(json.dumps(study))
        if change is None:
            bad["objectives"].append({"objective": "span", "mask_ratio": 0.9})
        else:
            bad[where] = {k: v for k, v in bad[where].items() if k not in ("mask_ratio", "objective")} | change
        path.write_text(yaml.safe_dump(bad))
        with pytest.raises(ConfigError, match=message):
            read_study(path)


def test_new_objectives_log_their_names_and_resume_exactly(tmp_path, tiny_corpus):
    """One run through all four (the schedule over two steps, the others one each), stopped inside
    the schedule's phase (after step 1) and resumed: the same losses."""
    from megatron_ext.training.config import run_config_from_dict
    from megatron_ext.training.loop import pretrain

    phases = [{"objective": {"name": "mlm", "mask_ratio": 0.4, "mask_ratio_schedule": "linear",
                             "final_mask_ratio": 0.2}, "steps": 2},
              {"objective": "wwm", "mask_ratio": 0.4, "steps": 1},
              {"objective": {"name": "span", "mask_ratio": 0.4}, "steps": 1},
              {"objective": "mntp", "mask_ratio": 0.2, "random_replace_prob": 0.1, "mask_replace_prob": 0.8,
               "steps": 1}]

    def recipe(name, save):
        return tiny_recipe(tiny_corpus, tmp_path / name, phases=phases, training={"train_iters": 5, "eval_interval": 0},
                           checkpoint={"save": save, "save_interval": 100})  # saves only where a stop needs one

    straight = pretrain(run_config_from_dict(recipe("a", None)))
    records = [json.loads(line) for line in (tmp_path / "a/log/metrics.jsonl").read_text().splitlines()]
    assert [(r["objective"], r["phase"]) for r in records if r["kind"] == "train"] == [
        ("mlm", "mlm-40to20"), ("mlm", "mlm-40to20"), ("wwm", "wwm-40"), ("span", "span-40"), ("mntp", "mntp-20")]
    interrupted = run_config_from_dict(recipe("b", str(tmp_path / "b/ckpt")))
    assert pretrain(interrupted, exit_after_step=1).final_step == 1
    resumed = pretrain(interrupted)
    assert resumed.start_step == 1 and all(math.isfinite(loss) for loss in straight.losses.values())
    assert {s: resumed.losses[s] for s in range(2, 6)} == {s: straight.losses[s] for s in range(2, 6)}
    assert plot_loss.main([str(tmp_path / "a/log"), "--output", str(tmp_path / "loss.png")]) == 0  # knows every tag
