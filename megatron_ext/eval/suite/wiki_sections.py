"""IR: ``wiki_sections``, section-heading queries against Wikipedia paragraphs, graded qrels."""

from __future__ import annotations

from collections import Counter

from megatron_ext.data.wikipedia import DUMP_ASSET, DUMP_MEMBER, unmark
from megatron_ext.eval.suite.base import TaskData, TaskSpec
from megatron_ext.eval.suite.common import WIKI_LICENSE, wikipedia_sections

IR_MIN_WORDS = 10
"""Paragraphs shorter than this (captions, list stubs) are left out of the corpus."""


def _build_wiki_sections() -> TaskData:
    corpus: list[dict] = []
    examples: list[tuple[str, dict]] = []
    numbers: Counter = Counter()
    queries: set[tuple[str, str]] = set()
    duplicates = 0
    for section in wikipedia_sections():
        ids, texts = [], []
        for paragraph in section.paragraphs:
            text = unmark(paragraph)[0]
            if len(text.split()) < IR_MIN_WORDS:
                continue
            pid = f"{section.article}:p{numbers[section.article, 'p']}"
            numbers[section.article, "p"] += 1
            corpus.append({"id": pid, "title": section.title, "text": text})
            ids.append(pid)
            texts.append(text)
        query = ": ".join((section.title, *section.headings))
        if not ids:
            continue
        if (section.article, query) in queries:
            duplicates += 1  # two sections with the same heading path: the query would be ambiguous
            continue
        queries.add((section.article, query))
        qid = f"{section.article}:q{numbers[section.article, 'q']}"
        numbers[section.article, "q"] += 1
        examples.append((section.article, {
            "id": qid, "doc": section.article, "query": query, "positive_id": ids[0], "positive": texts[0],
            "relevance": {pid: 2 if k == 0 else 1 for k, pid in enumerate(ids)},
        }))

    def stats(rows: list[dict]) -> dict:
        graded = Counter(g for r in rows for g in r["relevance"].values())
        return {"relevant_grade_2": graded[2], "relevant_grade_1": graded[1]}

    return TaskData(
        documents=sorted({s.article for s in wikipedia_sections()}), examples=examples, stats=stats,
        corpus=corpus, notes={"corpus_passages": len(corpus), "dropped_duplicate_queries": duplicates},
    )


TASKS = (
    TaskSpec(
        name="wiki_sections", family="ir", metric="NDCG@10", labels=(),
        description="Wikipedia section-heading queries against all paragraphs, graded qrels",
        sources=((DUMP_ASSET, DUMP_MEMBER),), license=WIKI_LICENSE,
        construction=(
            "MS MARCO-style (query, positive passage) pairs with graded qrels for NDCG@10. Corpus: "
            f"every paragraph of >= {IR_MIN_WORDS} words of the dump's articles (all splits; test "
            "queries retrieve from it all). One query per section with paragraphs: '<title>: "
            "<heading>: <subheading>' (the title alone for the lead). Relevance 2 = the section's "
            "first paragraph (the positive for InfoNCE with in-batch negatives), 1 = its other "
            "paragraphs, 0 = everything else. Sections of the same article share its split."
        ),
        test_fraction=0.2, split_key="wikipedia", build=_build_wiki_sections,
    ),
)
