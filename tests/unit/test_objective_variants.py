"""The objectives beyond CLM and plain MLM, on real news text: a masking-ratio schedule, whole-word
masking, span masking and MNTP (statistics of their corruption, their names, the study planner,
and an exactly resumed run through all four)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import unicodedata
from pathlib import Path

import pytest
import torch

from helpers import tiny_recipe, unmarked_bpe_dir
from megatron_ext.cli import plot_loss
from megatron_ext.config_loading import ConfigError, UserError
from megatron_ext.objectives import (
    IGNORE_INDEX, MLM, MNTP, PhaseProgress, SpanMLM, Vocabulary, WholeWordMLM,
)
from megatron_ext.objectives.span import mean_span_length
from megatron_ext.tokenizer import TokenizerConfig, build_tokenizer

ROOT = Path(__file__).resolve().parents[2]
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
    with pytest.raises(UserError, match=r"^final_mask_ratio must be in \(0, 1\), got 1.2"):
        MLM(mask_ratio=0.3, mask_ratio_schedule="cosine", final_mask_ratio=1.2)


def test_a_stretched_schedule_is_another_run_from_its_second_step(tmp_path):
    """Branching compares the ratio at each step: the same schedule over 8 or 16 steps agrees at
    step 0 only."""
    from megatron_ext.training.branching import first_divergence
    from megatron_ext.training.recipe import run_config_from_dict

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


@pytest.fixture(scope="module")
def long_word_texts(news_texts) -> list[str]:
    """Real text with long words: Wikipedia articles as raw wikitext (URLs, ISBNs, long numbers,
    the CJK of interlanguage links) and news articles each followed by its SHA-256 (a 64-digit
    hexadecimal word that vocabularies cut into many pieces)."""
    import hashlib

    from megatron_ext import assets
    from megatron_ext.data.wikipedia import DUMP_ASSET, DUMP_MEMBER, wikipedia_articles

    def opening(text: str, characters: int) -> str:  # cut at a space: no word is cut
        return text[:characters].rsplit(" ", 1)[0]

    articles, _ = wikipedia_articles(assets.member(DUMP_ASSET, DUMP_MEMBER))
    texts = []
    for article, news in zip(articles, news_texts):  # short openings: every row holds long words
        news = opening(news, 400)
        texts += [opening(article.wikitext, 800), f"{news}\nsha256 {hashlib.sha256(news.encode()).hexdigest()}"]
    return texts


def _rows(tokenizer, texts: list[str]) -> torch.Tensor:
    """``texts`` as documents + EOD packed into [ROWS, SEQ], as GPTDataset yields them."""
    ids = []
    for document in tokenizer.tokenize_batch(texts):
        ids += [*document, tokenizer.eod]
    assert len(ids) >= ROWS * SEQ
    return torch.tensor(ids[: ROWS * SEQ]).view(ROWS, SEQ)


def _word_table(tokenizer) -> torch.Tensor:
    return torch.tensor(tokenizer.word_boundaries(), dtype=torch.bool)


def _not_special(tokens: torch.Tensor, tokenizer) -> torch.Tensor:
    return ~torch.isin(tokens, torch.tensor(sorted(tokenizer.special_ids)))


@pytest.fixture(scope="module")
def real_tokenizers(bpe, minilm_dir):
    """Vocabularies that mark words three ways: WordPiece ('##', all-MiniLM's BERT vocabulary),
    SentencePiece ('▁', Mistral's 32k Llama-2-style model) and byte-level BPE ('Ġ')."""
    from megatron_ext import assets

    return {"WordPiece": build_tokenizer(TokenizerConfig(tokenizer_model=str(minilm_dir))),
            "SentencePiece": build_tokenizer(TokenizerConfig(tokenizer_model=str(
                assets.member("mistral-common", "mistral_common/data/tokenizer.model.v1")))),
            "byte-level BPE": bpe}


def test_fill_budget_is_berts_rule():
    """The tensor passes take exactly what BERT's walk takes (skip a unit that overshoots, keep
    going), on unit sizes with long ones among them."""
    from megatron_ext.objectives.words import fill_budget

    generator = torch.Generator().manual_seed(3)
    sizes = torch.randint(1, 4, (400, 60), generator=generator)
    sizes[torch.rand(sizes.shape, generator=generator) < 0.1] = 25  # long words (hashes, URLs)
    sizes[:, 50:] = 0  # empty slots
    budget = torch.randint(0, 120, (400,), generator=generator)
    taken = fill_budget(sizes, budget)
    for row, left, got in zip(sizes.tolist(), budget.tolist(), taken.tolist()):
        expected = []
        for size in row:
            expected.append(0 < size <= left)
            left -= size if expected[-1] else 0
        assert got == expected


@pytest.mark.parametrize("kind", ["WordPiece", "SentencePiece", "byte-level BPE"])
def test_whole_word_masking_reaches_its_count_on_long_words(kind, real_tokenizers, long_word_texts):
    """Whole words only, and each row gets MLM's exact count unless every word it leaves is longer
    than its shortfall (the stated bound; in practice never), on text whose long words (hashes,
    long numbers) stopped the old prefix rule short in up to a third of the rows."""
    from megatron_ext.objectives.mlm import selected_counts
    from megatron_ext.objectives.whole_word import select_whole_words
    from megatron_ext.objectives.words import word_numbers

    tokenizer = real_tokenizers[kind]
    tokens = _rows(tokenizer, long_word_texts)
    eligible, table = _not_special(tokens, tokenizer), _word_table(tokenizer)
    word = word_numbers(tokens, eligible, table)
    size = torch.zeros_like(word).scatter_add_(1, word, eligible.long())
    assert (size >= 12).sum() >= ROWS // 2, "the text must hold long words"
    for ratio in (0.15, 0.4):
        target = selected_counts(eligible, ratio)
        for seed in range(3):
            picked = select_whole_words(tokens, eligible, mask_ratio=ratio, word_boundaries=table,
                                        generator=torch.Generator().manual_seed(seed))
            selected = picked.positions
            # Whole words: every token of a word shares its word's choice.
            first = torch.zeros_like(selected).scatter_(1, word, selected)  # any selected token per word
            assert torch.equal(first.gather(1, word) & eligible, selected), "a word was split"
            counts = selected.sum(1)
            assert (counts <= target).all() and picked.bound == math.floor(SEQ * ratio + 0.5)
            short = target - counts
            taken_words = torch.zeros_like(size).scatter_(1, word, selected.long()).bool()
            left_sizes = torch.where(~taken_words & (size > 0), size, SEQ + 1)
            assert (left_sizes.min(1).values > short).all(), "a row fell short while a word that fits was left"
            assert counts.sum().item() == target.sum().item(), (kind, ratio, short.max())
    # Long words are masked too, a little less often than short ones (BERT's rule).
    long_words = size >= 8
    masked_long = (torch.zeros_like(size).scatter_(1, word, selected.long()).bool() & long_words).sum()
    assert 0.2 < masked_long.item() / long_words.sum().item() < 0.4


def test_whole_word_objective_masks_whole_words_of_news(news, vocabulary, bpe):
    out = _apply(WholeWordMLM(mask_ratio=0.4), news, vocabulary)
    tokens, selected = news["tokens"], out.loss_mask.bool()
    eligible = _eligible(tokens, vocabulary)
    starts, ends = (torch.tensor(table) for table in bpe.word_boundaries())
    continues = ~starts[tokens[:, 1:]] & ~ends[tokens[:, :-1]] & eligible[:, 1:] & eligible[:, :-1]
    assert continues.float().mean() > 0.1, "the text must have multi-token words"
    assert torch.equal(selected[:, 1:][continues], selected[:, :-1][continues]), "a word was split"
    assert torch.equal(selected.sum(1), torch.floor(eligible.sum(1).double() * 0.4 + 0.5).long())
    assert not (selected & ~eligible).any() and (out.input_ids[selected] == vocabulary.mask_id).all()
    assert out.max_scored_per_sequence == math.floor(SEQ * 0.4 + 0.5) and out.causal is False


@pytest.fixture(scope="module")
def unmarked_bpe(tmp_path_factory, news_texts):
    """A BPE trained on the news behind a whitespace pre-tokenizer (``helpers.unmarked_bpe_dir``)."""
    return build_tokenizer(TokenizerConfig(tokenizer_model=str(
        unmarked_bpe_dir(news_texts, tmp_path_factory.mktemp("unmarked_bpe")))))


def test_a_vocabulary_without_word_marks(unmarked_bpe, news_texts, long_word_texts):
    """Whole words and word spans are refused (naming the objective and the tokenizer); MLM and
    token spans train on it and reach their counts."""
    from megatron_ext.objectives.mlm import selected_counts

    assert unmarked_bpe.word_mark() is None
    for objective in (WholeWordMLM(mask_ratio=0.15), SpanMLM(mask_ratio=0.15)):
        with pytest.raises(UserError, match=rf"objective {objective.name}.*tokenizer HuggingFaceTokenizer .*unmarked_bpe"
                                            r".* carry no word mark"):
            objective.check_tokenizer(unmarked_bpe)
    vocabulary = Vocabulary(unmarked_bpe, size=unmarked_bpe.vocab_size)
    tokens = _rows(unmarked_bpe, long_word_texts)
    batch = {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(ROWS, SEQ)}
    eligible = _eligible(tokens, vocabulary)
    for objective in (MLM(mask_ratio=0.15), SpanMLM(mask_ratio=0.15, span_unit="token")):
        objective.check_tokenizer(unmarked_bpe)
        scored = _apply(objective, batch, vocabulary).loss_mask.bool()
        target = selected_counts(eligible, 0.15)
        assert (scored.sum(1) <= target).all() and scored.sum() >= target.sum() - ROWS // 4, objective.name


def test_span_lengths_are_drawn_from_spanberts_law():
    """The units spans are cut into: a span whose length in words follows SpanBERT's clipped
    geometric law, then one separating word."""
    from megatron_ext.objectives.span import span_units

    words = torch.arange(SEQ).expand(ROWS * 4, SEQ)
    unit = span_units(words, generator=torch.Generator().manual_seed(0), span_p=0.2, max_span_length=10)
    lengths = []
    for row in unit.tolist():
        runs = [sum(1 for _ in group) for key, group in itertools.groupby(row) if key != SEQ]
        lengths += runs[1:-1]  # whole units: not cut by the row's ends
    n = len(lengths)
    mean, sd = sum(lengths) / n, (sum((x - 3.797) ** 2 for x in lengths) / n) ** 0.5
    assert n > 5000 and abs(mean - 3.797) < 4 * sd / n**0.5, (n, mean)
    p1 = 0.2 / (1 - 0.8**10)  # SpanBERT's truncated law at length 1
    assert abs(lengths.count(1) / n - p1) < 4 * math.sqrt(p1 * (1 - p1) / n)
    assert max(lengths) == 10 and min(lengths) == 1
    separators = unit == SEQ
    assert not (separators[:, 1:] & separators[:, :-1]).any(), "one word between spans"


def _runs(selected: torch.Tensor, eligible: torch.Tensor, word: torch.Tensor) -> tuple[list[int], list[int]]:
    """Lengths in words and tokens of the runs of selected positions inside eligible text, away
    from the row ends (whole spans)."""
    words, tokens = [], []
    for row, keep, numbers in zip(selected.tolist(), eligible.tolist(), word.tolist()):
        start = None
        for i, on in enumerate(row + [False]):
            if on and start is None:
                start = i
            elif not on and start is not None:
                if start > 0 and i < SEQ and keep[start - 1] and keep[i]:
                    words.append(numbers[i - 1] - numbers[start] + 1)
                    tokens.append(i - start)
                start = None
    return words, tokens


@pytest.mark.parametrize("kind", ["WordPiece", "byte-level BPE"])
def test_span_masking_follows_spanbert(kind, real_tokenizers, long_word_texts):
    """SpanBERT's spans: whole words, lengths in words following its clipped geometric law, the
    exact count per row within the stated bound on long-word text, one replacement per span."""
    from megatron_ext.objectives.mlm import selected_counts
    from megatron_ext.objectives.whole_word import word_numbers

    tokenizer = real_tokenizers[kind]
    objective = SpanMLM(mask_ratio=0.4, mask_replace_prob=0.8, random_replace_prob=0.1)
    assert objective.name == "span-40" and mean_span_length(0.2, 10) == pytest.approx(3.797, abs=1e-3)
    tokens = _rows(tokenizer, long_word_texts)
    vocabulary = Vocabulary(tokenizer, size=tokenizer.vocab_size)
    batch = {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(ROWS, SEQ)}
    eligible = _eligible(tokens, vocabulary)
    word = word_numbers(tokens, eligible, _word_table(tokenizer))
    target = selected_counts(eligible, 0.4)
    lengths, token_lengths, whole, parts = [], [], 0, 0
    for seed in range(4):
        out = _apply(objective, batch, vocabulary, seed=seed)
        selected = out.loss_mask.bool()
        assert not (selected & ~eligible).any() and out.max_scored_per_sequence == math.floor(SEQ * 0.4 + 0.5)
        # Spans start and end at word boundaries: a change of state inside a word never happens.
        inside = (word[:, 1:] == word[:, :-1]) & eligible[:, 1:] & eligible[:, :-1]
        assert torch.equal(selected[:, 1:][inside], selected[:, :-1][inside]), "a span cut a word"
        short = target - selected.sum(1)
        assert (short >= 0).all() and short.sum().item() <= ROWS, short.max()
        runs, run_tokens = _runs(selected, eligible, word)
        lengths += runs
        token_lengths += run_tokens
        # One replacement per span: a run is all masks, or has none.
        masked = out.input_ids == vocabulary.mask_id
        for row in range(ROWS):
            edges = torch.nonzero(torch.diff(selected[row].long(), prepend=torch.zeros(1, dtype=torch.long)))
            for begin, stop in zip(edges[::2].flatten().tolist(), edges[1::2].flatten().tolist()):
                states = masked[row, begin:stop][eligible[row, begin:stop]]
                parts += 1
                whole += bool(states.all() or not states.any())
    assert whole == parts
    # Realised spans are a little shorter than the law (BERT's rule fills a row's last tokens with
    # the spans that still fit, where SpanBERT cuts its last span at the budget; and runs that
    # touch a document boundary, longer ones more often, are not counted here).
    n = len(lengths)
    mean = sum(lengths) / n
    assert n > 2000 and 3.3 < mean < 3.85, (n, mean)
    assert max(lengths) == 10 and min(lengths) == 1
    assert sum(token_lengths) / n > mean + 0.3  # tokens per span exceed words per span: multi-token words
    with pytest.raises(UserError, match="above 0.792"):
        SpanMLM(mask_ratio=0.85)
    with pytest.raises(UserError, match="final_mask_ratio 0.85 is above 0.792"):
        SpanMLM(mask_ratio=0.3, mask_ratio_schedule="linear", final_mask_ratio=0.85)


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


def test_new_objectives_log_their_names_and_resume_exactly(tmp_path, tiny_corpus, capsys):
    """One run through all four (the schedule over two steps, the others one each), stopped inside
    the schedule's phase (after step 1) and resumed: the same losses."""
    from megatron_ext.training.recipe import run_config_from_dict
    from megatron_ext.training.loop import pretrain

    phases = [{"objective": {"name": "mlm", "mask_ratio": 0.4, "mask_ratio_schedule": "linear",
                             "final_mask_ratio": 0.2}, "steps": 2},
              {"objective": "wwm", "mask_ratio": 0.4, "steps": 1},
              {"objective": {"name": "span", "mask_ratio": 0.4}, "steps": 1},
              {"objective": "mntp", "mask_ratio": 0.2, "random_replace_prob": 0.1, "mask_replace_prob": 0.8,
               "steps": 1}]

    def recipe(name, save):
        return tiny_recipe(tiny_corpus, tmp_path / name, phases=phases, training={"train_iters": 5, "eval_interval": 5},
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
    # A run that trains MNTP is validated as MNTP too: its own loss, beside CLM's and MLM's.
    valid = straight.valid[5]
    assert set(valid) == {"clm", "mlm", "mntp"} and valid["mntp"] != valid["mlm"] and valid == resumed.valid[5]
    assert [set(r) - {"kind", "step"} for r in records if r["kind"] == "valid"] == [{"clm", "mlm", "mntp"}]

    # Its export says so, and fill_mask reads each masked token where MNTP predicts it: one
    # position before the mask.
    from megatron_ext.cli import fill_mask
    from megatron_ext.hf import export_checkpoint

    exported = export_checkpoint(tmp_path / "b/ckpt", tmp_path / "hf", log=lambda _: None)
    assert json.loads((exported / "config.json").read_text())["trained_objective"] == {
        "name": "mntp-20", "prediction_offset": -1, "causal": False}
    capsys.readouterr()
    assert fill_mask.main([str(exported), "The minister said the [MASK] would", "--top-k", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("mntp-20: each masked token is read from the output 1 position(s) before it")
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    model = transformers.AutoModelForMaskedLM.from_pretrained(exported)
    inputs = tokenizer(fill_mask._with_mask("The minister said the [MASK] would", tokenizer.mask_token, tokenizer),
                       return_tensors="pt")
    at = (inputs["input_ids"][0] == tokenizer.mask_token_id).nonzero()[0, 0].item() - 1
    with torch.no_grad():
        best = model(**inputs).logits[0, at].argmax().item()
    assert lines[2].split("-> ")[1].startswith(repr(tokenizer.decode([best]).strip()))
