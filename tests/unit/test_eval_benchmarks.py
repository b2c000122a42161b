"""The paper's benchmarks: small datasets in each hub dataset's schema, saved like a fetched copy
(``save_to_disk``) or a hub download (parquet shards), go through the real loading and conversion
into task directories; splits, label maps, the offline error, the fetch tool and one fine-tuning
run through the harness and the CLI. No network: the hub is declared unreachable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import datasets
from datasets import ClassLabel, Dataset, Features, List, Value

from megatron_ext.cli import evaluate, fetch_benchmarks
from megatron_ext.eval import grid, harness, hub_datasets
from megatron_ext.eval.hub_datasets import BENCHMARKS, PAPER_TASKS, Source, prepare_benchmarks
from megatron_ext.eval.task_io import TASK_FILE, load_task

GLUE_FEATURES = {
    "sst2": Features({"sentence": Value("string"), "label": ClassLabel(names=["negative", "positive"]),
                      "idx": Value("int32")}),
    "qqp": Features({"question1": Value("string"), "question2": Value("string"),
                     "label": ClassLabel(names=["not_duplicate", "duplicate"]), "idx": Value("int32")}),
    "mnli": Features({"premise": Value("string"), "hypothesis": Value("string"),
                      "label": ClassLabel(names=["entailment", "neutral", "contradiction"]), "idx": Value("int32")}),
}
SQUAD_FEATURES = Features({"id": Value("string"), "title": Value("string"), "context": Value("string"),
                           "question": Value("string"),
                           "answers": {"text": List(Value("string")), "answer_start": List(Value("int32"))}})
BEIR_TEXT = Features({"_id": Value("string"), "title": Value("string"), "text": Value("string")})
MLDR_PASSAGES = List({"docid": Value("string"), "text": Value("string")})
WORDS = ["Paris", "is", "in", "France", "and", "Anna", "works", "for", "Acme", "Corp", "."]


@pytest.fixture(autouse=True)
def no_hub(monkeypatch):
    """The hub is out of reach (as on this machine); a test that wants it says so."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(hub_datasets, "hub_reachable", lambda timeout=3.0: False)
    monkeypatch.setattr(evaluate, "hub_reachable", lambda timeout=3.0: False)

    def refuse(source):
        raise AssertionError(f"the test tried the hub for {source}")

    monkeypatch.setattr(hub_datasets, "_hub_load", refuse)


def _glue_rows(config: str, n: int, offset: int = 0) -> dict:
    idx = list(range(offset, offset + n))
    labels = [i % len(GLUE_FEATURES[config]["label"].names) for i in idx]
    words = ["dull", "fine", "great"]
    if config == "sst2":
        return {"sentence": [f"a {words[y]} film number {i}" for i, y in zip(idx, labels)], "label": labels,
                "idx": idx}
    first, second = ("question1", "question2") if config == "qqp" else ("premise", "hypothesis")
    return {first: [f"first {i}" for i in idx], second: [f"second {i} {words[y]}" for i, y in zip(idx, labels)],
            "label": labels, "idx": idx}


def _tc_rows(n: int, tokens: str, tags: str, tag_of: dict[str, int]) -> dict:
    sentences = [WORDS[i % 3:] for i in range(n)]
    return {tokens: sentences, tags: [[tag_of.get(w, 0) for w in s] for s in sentences]}


def _squad_rows(n: int, split: str, unanswerable_every: int = 0) -> dict:
    rows = {"id": [], "title": [], "context": [], "question": [], "answers": []}
    for i in range(n):
        context = f"Item {i} was made in Lyon by Marie in {1900 + i}."
        answerable = not unanswerable_every or i % unanswerable_every
        year = f"{1900 + i}"
        answers = {"text": [year, "Lyon"], "answer_start": [context.index(year), context.index("Lyon")]}
        rows["id"].append(f"{split}{i:04d}")
        rows["title"].append("Items")
        rows["context"].append(context)
        rows["question"].append(f"When was item {i} made?")
        rows["answers"].append(answers if answerable else {"text": [], "answer_start": []})
    return rows


def _save(root: Path, source: Source, data: dict, features: Features, *, parquet: bool = False) -> Dataset:
    """Write ``data`` where :func:`hub_datasets.local_copy` looks: save_to_disk, or a hub-style parquet shard."""
    dataset = Dataset.from_dict(data, features=features)
    config_dir = root / source.dataset / (source.config or "default")
    if parquet:
        config_dir.mkdir(parents=True, exist_ok=True)
        dataset.to_parquet(str(config_dir / f"{source.split}-00000-of-00001.parquet"))
    else:
        dataset.save_to_disk(str(config_dir / source.split))
    return dataset


def _pairs(root: Path) -> None:
    _save(root, hub_datasets.MSMARCO_PAIRS, {"query": [f"what is thing {i}" for i in range(40)],
                                           "positive": [f"thing {i} is a thing" for i in range(40)]},
          Features({"query": Value("string"), "positive": Value("string")}))


@pytest.fixture(scope="module")
def hub_copy(tmp_path_factory) -> Path:
    """A --benchmarks-dir holding every benchmark in its hub schema (MNLI and SQuAD v2 as parquet)."""
    datasets.disable_progress_bars()  # a bar per saved split would bury the test output
    root = tmp_path_factory.mktemp("benchmarks")
    for config, test_split in (("sst2", "validation"), ("qqp", "validation"), ("mnli", "validation_matched")):
        parquet = config == "mnli"
        _save(root, Source(dataset="nyu-mll/glue", config=config, split="train"), _glue_rows(config, 100),
              GLUE_FEATURES[config], parquet=parquet)
        _save(root, Source(dataset="nyu-mll/glue", config=config, split=test_split), _glue_rows(config, 12, 1000),
              GLUE_FEATURES[config], parquet=parquet)
    conll = {"Paris": 5, "France": 5, "Anna": 1, "Acme": 3, "Corp": 4}
    onto = {"Paris": 7, "France": 7, "Anna": 4, "Acme": 11, "Corp": 12}  # B-GPE, B-PERSON, B-ORG, I-ORG
    for split, n in (("train", 24), ("validation", 6), ("test", 6)):
        _save(root, Source(dataset="hgissbkh/conll2003-en", split=split), _tc_rows(n, "words", "ner", conll),
              Features({"words": List(Value("string")),
                        "ner": List(ClassLabel(names=list(hub_datasets.CONLL2003_LABELS)))}))
        _save(root, Source(dataset="hgissbkh/ontonotes5", split=split), _tc_rows(n, "tokens", "tags", onto),
              Features({"tokens": List(Value("string")), "tags": List(Value("int32"))}))
        uner = _tc_rows(n, "tokens", "ner_tags", {"Anna": 1, "Acme": 3, "Corp": 4, "Paris": 5})
        uner.update(idx=[f"en_ewt-ud-{split}-{i}" for i in range(n)], text=[" ".join(t) for t in uner["tokens"]],
                    annotator=[["Annotator1"] for _ in range(n)])
        _save(root, Source(dataset="hgissbkh/uner_en", split=split), uner,
              Features({"idx": Value("string"), "text": Value("string"), "tokens": List(Value("string")),
                        "ner_tags": List(ClassLabel(names=list(hub_datasets.UNER_LABELS))),
                        "annotator": List(Value("string"))}))
    for dataset, parquet, every in (("rajpurkar/squad", False, 0), ("rajpurkar/squad_v2", True, 3)):
        for split, n in (("train", 60), ("validation", 8)):
            _save(root, Source(dataset=dataset, split=split), _squad_rows(n, split, every), SQUAD_FEATURES,
                  parquet=parquet)
    _pairs(root)
    # BEIR MS MARCO: numeric qrels ids (str() on load, as EncodEval); test has graded and score-0 judgements.
    _save(root, Source(dataset="BeIR/msmarco", config="corpus", split="corpus"),
          {"_id": [str(i) for i in range(10)], "title": [""] * 10, "text": [f"passage {i}" for i in range(10)]},
          BEIR_TEXT)
    _save(root, Source(dataset="BeIR/msmarco", config="queries", split="queries"),
          {"_id": [str(i) for i in range(100, 106)], "title": [""] * 6, "text": [f"query {i}" for i in range(6)]},
          BEIR_TEXT)
    qrels = Features({"query-id": Value("int64"), "corpus-id": Value("int64"), "score": Value("int64")})
    _save(root, Source(dataset="BeIR/msmarco-qrels", split="validation"),
          {"query-id": [100, 101, 102], "corpus-id": [0, 1, 2], "score": [1, 1, 1]}, qrels)
    _save(root, Source(dataset="BeIR/msmarco-qrels", split="test"),
          {"query-id": [103, 103, 103, 104], "corpus-id": [3, 4, 5, 6], "score": [2, 0, 1, 3]}, qrels)
    # BEIR NQ: string ids, titled passages, one qrels split.
    _save(root, Source(dataset="BeIR/nq", config="corpus", split="corpus"),
          {"_id": [f"doc{i}" for i in range(12)], "title": [f"Title {i}" for i in range(12)],
           "text": [f"nq passage {i}" for i in range(12)]}, BEIR_TEXT)
    _save(root, Source(dataset="BeIR/nq", config="queries", split="queries"),
          {"_id": [f"test{i}" for i in range(10)], "title": [""] * 10,
           "text": [f"nq question {i}" for i in range(10)]},
          BEIR_TEXT)
    _save(root, Source(dataset="BeIR/nq-qrels", split="test"),
          {"query-id": [f"test{i}" for i in range(10)], "corpus-id": [f"doc{i}" for i in range(10)],
           "score": [1] * 10},
          Features({"query-id": Value("string"), "corpus-id": Value("string"), "score": Value("int32")}))
    # MLDR English: dev/test rows carry positive passages; the corpus config holds the text.
    for split, queries in (("dev", range(0, 3)), ("test", range(3, 5))):
        _save(root, Source(dataset="hgissbkh/mldr-en", config="default", split=split),
              {"query_id": [f"q-en-{q}" for q in queries], "query": [f"long question {q}" for q in queries],
               "positive_passages": [[{"docid": f"doc-en-{q}", "text": "(ignored)"}] for q in queries],
               "negative_passages": [[{"docid": "doc-en-9", "text": "x"}] for _ in queries]},
              Features({"query_id": Value("string"), "query": Value("string"), "positive_passages": MLDR_PASSAGES,
                        "negative_passages": MLDR_PASSAGES}))
    _save(root, Source(dataset="hgissbkh/mldr-en", config="corpus", split="corpus"),
          {"docid": [f"doc-en-{i}" for i in range(10)], "text": [f"long document {i}" for i in range(10)]},
          Features({"docid": Value("string"), "text": Value("string")}))
    return root


@pytest.fixture(scope="module")
def converted(tmp_path_factory, hub_copy) -> Path:
    out = tmp_path_factory.mktemp("converted")
    prepare_benchmarks([name for name in BENCHMARKS if name not in ("record", "qed")], out, hub_copy,
                       log=lambda line: None)
    return out


def _meta(task_dir: Path) -> dict:
    return json.loads((task_dir / TASK_FILE).read_text(encoding="utf-8"))


# ----------------------------------------------------------------------------- conversion


def test_sc_splits_follow_encodeval(converted, hub_copy):
    import datasets

    train = datasets.load_from_disk(str(hub_copy / "nyu-mll/glue/sst2/train"))
    cut = train.train_test_split(train_size=0.95, seed=42)  # EncodEval's call: the same rows
    rows = {split: load_task(converted / "sst2", split) for split in ("train", "validation", "test")}
    assert [len(rows[s]) for s in rows] == [95, 5, 12]
    assert [r["id"] for r in rows["validation"]] == [str(i) for i in cut["test"]["idx"]]
    assert [r["id"] for r in rows["train"]] == [str(i) for i in cut["train"]["idx"]]
    assert rows["test"][1] == {"id": "1001", "text": "a fine film number 1001", "label": 1}  # official validation
    assert _meta(converted / "sst2")["labels"] == ["negative", "positive"]
    assert _meta(converted / "sst2")["benchmark"]["sources"]["train"]["loaded_from"].startswith("save_to_disk")

    mnli = _meta(converted / "mnli")  # read from hub-style parquet shards: ClassLabel names survive
    assert mnli["labels"] == ["entailment", "neutral", "contradiction"]
    assert mnli["benchmark"]["sources"]["test"]["split"] == "validation_matched"
    assert mnli["benchmark"]["sources"]["test"]["loaded_from"].startswith("parquet")
    assert load_task(converted / "mnli", "test")[0] == {
        "id": "1000", "text": "Premise: first 1000\nHypothesis: second 1000 fine", "label": 1}
    assert load_task(converted / "qqp", "test")[1]["text"] == "Question 1: first 1001\nQuestion 2: second 1001 fine"
    assert [_meta(converted / n)["splits"]["validation"]["rows"] for n in ("qqp", "mnli")] == [5, 5]


def test_conversion_is_deterministic_and_reused(converted, hub_copy, tmp_path):
    again = prepare_benchmarks(["sst2", "mnli"], tmp_path, hub_copy, log=lambda line: None)
    for name, task_dir in again.items():
        for path in sorted(task_dir.glob("*.jsonl")):
            assert path.read_bytes() == (converted / name / path.name).read_bytes()
    stamp = (tmp_path / "sst2" / TASK_FILE).stat().st_mtime_ns
    lines = []
    prepare_benchmarks(["sst2"], tmp_path, None, log=lines.append)  # converted: nothing is loaded
    assert lines == [] and (tmp_path / "sst2" / TASK_FILE).stat().st_mtime_ns == stamp


def test_tc_tags_become_names(converted):
    conll = load_task(converted / "conll2003", "train")
    assert conll[0] == {"id": "train-0", "tokens": WORDS,
                        "tags": ["B-LOC", "O", "O", "B-LOC", "O", "B-PER", "O", "O", "B-ORG", "I-ORG", "O"]}
    assert _meta(converted / "conll2003")["labels"] == list(hub_datasets.CONLL2003_LABELS)
    splits = _meta(converted / "conll2003")["splits"]
    assert [splits[s]["rows"] for s in ("train", "validation", "test")] == [24, 6, 6]
    onto = load_task(converted / "ontonotes", "test")  # bare integer tags: names from tner's label.json
    assert onto[0]["tags"][:4] == ["B-GPE", "O", "O", "B-GPE"] and onto[0]["tags"][5] == "B-PERSON"
    assert len(_meta(converted / "ontonotes")["labels"]) == 37
    uner = load_task(converted / "uner", "validation")
    assert uner[0]["id"] == "en_ewt-ud-validation-0" and set(uner[0]) == {"id", "tokens", "tags"}
    assert _meta(converted / "uner")["labels"] == ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC"]


def test_qa_keeps_squad_answers(converted):
    squad = {split: load_task(converted / "squad", split) for split in ("train", "validation", "test")}
    assert [len(rows) for rows in squad.values()] == [57, 3, 8]
    first = squad["test"][0]
    assert first == {"id": "validation0000", "context": "Item 0 was made in Lyon by Marie in 1900.",
                     "question": "When was item 0 made?",
                     "answers": {"text": ["1900", "Lyon"], "answer_start": [36, 19]}}
    v2 = load_task(converted / "squad_v2", "test")
    assert [bool(r["answers"]["text"]) for r in v2[:4]] == [False, True, True, False]
    assert _meta(converted / "squad_v2")["benchmark"]["conversion"] == {"dropped_misplaced_answers": 0,
                                                                         "dropped_questions": 0}


def test_qa_drops_misplaced_answers(tmp_path):
    rows = _squad_rows(40, "train")
    rows["answers"][0] = {"text": ["Lyon", "Paris"], "answer_start": [19, 3]}  # "Paris" is not at 3
    rows["answers"][1] = {"text": ["Rome"], "answer_start": [0]}
    loaded = {"train": Dataset.from_dict(rows, features=SQUAD_FEATURES),
              "test": Dataset.from_dict(_squad_rows(4, "validation"), features=SQUAD_FEATURES)}
    files = hub_datasets.render(BENCHMARKS["squad"], loaded, {"train": "test", "test": "test"})
    meta = json.loads(files[TASK_FILE])
    assert meta["benchmark"]["conversion"] == {"dropped_misplaced_answers": 2, "dropped_questions": 1}
    assert sum(meta["splits"][s]["rows"] for s in ("train", "validation")) == 39


def test_ir_follows_encodeval_corpus_and_relevance(converted):
    msmarco = converted / "msmarco"
    assert load_task(msmarco, "validation")[0] == {"id": "100", "query": "Query: query 0", "relevance": {"0": 1}}
    # TREC DL test: graded scores become binary; the score-0 passage stays in the corpus, 104 keeps 6.
    assert load_task(msmarco, "test") == [{"id": "103", "query": "Query: query 3", "relevance": {"3": 1, "5": 1}},
                                          {"id": "104", "query": "Query: query 4", "relevance": {"6": 1}}]
    corpus = load_task(msmarco, "corpus")
    assert [r["id"] for r in corpus] == [str(i) for i in range(7)] and corpus[0]["text"] == "Document: passage 0"
    assert load_task(msmarco, "train")[0] == {"id": "pair-0", "query": "Query: what is thing 0",
                                              "positive": "Document: thing 0 is a thing"}
    nq = {split: load_task(converted / "nq", split) for split in ("validation", "test", "corpus")}
    ids = sorted(f"test{i}" for i in range(10))
    import random
    assert sorted(r["id"] for r in nq["validation"]) == sorted(random.Random(42).sample(ids, 5))
    assert len(nq["test"]) == 5 and not {r["id"] for r in nq["test"]} & {r["id"] for r in nq["validation"]}
    assert nq["corpus"][0] == {"id": "doc0", "text": "Document: Title 0. nq passage 0"} and len(nq["corpus"]) == 10
    mldr = {split: load_task(converted / "mldr", split) for split in ("validation", "test", "corpus")}
    assert mldr["validation"][0] == {"id": "q-en-0", "query": "Query: long question 0", "relevance": {"doc-en-0": 1}}
    assert [r["text"] for r in mldr["corpus"]] == [f"Document: long document {i}" for i in range(5)]
    assert _meta(converted / "mldr")["splits"]["test"]["rows"] == 2


# ----------------------------------------------------------------------------- availability


@pytest.mark.timeout(60)  # at once: no retries against an unreachable hub
def test_missing_offline_fails_at_once(tmp_path):
    with pytest.raises(ValueError) as err:
        prepare_benchmarks(["sst2", "squad", "nq"], tmp_path / "tasks", tmp_path / "empty")
    message = str(err.value)
    for needed in ("nyu-mll/glue (config sst2, split train)", "rajpurkar/squad (config default, split validation)",
                   "BeIR/nq-qrels", "not reachable", "--benchmarks-dir",
                   "python tools/fetch_benchmarks.py --tasks sst2 squad nq --output-dir DIR", "HF_HUB_OFFLINE=1"):
        assert needed in message
    assert not (tmp_path / "tasks").exists()


def test_evaluate_cli_reports_missing_benchmarks(tmp_path, capsys, minilm_dir):
    assert evaluate.main(["--models", str(minilm_dir), "--tasks", "sst2", "--output-dir", str(tmp_path / "out"),
                          "--suite-dir", str(tmp_path / "suite")]) == 2
    err = capsys.readouterr().err
    assert "evaluate.py: error: benchmark data not available" in err and "nyu-mll/glue" in err


def test_task_names_and_defaults(tmp_path):
    assert hub_datasets.expand_tasks(["sst2", "paper", "qed", "rt_sentiment"])[:2] == ["sst2", "qqp"]
    assert hub_datasets.expand_tasks(["paper", "qed"]) == [*PAPER_TASKS, "qed"] and len(PAPER_TASKS) == 12
    assert evaluate.tasks_without_flag(None) == evaluate.default_tasks()  # no hub: the offline suite
    assert evaluate.tasks_without_flag(tmp_path) == ["paper"]
    with pytest.raises(ValueError, match="unknown task 'sst3'.*'paper'"):
        harness.resolve_tasks(["sst3"], tmp_path)


def test_fetch_tool_writes_a_benchmarks_dir(tmp_path, monkeypatch, hub_copy):
    """The fetch tool saves what the hub returns (here: the fixtures) where --benchmarks-dir reads it."""
    served = []

    def from_fixture(source):
        served.append(source)
        return hub_datasets.load_source(source, hub_copy)

    monkeypatch.setattr(hub_datasets, "_hub_load", from_fixture)
    assert fetch_benchmarks.main(["--tasks", "sst2", "--output-dir", str(tmp_path / "dl")]) == 2  # hub unreachable
    monkeypatch.setattr(fetch_benchmarks, "hub_reachable", lambda: True)
    assert fetch_benchmarks.main(["--tasks", "sst2", "mnli", "--output-dir", str(tmp_path / "dl")]) == 0
    assert [s.split for s in served] == ["train", "validation", "train", "validation_matched"]
    assert (tmp_path / "dl/nyu-mll/glue/mnli/validation_matched/state.json").is_file()
    assert fetch_benchmarks.main(["--tasks", "sst2", "--output-dir", str(tmp_path / "dl")]) == 0
    assert len(served) == 4  # kept, not fetched again
    task = prepare_benchmarks(["mnli"], tmp_path / "tasks", tmp_path / "dl", log=lambda line: None)["mnli"]
    assert (task / "test.jsonl").read_bytes() == (
        prepare_benchmarks(["mnli"], tmp_path / "direct", hub_copy, log=lambda line: None)["mnli"] / "test.jsonl"
    ).read_bytes()


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def encoder(tmp_path_factory, minilm_dir) -> str:
    """all-MiniLM-L6-v2 cut to its first layer, as in test_eval_harness."""
    from transformers import AutoModel, AutoTokenizer

    out = tmp_path_factory.mktemp("minilm_l1")
    AutoModel.from_pretrained(minilm_dir, num_hidden_layers=1).save_pretrained(out)
    AutoTokenizer.from_pretrained(minilm_dir).save_pretrained(out)
    return str(out)


def test_cli_fine_tunes_converted_benchmarks(tmp_path, hub_copy, encoder):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small CPU ops on a shared 2-core machine
    try:
        code = evaluate.main(["--models", f"minilm={encoder}", "--tasks", "sst2", "conll2003",
                              "--benchmarks-dir", str(hub_copy), "--suite-dir", str(tmp_path / "suite"),
                              "--output-dir", str(tmp_path / "out"), "--lrs", "1e-4", "--seeds", "0",
                              "--max-steps", "3", "--batch-size", "8", "--max-length", "32", "--device", "cpu"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    by_task = {r["task"]: r for r in summary["results"]}
    assert by_task["sst2"]["metric"] == "accuracy" and by_task["conll2003"]["metric"] == "f1"
    run = json.loads(grid.run_path(tmp_path / "out", "minilm", "sst2", 1e-4, 0).read_text())
    assert run["status"] == "ok" and run["steps"] == 3
    assert run["task_dir"] == str((tmp_path / "suite" / "sst2").resolve())
    assert 0.0 <= run["test"] <= 100.0


def test_harness_runs_converted_qa_and_ir(tmp_path, converted, encoder, capsys):
    """The QA and IR families accept the converted rows (answer offsets, qrels against the corpus).
    MS MARCO and NQ train on the same MS MARCO pairs: one training, scored on each, as the paper."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        evaluation = harness.evaluate_models(
            [f"minilm={encoder}"], ["squad_v2", "msmarco", "nq"], output_dir=tmp_path, lrs=(1e-4,), seeds=(0,),
            overrides={"max_steps": 2, "batch_size": 4, "max_length": 128, "max_eval_examples": 8, "device": "cpu"},
            suite_dir=converted)
    finally:
        torch.set_num_threads(threads)
    assert [(r.task, r.metric) for r in evaluation.results] == [
        ("squad_v2", "f1"), ("msmarco", "ndcg@10"), ("nq", "ndcg@10")]
    assert evaluation.executed == 3
    assert capsys.readouterr().out.count("minilm lr=0.0001 seed=0: one training for msmarco, nq") == 1
    msmarco, nq = (json.loads(grid.run_path(tmp_path, "minilm", task, 1e-4, 0).read_text()) for task in ("msmarco", "nq"))
    assert msmarco["losses"] == nq["losses"] and msmarco["steps"] == nq["steps"] == 2
    assert set(msmarco["per_example"]["test"]) != set(nq["per_example"]["test"])  # each scored on its own queries
