"""QA and IR task families: metrics against hand-computed values, span windows and decoding, data
errors, and both families end to end on the real all-MiniLM-L6-v2 encoder and the suite's tasks."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from megatron_ext.eval.families import ir, qa
from megatron_ext.eval.finetuning import FinetuneConfig
from megatron_ext.eval.task_io import load_task
from megatron_ext.eval.suite import build_task

TINY = {"lr": 5e-5, "seed": 0, "batch_size": 8, "max_steps": 10, "device": "cpu"}


# The fine-tuning runs are thousands of small ops: with two intra-op threads on a shared 2-core
# machine this file took 378 s next to other jobs, 72 s with one.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("suite")
    for name in ("news_cloze_v2", "wiki_sections"):
        build_task(name, out)
    return out


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_dir)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


# ----------------------------------------------------------------------------- metrics


def test_squad_scores_v1_and_v2_rules():
    def row(id_: str, *texts: str) -> dict:
        return {"id": id_, "answers": {"text": list(texts), "answer_start": [0] * len(texts)}}

    answerable = [row("a", "Eiffel Tower"), row("b", "Paris"), row("c", "Hume Highway", "the Hume")]
    predictions = {"a": "the Eiffel Tower.", "b": "Paris France", "c": "Hume", "d": "", "e": "Sydney"}
    # a: articles and punctuation normalised away; b: P 1/2, R 1 -> F1 2/3; c: best gold "the Hume" -> 1.
    scores = qa.squad_scores(predictions, answerable)
    assert scores["f1"] == pytest.approx(100 * (1 + 2 / 3 + 1) / 3, abs=1e-4)
    assert scores["exact_match"] == pytest.approx(100 * 2 / 3, abs=1e-4)
    assert set(scores) == {"f1", "exact_match"}
    # SQuAD v2: an empty prediction is right exactly for unanswerable questions.
    v2 = [*answerable, row("d"), row("e")]
    scores = qa.squad_scores(predictions, v2)
    assert scores["f1"] == pytest.approx(100 * (1 + 2 / 3 + 1 + 1 + 0) / 5, abs=1e-4)
    assert scores["exact_match"] == pytest.approx(100 * 3 / 5, abs=1e-4)
    assert scores["no_answer_f1"] == pytest.approx(50.0)
    assert scores["has_answer_f1"] == pytest.approx(100 * (1 + 2 / 3 + 1) / 3, abs=1e-4)
    assert qa.squad_scores({"a": ""}, [row("a", "Eiffel Tower")])["f1"] == 0.0
    per_question = {q: values["f1"] for q, values in qa.question_scores(predictions, v2).items()}
    assert per_question == pytest.approx({"a": 100.0, "b": 200 / 3, "c": 100.0, "d": 100.0, "e": 0.0}, abs=1e-4)
    with pytest.raises(ValueError, match="no prediction"):
        qa.squad_scores({"a": "x"}, v2)


def test_ndcg_at_10_uses_graded_relevance():
    qrels = {"q1": {"d2": 2, "d3": 1, "d4": 1}, "q2": {"e1": 1}}
    run = {
        # q1: ranks 1..3 = d1 (irrelevant), d2 (grade 2), d3 (grade 1); d4 only at rank 11 (past the cut).
        "q1": {"d1": 0.9, "d2": 0.8, "d3": 0.7, **{f"x{i}": 0.5 - i / 100 for i in range(7)}, "d4": 0.1},
        "q2": {"e1": 0.3, "x": 0.9},
    }
    dcg = 2 / math.log2(3) + 1 / math.log2(4)
    ideal = 2 / math.log2(2) + 1 / math.log2(3) + 1 / math.log2(4)
    ndcg_q2 = 1 / math.log2(3)
    scores = ir.retrieval_metrics(qrels, run)
    assert scores["ndcg@10"] == pytest.approx(100 * (dcg / ideal + ndcg_q2) / 2, abs=1e-6)
    assert scores["mrr@10"] == pytest.approx(100 * (1 / 2 + 1 / 2) / 2)
    assert scores["recall@10"] == pytest.approx(100 * (2 / 3 + 1) / 2)
    # With binary relevance the same ranking scores differently: the grade is the gain.
    per_query = ir.query_metrics(qrels, run)
    assert per_query["q1"]["ndcg@10"] == pytest.approx(100 * dcg / ideal) and per_query["q2"]["mrr@10"] == 50.0
    binary = ir.retrieval_metrics({"q1": dict.fromkeys(qrels["q1"], 1), "q2": qrels["q2"]}, run)
    assert binary["ndcg@10"] != pytest.approx(scores["ndcg@10"])
    with pytest.raises(ValueError, match="no ranking"):
        ir.retrieval_metrics(qrels, {"q1": run["q1"]})


def test_qrels_are_checked_against_the_corpus():
    rows = [{"id": "q", "query": "x", "relevance": {"p1": 2, "p9": 1}}]
    with pytest.raises(ValueError, match="'q'.*p9"):
        ir.qrels_of(rows, {"p1", "p2"}, "test")
    with pytest.raises(ValueError, match="integer grades"):
        ir.qrels_of([{"id": "q", "query": "x", "relevance": {"p1": 0.5}}], {"p1"}, "test")
    assert ir.qrels_of(rows, {"p1", "p9"}, "test") == {"q": {"p1": 2, "p9": 1}}


# ----------------------------------------------------------------------------- QA windows and decoding


def test_span_labels_and_decoding(tokenizer):
    context = "Fires burned near Goulburn on Tuesday, and the Hume Highway was closed in both directions."
    answer = "Hume Highway"
    row = {"id": "r", "question": "Which road was closed?", "context": context,
           "answers": {"text": [answer], "answer_start": [context.index(answer)]}}
    [feature] = qa.prepare_features(tokenizer, [row], max_length=128)
    a, b = feature.offsets[feature.start][0], feature.offsets[feature.end][1]
    assert 0 < feature.start < feature.end and context[a:b] == answer
    assert feature.offsets[0] is None  # the null position is not a context token

    n = len(feature.inputs["input_ids"])
    start, end = np.zeros(n, np.float32), np.zeros(n, np.float32)
    start[feature.start], end[feature.end] = 5.0, 5.0
    end[feature.start - 1] = 9.0  # the best end alone precedes the best start: not a span
    best = qa.decode([row], [feature], [(start, end)], allow_empty=True)["r"]
    assert best.text == answer == context[best.start:best.end] and best.score == pytest.approx(10.0)

    start[0] = end[0] = 6.0  # null score 12 > best span 10
    assert qa.decode([row], [feature], [(start, end)], allow_empty=True)["r"] == ("", -1, -1, 12.0)
    assert qa.decode([row], [feature], [(start, end)], allow_empty=False)["r"].text == answer


def test_long_context_windows_with_doc_stride(tokenizer, news_texts):
    context = " ".join(news_texts[:3])
    answer = re.findall(r"[A-Z][a-z]+", context)[-1]
    question = " ".join(news_texts[3].split()[:90]) + " @placeholder"
    row = {"id": "long", "question": question, "context": context,
           "answers": {"text": [answer], "answer_start": [context.rindex(answer)]}}
    tokens = tokenizer(context, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    features = qa.prepare_features(tokenizer, [row], max_length=128)

    assert len(tokens) > 5 * 128 and len(features) >= 10
    windows = [[o for o in f.offsets if o is not None] for f in features]
    # The long question is cut to MAX_QUESTION_TOKENS (+ [CLS] and two [SEP]).
    assert all(len(f.inputs["input_ids"]) <= 128 for f in features)
    assert all(sum(o is None for o in f.offsets) == qa.MAX_QUESTION_TOKENS + 3 for f in features)
    # The windows tile the context, each overlapping the previous by the doc stride.
    assert sorted({tuple(o) for w in windows for o in w}) == [tuple(o) for o in tokens]
    for previous, window in zip(windows, windows[1:]):
        assert previous[-qa.doc_stride(128):] == window[:qa.doc_stride(128)]
    labelled = [f for f in features if f.start]
    assert labelled and len(labelled) < len(features)
    a = row["answers"]["answer_start"][0]
    for f, window in zip(features, windows, strict=True):
        holds = window[0][0] <= a and window[-1][1] >= a + len(answer)
        assert bool(f.start) == holds and (f.start == 0) == (f.end == 0)
        if f.start:
            assert context[f.offsets[f.start][0]:f.offsets[f.end][1]] == answer

    logits = [(np.zeros(len(f.offsets), np.float32), np.zeros(len(f.offsets), np.float32)) for f in features]
    last = features.index(labelled[-1])
    logits[last][0][labelled[-1].start] = logits[last][1][labelled[-1].end] = 3.0
    best = qa.decode([row], features, logits, allow_empty=True)["long"]
    assert best.text == answer and best.start == a


def test_qa_data_errors(suite, tmp_path, minilm_dir):
    source = suite / "news_cloze_v2"
    task = tmp_path / "qa"
    task.mkdir()
    rows = load_task(source, "train")[:4]
    _write_jsonl(task / "train.jsonl", rows)
    _write_jsonl(task / "test.jsonl", rows)
    config = FinetuneConfig(**TINY)
    with pytest.raises(ValueError, match="split 'validation' not found"):
        qa.run(minilm_dir, task, config)
    broken = [dict(rows[0], answers={"text": ["Canberra"], "answer_start": [0]})]
    _write_jsonl(task / "validation.jsonl", broken)
    with pytest.raises(ValueError, match="not at context offset 0"):
        qa.run(minilm_dir, task, config)
    _write_jsonl(task / "validation.jsonl", [{k: v for k, v in rows[0].items() if k != "question"}])
    with pytest.raises(ValueError, match=r"missing column\(s\) \['question'\]"):
        qa.run(minilm_dir, task, config)


# ----------------------------------------------------------------------------- IR data errors


def test_ir_data_errors(suite, tmp_path, minilm_dir):
    task = tmp_path / "ir"
    task.mkdir()
    config = FinetuneConfig(**TINY)
    train = load_task(suite / "wiki_sections", "train")[:3]
    _write_jsonl(task / "train.jsonl", [{k: v for k, v in r.items() if k != "positive"} for r in train])
    with pytest.raises(ValueError, match=r"missing column\(s\) \['positive'\]"):
        ir.run(minilm_dir, task, config)
    _write_jsonl(task / "train.jsonl", train)
    with pytest.raises(ValueError, match="split 'corpus' not found"):
        ir.run(minilm_dir, task, config)


def test_causal_lm_is_refused_for_retrieval(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="causal LM"):
        ir.load_bi_encoder(str(tmp_path), FinetuneConfig(**TINY))


# ----------------------------------------------------------------------------- end to end


def test_qa_end_to_end_squad_v2_style(suite, tmp_path, minilm_dir):
    # The real task's first rows: tokenizing all 2,108 training contexts alone takes seconds.
    task = tmp_path / "news_cloze_v2_small"
    task.mkdir()
    for split, n in (("train", 120), ("validation", 8), ("test", 8)):
        _write_jsonl(task / f"{split}.jsonl", load_task(suite / "news_cloze_v2", split)[:n])
    config = FinetuneConfig(**{**TINY, "lr": 1e-4}, max_eval_examples=6, max_length=128)
    result = qa.run(minilm_dir, task, config)

    assert result.metric == "f1" and result.steps == 10 and len(result.losses) == 10
    assert all(math.isfinite(loss) for loss in result.losses)
    assert np.mean(result.losses[-3:]) < np.mean(result.losses[:3])  # the span head learns
    assert result.extra["validation_examples"] == result.extra["test_examples"] == 6
    for split in ("validation", "test"):
        scores = [getattr(result, split), result.extra[f"{split}_exact_match"],
                  result.extra[f"{split}_has_answer_f1"], result.extra[f"{split}_no_answer_f1"]]
        assert all(math.isfinite(s) and 0.0 <= s <= 100.0 for s in scores)
        assert result.extra[f"{split}_exact_match"] <= getattr(result, split)


def test_ir_end_to_end(suite, tmp_path, minilm_dir):
    # The real task with a smaller corpus (every passage the kept queries grade, plus 20 others):
    # encoding all ~5,000 passages takes minutes on a shared CPU.
    task = tmp_path / "wiki_sections_small"
    task.mkdir()
    source = suite / "wiki_sections"
    kept = {split: load_task(source, split)[:8] for split in ("validation", "test")}
    graded = {doc for rows in kept.values() for row in rows for doc in row["relevance"]}
    corpus = load_task(source, "corpus")
    others = [row for row in corpus if row["id"] not in graded][:20]
    _write_jsonl(task / "corpus.jsonl", [row for row in corpus if row["id"] in graded] + others)
    _write_jsonl(task / "train.jsonl", load_task(source, "train"))
    for split, rows in kept.items():
        _write_jsonl(task / f"{split}.jsonl", rows)

    config = FinetuneConfig(**TINY, max_eval_examples=6, max_length=64)
    result = ir.run(minilm_dir, task, config)
    assert result.metric == "ndcg@10" and result.steps == 10 and len(result.losses) == 10
    assert all(math.isfinite(loss) for loss in result.losses)
    assert result.extra["validation_examples"] == result.extra["test_examples"] == 6
    for split in ("validation", "test"):
        scores = [getattr(result, split), result.extra[f"{split}_mrr@10"], result.extra[f"{split}_recall@10"]]
        assert all(math.isfinite(s) and 0.0 <= s <= 100.0 for s in scores)
        # MiniLM is a trained retriever: section-heading queries find their sections (a broken
        # passage-id mapping would score ~0).
        assert getattr(result, split) > 30.0
