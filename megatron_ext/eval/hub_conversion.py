"""What one of the paper's benchmarks is (:class:`Source`, :class:`Benchmark`) and the conversions of its hub datasets to the harness's per-family rows (SC, TC, QA, and
retrieval from BEIR-style qrels or MLDR), as EncodEval reads them: one function per family, called
through each :class:`~megatron_ext.eval.hub_datasets.Benchmark`'s ``convert``. Splits follow
EncodEval (module docstring of :mod:`megatron_ext.eval.hub_datasets`)."""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_ext.config_loading import UserError

VALIDATION_SEED = 42
"""Seed of EncodEval's ``train_test_split(train_size=0.95, seed=42)``."""
TRAIN_SIZE = 0.95
"""Share of the official train split kept for training (the rest is validation)."""
QUERY_PREFIX = "Query: "
"""EncodEval prefixes every retrieval query with this (``encodeval/datasets.py``)..."""
DOCUMENT_PREFIX = "Document: "
"""... and every passage, training positives included, with this."""


@dataclass(frozen=True, kw_only=True)
class Source:
    """One split of one hub dataset: what one ``datasets.load_dataset`` call returns."""

    dataset: str
    """Hub dataset id, e.g. ``nyu-mll/glue``."""
    config: str | None = None
    """Configuration name (``load_dataset``'s ``name``); None: the default one."""
    split: str
    """Split name on the hub, e.g. ``validation_matched``."""

    def describe(self) -> str:
        return f"{self.dataset} (config {self.config or 'default'}, split {self.split})"


Converter = Callable[["Benchmark", Mapping[str, Any]], dict[str, list[dict]]]


@dataclass(frozen=True, kw_only=True)
class Benchmark:
    """One of the paper's tasks: where its data is on the hub and how it becomes a task directory."""

    name: str
    """Task name (``--tasks``), also its directory name."""
    family: str
    """Task family the harness fine-tunes it with."""
    metric: str
    """What the family reports (``task.json``'s metric)."""
    sources: Mapping[str, Source]
    """Role -> hub split: ``train``/``validation``/``test`` (SC, TC, QA; a missing validation is cut
    from train), and for IR ``pairs`` (training), ``queries``, ``corpus``, ``qrels_validation``,
    ``qrels_test`` (``qrels`` when one qrels split is halved into validation and test)."""
    columns: Mapping[str, str]
    """Our column -> the source column(s) it is made of (docs and ``task.json``)."""
    convert: Converter
    """Rows per split (``train``, ``validation``, ``test``, IR ``corpus``) from the loaded sources."""
    labels: tuple[str, ...] = ()
    """Label names when the source stores integers without ClassLabel names (OntoNotes); a ClassLabel
    in the source's features takes precedence. Empty for QA and IR."""
    split_protocol: str
    """How train/validation/test are made, in words (``task.json``)."""
    encodeval: str
    """EncodEval's loader function (in :data:`ENCODEVAL`) this follows."""
    text_template: str | None = None
    """SC: how a row's text is made from the source columns (EncodEval's templates)."""
    passage_template: str = "{text}"
    """IR (BEIR): how a passage's text is made from the corpus's ``title`` and ``text``."""
    notes: str = ""
    """What the conversion assumes or does beyond renaming."""

    @property
    def datasets(self) -> list[str]:
        return list(dict.fromkeys(source.dataset for source in self.sources.values()))


def _label_names(dataset, column: str, fallback: Sequence[str]) -> list[str]:
    """ClassLabel names of ``column`` (or of the items of a list column), else ``fallback``."""
    feature = dataset.features[column]
    feature = getattr(feature, "feature", feature)  # List(ClassLabel) -> ClassLabel
    names = getattr(feature, "names", None)
    return list(names) if names else list(fallback)


def _require(dataset, columns: Iterable[str], where: str) -> None:
    missing = [c for c in columns if c not in dataset.column_names]
    if missing:
        raise UserError(f"{where}: missing column(s) {missing}; it has {dataset.column_names} "
                        "(docs/eval_suite.md lists the schema each benchmark expects)")


def _cut_validation(loaded: Mapping[str, Any]) -> dict[str, Any]:
    """``train``/``validation``/``test`` datasets: validation cut from train as EncodEval does when
    the benchmark has no validation source."""
    import datasets

    splits = dict(loaded)
    if "validation" not in splits:
        train = splits["train"]
        # EncodEval's call on a stand-in with as many rows gives its exact partition; applied with
        # select(keep_in_memory=True) because train_test_split on a dataset read from disk caches its
        # indices next to the arrow files, which may be a read-only shared copy.
        cut = datasets.Dataset.from_dict({"row": range(len(train))}).train_test_split(
            train_size=TRAIN_SIZE, seed=VALIDATION_SEED)
        splits["train"], splits["validation"] = (train.select(cut[part]["row"], keep_in_memory=True)
                                                 for part in ("train", "test"))
    return splits


def _rows(dataset, columns: Sequence[str]) -> Iterable[dict]:
    """The rows of ``dataset`` restricted to ``columns``, batch by batch (the corpora are large)."""
    for batch in dataset.select_columns(list(columns)).iter(batch_size=10_000):
        yield from (dict(zip(batch, values)) for values in zip(*batch.values()))


def convert_sc(bench: Benchmark, loaded: Mapping[str, Any]) -> dict[str, list[dict]]:
    """GLUE rows -> ``{id, text, label}``; ``text`` from :attr:`Benchmark.text_template`."""
    out = {}
    names = None
    for split, dataset in _cut_validation(loaded).items():
        fields = [field for _, field, _, _ in string.Formatter().parse(bench.text_template) if field]
        needed = ["idx", "label", *fields]
        _require(dataset, needed, f"{bench.name} {split}")
        split_names = _label_names(dataset, "label", bench.labels)
        if names is not None and split_names != names:
            raise UserError(f"{bench.name}: split {split} has labels {split_names}, another split {names}")
        names = split_names
        rows = []
        for row in _rows(dataset, needed):
            if not 0 <= row["label"] < len(names):
                raise UserError(f"{bench.name} {split}: row idx {row['idx']} has label {row['label']}; "
                                f"expected 0..{len(names) - 1} ({names}); test splits of GLUE are unlabelled")
            rows.append({"id": str(row["idx"]), "text": bench.text_template.format(**row), "label": row["label"]})
        out[split] = rows
    out["labels"] = names
    return out


def convert_tc(bench: Benchmark, loaded: Mapping[str, Any]) -> dict[str, list[dict]]:
    """Word/tag sequences -> ``{id, tokens, tags}`` with tag names (the ClassLabel's, else
    :attr:`Benchmark.labels`)."""
    tokens_col, tags_col = bench.columns["tokens"], bench.columns["tags"]
    out: dict[str, Any] = {}
    names = None
    dropped = 0
    for split, dataset in loaded.items():
        _require(dataset, (tokens_col, tags_col), f"{bench.name} {split}")
        names = _label_names(dataset, tags_col, bench.labels)
        if not names:
            raise UserError(f"{bench.name} {split}: {tags_col!r} has no ClassLabel names and the benchmark "
                            "defines none")
        has_idx = "idx" in dataset.column_names
        rows = []
        for i, row in enumerate(_rows(dataset, (tokens_col, tags_col) + (("idx",) if has_idx else ()))):
            tokens, tags = list(row[tokens_col]), list(row[tags_col])
            if not tokens:  # EncodEval's alignment reads tokens[0]; an empty sentence has nothing to tag
                dropped += 1
                continue
            if len(tokens) != len(tags) or not all(0 <= t < len(names) for t in tags):
                raise UserError(f"{bench.name} {split} row {i}: {len(tokens)} tokens, tags {tags[:10]}...; "
                                f"expected one tag index in 0..{len(names) - 1} per token")
            rows.append({"id": str(row["idx"]) if has_idx else f"{split}-{i}", "tokens": tokens,
                         "tags": [names[t] for t in tags]})
        out[split] = rows
    out["labels"] = names
    out["notes"] = {"dropped_empty_sentences": dropped}
    return out


def convert_qa(bench: Benchmark, loaded: Mapping[str, Any]) -> dict[str, list[dict]]:
    """SQuAD-format rows -> ``{id, context, question, answers}``. Answers whose ``answer_start`` does
    not point at their text are dropped (counted in ``task.json``); a question left without any of
    its answers is dropped, not turned into an unanswerable one."""
    out: dict[str, Any] = {}
    notes = {"dropped_misplaced_answers": 0, "dropped_questions": 0}
    for split, dataset in _cut_validation(loaded).items():
        _require(dataset, ("context", "question", "answers"), f"{bench.name} {split}")
        has_id = "id" in dataset.column_names
        rows = []
        for i, row in enumerate(_rows(dataset, ("context", "question", "answers") + (("id",) if has_id else ()))):
            answers = row["answers"]
            kept = [(text, start) for text, start in zip(answers["text"], answers["answer_start"], strict=True)
                    if row["context"][start:start + len(text)] == text]
            notes["dropped_misplaced_answers"] += len(answers["text"]) - len(kept)
            if answers["text"] and not kept:
                notes["dropped_questions"] += 1
                continue
            rows.append({"id": str(row["id"]) if has_id else f"{split}-{i}", "context": row["context"],
                         "question": row["question"],
                         "answers": {"text": [t for t, _ in kept], "answer_start": [s for _, s in kept]}})
        out[split] = rows
    out["notes"] = notes
    return out


def _ir_train(loaded: Mapping[str, Any], where: str) -> list[dict]:
    """MS MARCO (query, positive) pairs with EncodEval's prefixes."""
    pairs = loaded["pairs"]
    _require(pairs, ("query", "positive"), f"{where} pairs")
    return [{"id": f"pair-{i}", "query": QUERY_PREFIX + row["query"], "positive": DOCUMENT_PREFIX + row["positive"]}
            for i, row in enumerate(_rows(pairs, ("query", "positive")))]


def _ir_splits(qrels: Mapping[str, dict[str, dict[str, int]]], judged: Iterable[str],
               queries: Mapping[str, str], corpus_rows: Iterable[tuple[str, str]],
               where: str) -> dict[str, list[dict]]:
    """Validation/test rows with binary relevance, and the corpus: the judged passages only.

    EncodEval's retrieval corpus is the union of the passages its qrels name (``corpus_sub``), not
    the whole collection; queries without a relevant passage are left out, as its qrels dicts do.
    """
    judged = set(judged)
    corpus = [{"id": doc, "text": DOCUMENT_PREFIX + text} for doc, text in corpus_rows if doc in judged]
    missing = judged - {row["id"] for row in corpus}
    if missing:
        raise UserError(f"{where}: {len(missing)} judged passage(s) are not in the corpus, "
                        f"e.g. {sorted(missing)[:5]}")
    out = {"corpus": corpus}
    for split, by_query in qrels.items():
        absent = [q for q in by_query if q not in queries]
        if absent:
            raise UserError(f"{where}: {len(absent)} {split} query id(s) are not in the queries, e.g. {absent[:5]}")
        out[split] = [{"id": q, "query": QUERY_PREFIX + queries[q], "relevance": relevant}
                      for q, relevant in by_query.items() if relevant]
    return out


def _beir_qrels(dataset, keep: set[str] | None = None) -> tuple[dict[str, dict[str, int]], set[str]]:
    """``query id -> {passage id: 1}`` for score >= 1 (EncodEval's binary relevance), and every judged
    passage id (any score: EncodEval adds score-0 passages to the corpus too)."""
    by_query: dict[str, dict[str, int]] = {}
    judged = set()
    for row in _rows(dataset, ("query-id", "corpus-id", "score")):
        query, doc = str(row["query-id"]), str(row["corpus-id"])
        if keep is not None and query not in keep:
            continue
        judged.add(doc)
        relevant = by_query.setdefault(query, {})
        if row["score"] >= 1:
            relevant[doc] = 1
    return by_query, judged


def _beir_text(dataset, template: str) -> Iterable[tuple[str, str]]:
    """``(id, text)`` of BEIR queries or passages, the text made by ``template``."""
    fields = [field for _, field, _, _ in string.Formatter().parse(template) if field]
    for row in _rows(dataset, ["_id", *fields]):
        yield str(row["_id"]), template.format(**row)


def convert_beir(bench: Benchmark, loaded: Mapping[str, Any]) -> dict[str, list[dict]]:
    """BEIR queries/corpus/qrels -> IR validation/test/corpus; MS MARCO pairs -> train.

    With one ``qrels`` split (NQ), its query ids are halved into validation and test as EncodEval
    does, but with a fixed ``random.Random(42)`` (EncodEval's ``random.sample`` runs after
    ``set_seed(run seed)``, so its halves change with the fine-tuning seed).
    """
    _require(loaded["queries"], ("_id", "text"), f"{bench.name} queries")
    _require(loaded["corpus"], ("_id", "title", "text"), f"{bench.name} corpus")
    if "qrels" in loaded:
        _require(loaded["qrels"], ("query-id", "corpus-id", "score"), f"{bench.name} qrels")
        ids = sorted({str(q) for q in loaded["qrels"]["query-id"]})
        validation = set(random.Random(VALIDATION_SEED).sample(ids, round(0.5 * len(ids))))
        split_qrels = {"validation": validation, "test": set(ids) - validation}
        qrels, judged = {}, set()
        for split, keep in split_qrels.items():
            qrels[split], split_judged = _beir_qrels(loaded["qrels"], keep)
            judged |= split_judged
    else:
        qrels, judged = {}, set()
        for split in ("validation", "test"):
            _require(loaded[f"qrels_{split}"], ("query-id", "corpus-id", "score"), f"{bench.name} qrels_{split}")
            qrels[split], split_judged = _beir_qrels(loaded[f"qrels_{split}"])
            judged |= split_judged
    wanted = {q for by_query in qrels.values() for q in by_query}
    queries = {q: text for q, text in _beir_text(loaded["queries"], "{text}") if q in wanted}
    out = _ir_splits(qrels, judged, queries, _beir_text(loaded["corpus"], bench.passage_template), bench.name)
    out["train"] = _ir_train(loaded, bench.name)
    return out


def convert_mldr(bench: Benchmark, loaded: Mapping[str, Any]) -> dict[str, list[dict]]:
    """MLDR (dev -> validation, test) with its corpus config -> IR splits; MS MARCO pairs -> train.

    Relevant passages are each query's ``positive_passages``; their text is taken from the corpus
    config, as EncodEval does (its ``negative_passages`` are not used)."""
    qrels, judged, queries = {}, set(), {}
    for split in ("validation", "test"):
        dataset = loaded[f"qrels_{split}"]
        _require(dataset, ("query_id", "query", "positive_passages"), f"{bench.name} qrels_{split}")
        by_query = {}
        for row in _rows(dataset, ("query_id", "query", "positive_passages")):
            queries[row["query_id"]] = row["query"]
            relevant = by_query.setdefault(row["query_id"], {})
            for passage in row["positive_passages"]:
                relevant[passage["docid"]] = 1
                judged.add(passage["docid"])
        qrels[split] = by_query
    _require(loaded["corpus"], ("docid", "text"), f"{bench.name} corpus")
    corpus_rows = ((row["docid"], row["text"]) for row in _rows(loaded["corpus"], ("docid", "text")))
    out = _ir_splits(qrels, judged, queries, corpus_rows, bench.name)
    out["train"] = _ir_train(loaded, bench.name)
    return out
