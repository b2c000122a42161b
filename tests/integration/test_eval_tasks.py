"""The offline evaluation mini-suite: sizes, schemas, split hygiene, determinism, loader errors, CLI."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.eval.task_io import SUITE_TASKS, load_task
from megatron_ext.eval.suite import PLACEHOLDER, TASKS, assign_splits, build_task
from megatron_ext.cli.build_eval_suite import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> dict:
    """Every task built twice: here, and in a second process with another string-hash seed
    (running alongside, on the other core), whose bytes must be identical."""
    here, there = tmp_path_factory.mktemp("suite"), tmp_path_factory.mktemp("suite_again")
    other = subprocess.Popen(
        [sys.executable, str(REPO / "tools/build_eval_suite.py"), "--output-dir", str(there)],
        env={**os.environ, "PYTHONHASHSEED": "12345"}, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            assert main(["--output-dir", str(here)]) == 0
        other_output = other.communicate(timeout=300)[0]
    finally:
        if other.poll() is None:
            other.kill()
    assert other.returncode == 0, other_output
    rows = {
        name: {split: load_task(name, split, suite_dir=here) for split in TASKS[name].splits}
        for name in TASKS
    }
    meta = {name: json.loads((here / name / "task.json").read_text(encoding="utf-8")) for name in TASKS}
    return {"dir": here, "again": there, "report": out.getvalue(), "rows": rows, "meta": meta}


@pytest.mark.slow  # the whole suite built twice
def test_two_builds_are_byte_identical(suite):
    files = sorted(p.relative_to(suite["dir"]) for p in suite["dir"].rglob("*") if p.is_file())
    assert len(files) == sum(len(spec.splits) + 1 for spec in TASKS.values())
    assert files == sorted(p.relative_to(suite["again"]) for p in suite["again"].rglob("*") if p.is_file())
    for path in files:
        assert (suite["dir"] / path).read_bytes() == (suite["again"] / path).read_bytes(), path
    for name in TASKS:
        assert re.search(rf"^{name} .*test [\d,]+", suite["report"], re.MULTILINE)


@pytest.mark.slow  # the whole suite built twice
def test_sizes_and_balance(suite):
    rows, meta = suite["rows"], suite["meta"]
    sizes = {name: {split: len(r) for split, r in task.items()} for name, task in rows.items()}
    for name, task in sizes.items():
        assert task == {split: info["rows"] for split, info in meta[name]["splits"].items()}
        if "train" in task:  # the paper's 95/5 train/validation split, by document
            assert 0.03 <= task["validation"] / (task["train"] + task["validation"]) <= 0.09, name

    sc = sizes["rt_sentiment"]
    assert 9_400 <= sum(sc.values()) <= 9_800  # 10,605 snippets minus ~1,000 in SST-2's neutral band
    assert 0.13 <= sc["test"] / sum(sc.values()) <= 0.17
    for split_rows in rows["rt_sentiment"].values():
        assert 0.45 <= sum(r["label"] for r in split_rows) / len(split_rows) <= 0.56
    assert meta["rt_sentiment"]["build"]["dropped_neutral"] > 900

    assert 2_800 <= sum(sizes["wiki_mentions"].values()) <= 3_700
    assert 1_500 <= sum(sizes["news_cloze"].values()) <= 2_200
    v2 = [r for split_rows in rows["news_cloze_v2"].values() for r in split_rows]
    unanswerable = sum(not r["answers"]["text"] for r in v2) / len(v2)
    assert 0.28 <= unanswerable <= 0.38  # SQuAD v2 training share: 1/3
    ir = sizes["wiki_sections"]
    assert 1_400 <= ir["train"] + ir["validation"] + ir["test"] <= 2_000 and 4_500 <= ir["corpus"] <= 5_500
    assert sizes["lee_sts"] == {"test": 1225}


@pytest.mark.slow  # the whole suite built twice
def test_sc_and_sts_schemas(suite):
    for split_rows in suite["rows"]["rt_sentiment"].values():
        for r in split_rows:
            assert r["label"] in (0, 1) and r["text"] == r["text"].strip() and "  " not in r["text"]
            assert (r["score"] > 0.8) == (r["label"] == 1) and abs(r["score"]) >= 0.8
    assert suite["meta"]["rt_sentiment"]["labels"] == ["negative", "positive"]
    pairs = suite["rows"]["lee_sts"]["test"]
    assert all(0.0 <= r["score"] <= 1.0 and r["text"] != r["text_pair"] for r in pairs)
    assert len({r["id"] for r in pairs}) == 1225


@pytest.mark.slow  # the whole suite built twice
def test_tc_tags_are_well_formed_bio(suite):
    labels = suite["meta"]["wiki_mentions"]["labels"]
    assert labels == ["O", "B-ENT", "I-ENT"]
    for split_rows in suite["rows"]["wiki_mentions"].values():
        for r in split_rows:
            assert len(r["tokens"]) == len(r["tags"]) >= 5 and set(r["tags"]) <= set(labels)
            assert "B-ENT" in r["tags"]
            assert all(tok and not any(c.isspace() for c in tok) for tok in r["tokens"])
            for prev, tag in zip(["O", *r["tags"]], r["tags"], strict=False):
                assert tag != "I-ENT" or prev in ("B-ENT", "I-ENT"), r["id"]
            starts = [tok for tok, tag in zip(r["tokens"], r["tags"], strict=True) if tag == "B-ENT"]
            assert all(tok[0].isupper() for tok in starts), r["id"]
    tagged = {
        (" ".join(r["tokens"]), " ".join(r["tags"]))
        for split_rows in suite["rows"]["wiki_mentions"].values() for r in split_rows
    }
    # A multi-word link is one mention: B-ENT I-ENT I-ENT.
    assert any(
        "launch pad at Kennedy Space Center ." in s and t.endswith("O B-ENT I-ENT I-ENT O") for s, t in tagged
    )


@pytest.mark.slow  # the whole suite built twice
def test_qa_answers_are_exact_spans(suite):
    for name in ("news_cloze", "news_cloze_v2"):
        for split_rows in suite["rows"][name].values():
            for r in split_rows:
                assert r["question"].count(PLACEHOLDER) == 1
                texts, starts = r["answers"]["text"], r["answers"]["answer_start"]
                assert len(texts) == len(starts) and starts == sorted(starts)
                for text, start in zip(texts, starts, strict=True):
                    assert r["context"][start:start + len(text)] == text
                if texts:
                    assert len(set(texts)) == 1
                    assert not re.search(rf"(?<!\w){re.escape(texts[0])}(?!\w)", r["question"]), r["id"]
                assert name == "news_cloze_v2" or texts
    answerable = {r["id"] for split_rows in suite["rows"]["news_cloze"].values() for r in split_rows}
    v2 = {r["id"]: r for split_rows in suite["rows"]["news_cloze_v2"].values() for r in split_rows}
    assert answerable == {i for i, r in v2.items() if r["answers"]["text"]}


@pytest.mark.slow  # the whole suite built twice
def test_ir_qrels_point_into_the_corpus(suite):
    rows = suite["rows"]["wiki_sections"]
    corpus = {p["id"]: p["text"] for p in rows["corpus"]}
    titles = {p["id"]: p["title"] for p in rows["corpus"]}
    assert len(corpus) == len(rows["corpus"])
    queries = [q for split in ("train", "validation", "test") for q in rows[split]]
    assert len({q["id"] for q in queries}) == len(queries)
    for q in queries:
        assert set(q["relevance"]) <= set(corpus) and set(q["relevance"].values()) <= {1, 2}
        assert [d for d, g in q["relevance"].items() if g == 2] == [q["positive_id"]]
        assert corpus[q["positive_id"]] == q["positive"]
        assert q["query"].startswith(titles[q["positive_id"]])
    lead = next(q for q in queries if q["query"] == "Anarchism")
    assert lead["positive"].startswith("Anarchism is a political philosophy")


@pytest.mark.slow  # the whole suite built twice
def test_splits_are_disjoint_by_source_document(suite):
    for name, task in suite["rows"].items():
        docs = {split: {r["doc"] for r in rows} for split, rows in task.items() if split != "corpus"}
        splits = list(docs)
        for i, a in enumerate(splits):
            for b in splits[i + 1:]:
                assert not docs[a] & docs[b], (name, a, b)
    # Tasks over the same documents hold out the same test documents.
    wiki = {name: {split: {r["doc"] for r in suite["rows"][name][split]} for split in ("train", "test")}
            for name in ("wiki_mentions", "wiki_sections")}
    assert not wiki["wiki_mentions"]["train"] & wiki["wiki_sections"]["test"]
    assert not wiki["wiki_sections"]["train"] & wiki["wiki_mentions"]["test"]
    # No test query sentence of the cloze task survives in a training passage (re-filed stories).
    rows = suite["rows"]["news_cloze"]
    training = "\n".join(r["context"] for split in ("train", "validation") for r in rows[split])
    for r in rows["test"]:
        assert r["question"].replace(PLACEHOLDER, r["answers"]["text"][0]) not in training, r["id"]


def test_assign_splits_by_document_hash():
    docs = [f"wikipedia:{i}" for i in range(200)]
    rows = {doc: i % 7 for i, doc in enumerate(docs)}  # some documents yield no rows
    split_of = assign_splits(docs, rows, split_key="wikipedia", test_fraction=0.2)
    test = {doc for doc, split in split_of.items() if split == "test"}
    assert len(test) == 40
    # The test documents depend on the collection and the salt only, not on the rows a task draws.
    again = assign_splits(reversed(docs), {}, split_key="wikipedia", test_fraction=0.2)
    assert {doc for doc, split in again.items() if split == "test"} == test
    assert {doc for doc, split in assign_splits(docs, rows, split_key="lee", test_fraction=0.2).items()
            if split == "test"} != test
    validation = [doc for doc, split in split_of.items() if split == "validation"]
    remaining = sum(rows[doc] for doc in docs if doc not in test)
    share = sum(rows[doc] for doc in validation) / remaining
    assert all(rows[doc] for doc in validation) and 0.05 <= share < 0.05 + 6 / remaining  # <= 6 rows/doc


def test_rebuild_is_a_no_op_and_overwrite_is_explicit(tmp_path):
    task_dir = build_task("lee_sts", tmp_path)
    test_file = task_dir / "test.jsonl"
    stamp = test_file.stat().st_mtime_ns
    assert build_task("lee_sts", tmp_path) == task_dir and test_file.stat().st_mtime_ns == stamp
    original = test_file.read_bytes()
    test_file.write_bytes(original[:100])
    with pytest.raises(ValueError, match="overwrite"):
        build_task("lee_sts", tmp_path)
    build_task("lee_sts", tmp_path, overwrite=True)
    assert test_file.read_bytes() == original
    assert not [p for p in task_dir.iterdir() if p.name.startswith(".")]  # no temporary files left


@pytest.mark.slow  # the whole suite built twice
def test_load_task_errors_and_column_map(tmp_path, suite):
    with pytest.raises(ValueError, match=r"unknown task 'sst2'.*rt_sentiment"):
        load_task("sst2", "train")
    with pytest.raises(ValueError, match=r"split 'train' not found.*\['test'\]"):
        load_task("lee_sts", "train", suite_dir=suite["dir"])
    with pytest.raises(ValueError, match="family='sc' contradicts"):
        load_task("lee_sts", "test", suite_dir=suite["dir"], family="sc")
    with pytest.raises(ValueError, match=r"unknown task 'squad'; valid tasks: \['lee_sts'"):
        build_task("squad", tmp_path)
    with pytest.raises(ValueError, match="not built.*build_eval_suite.py --tasks rt_sentiment"):
        load_task("rt_sentiment", "test", suite_dir=tmp_path)

    # A local GLUE SST-2 copy (sentence, label, idx) in the SC schema.
    sst2 = tmp_path / "sst2"
    sst2.mkdir()
    _write_jsonl(sst2 / "validation.jsonl", [
        {"sentence": "it 's a charming and often affecting journey . ", "label": 1, "idx": 0},
        {"sentence": "unflinchingly bleak and desperate ", "label": 0, "idx": 1},
    ])
    with pytest.raises(ValueError, match="no task.json: pass family="):
        load_task(sst2, "validation")
    with pytest.raises(ValueError, match=r"line 1: missing column\(s\) \['id', 'text'\].*column_map"):
        load_task(sst2, "validation", family="sc")
    with pytest.raises(ValueError, match=r"column_map names columns \['premise'\]"):
        load_task(sst2, "validation", family="sc", column_map={"premise": "text", "idx": "id"})
    rows = load_task(sst2, "validation", family="sc", column_map={"sentence": "text", "idx": "id"})
    assert [(r["id"], r["label"]) for r in rows] == [(0, 1), (1, 0)]
    assert rows[1]["text"].startswith("unflinching")

    # IR: training needs (query, positive) pairs only, evaluation needs graded relevance.
    marco = tmp_path / "marco"
    marco.mkdir()
    _write_jsonl(marco / "train.jsonl", [{"qid": "q1", "query": "what is rba", "positive": "The RBA is ..."}])
    _write_jsonl(marco / "test.jsonl", [{"id": "q2", "query": "rba rate", "positive": "The cash rate ..."}])
    assert load_task(marco, "train", family="ir", column_map={"qid": "id"})[0]["id"] == "q1"
    with pytest.raises(ValueError, match=r"missing column\(s\) \['relevance'\] required for family 'ir'"):
        load_task(marco, "test", family="ir")


def test_loader_knows_the_suite_task_names():
    # load_task resolves suite names without importing the builders, from its own list.
    assert SUITE_TASKS == tuple(TASKS)


def test_loading_and_fine_tuning_do_not_import_the_builders_dependencies():
    """The families and the loader work without the suite builders' parsers (fresh interpreter:
    this process has imported them already)."""
    code = (
        "import sys\n"
        "import megatron_ext.eval.task_io, megatron_ext.eval.families\n"
        "from megatron_ext.eval.families import sc, tc, qa, ir\n"
        "unwanted = ('mwparserfromhell', 'nltk', 'megatron_ext.eval.suite')\n"
        "print(sorted(m for m in unwanted if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
