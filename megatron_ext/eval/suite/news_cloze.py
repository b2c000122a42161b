"""QA: ``news_cloze`` and ``news_cloze_v2``, entity cloze over news like CNN/Daily Mail and ReCoRD; v2
adds unanswerable queries, like SQuAD v2."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass

from megatron_ext import assets
from megatron_ext.data.sentences import train_punkt
from megatron_ext.eval.suite.base import TaskData, TaskSpec
from megatron_ext.eval.suite.common import (LEE_BACKGROUND_MEMBER, LEE_LICENSE, LEE_MEMBER, Capitalisation,
                                           document_hash, tokenize)

PLACEHOLDER = "@placeholder"
_CONNECTORS = frozenset({"of", "the", "and", "for", "bin", "de", "du", "la", "van", "von"})
"""Lowercase words allowed inside a capitalised name ("Bureau of Meteorology")."""
QA_MIN_SENTENCES = 3
"""An article needs this many sentences: the passage keeps at least two after the query is cut."""
QA_MIN_QUERY_TOKENS = 6


@dataclass(frozen=True)
class _News:
    articles: tuple[tuple[str, str], ...]
    """(id, text) of the Lee background (300) and Lee (50) articles, exact duplicates dropped."""
    sentences: dict[str, list[tuple[int, int]]]
    """Sentence spans per article."""
    unit: dict[str, str]
    """Split unit of each article: articles sharing a sentence (re-filed stories; the background
    corpus has several) form one unit, named by one of them, so a query sentence never recurs in a
    passage of another split."""


@functools.cache
def _news() -> _News:
    background = assets.member("gensim", LEE_BACKGROUND_MEMBER).read_text(encoding="utf-8")
    lee = assets.member("gensim", LEE_MEMBER).read_bytes().decode("latin-1")  # "£" is byte 0xa3
    articles, seen = [], set()
    for prefix, raw, width in (("lee_background", background, 3), ("lee", lee, 2)):
        for number, line in enumerate(raw.splitlines(), start=1):
            text = " ".join(line.split())
            if text and text not in seen:
                seen.add(text)
                articles.append((f"{prefix}:{number:0{width}d}", text))
    splitter, _ = train_punkt((text for _, text in articles))  # the whole corpus (~0.4M characters)
    sentences = {doc: list(splitter.span_tokenize(text)) for doc, text in articles}
    unit = {doc: doc for doc, _ in articles}
    first_seen: dict[str, str] = {}
    for doc, text in articles:
        for a, b in sentences[doc]:
            key = " ".join(re.findall(r"\w+", text[a:b].lower()))
            other = first_seen.setdefault(key, doc)
            if unit[other] != unit[doc]:
                old, new = unit[doc], unit[other]
                unit.update({d: new for d, u in unit.items() if u == old})
    return _News(articles=tuple(articles), sentences=sentences, unit=unit)


def _capitalised_runs(text: str, sentence: tuple[int, int]) -> list[tuple[int, int, bool]]:
    """(start, end, opens the sentence) of the numbers and capitalised word runs of a sentence.

    A run is capitalised words joined by single spaces, with :data:`_CONNECTORS` inside ("Bureau of
    Meteorology"); a trailing possessive is not part of it.
    """
    start, end = sentence
    tokens = [(start + a, start + b) for a, b in tokenize(text[start:end])]
    words = [text[a:b] for a, b in tokens]
    first_word = next((k for k, w in enumerate(words) if w[0].isalpha()), None)
    runs = []
    k = 0
    while k < len(tokens):
        if words[k][0].isdigit():
            runs.append((*tokens[k], False))
        elif words[k][0].isupper() and words[k] != "I":
            last = k
            while last + 1 < len(tokens) and text[tokens[last][1]:tokens[last + 1][0]] == " " and (
                words[last + 1][0].isupper() or words[last + 1] in _CONNECTORS
            ):
                last += 1
            while words[last] in _CONNECTORS:
                last -= 1
            a, b = tokens[k][0], tokens[last][1]
            if text[b - 2:b] in ("'s", "’s"):
                b -= 2
            runs.append((a, b, k == first_word))
            k = last
        k += 1
    return runs


def _entity_spans(text: str, runs: list[tuple[int, int, bool]], caps: Capitalisation,
                  known: frozenset[str]) -> list[tuple[int, int]]:
    """Entity-like spans among ``runs``, standing in for the NER tagger CNN/Daily Mail and ReCoRD used.

    A run opening its sentence may be capitalised for that reason alone: unless the same string
    occurs mid-sentence somewhere in the corpus (``known``), a first word that is not a proper word
    is dropped ("The Bureau of Meteorology" -> "Bureau of Meteorology"). A single word must be
    proper ("Sydney", not a quoted "We").
    """
    spans = []
    for a, b, opens in runs:
        if text[a].isdigit():
            spans.append((a, b))
            continue
        words = text[a:b].split(" ")
        if opens and text[a:b] not in known and not caps.proper(words[0]):
            words = words[1:]
            while words and words[0] in _CONNECTORS:
                words = words[1:]
            a = b - len(" ".join(words))
        if len(words) > 1 or (words and caps.proper(words[0])):
            spans.append((a, b))
    return spans


@functools.cache
def _news_items() -> tuple[tuple[str, dict], ...]:
    """Every cloze item of the news articles: answerable ones have answers, the others empty lists."""
    news = _news()
    articles, sentences = news.articles, news.sentences
    caps = Capitalisation.count(
        [text[a:b] for a, b in tokenize(text[s:e])] for doc, text in articles for s, e in sentences[doc]
    )
    runs = {doc: [_capitalised_runs(text, span) for span in sentences[doc]] for doc, text in articles}
    known = frozenset(
        text[a:b] for doc, text in articles for sentence_runs in runs[doc] for a, b, opens in sentence_runs
        if not opens
    )

    items = []
    for doc, text in articles:
        spans = sentences[doc]
        if len(spans) < QA_MIN_SENTENCES:
            continue
        candidates = [_entity_spans(text, sentence_runs, caps, known) for sentence_runs in runs[doc]]
        for q, (s_start, s_end) in enumerate(spans):
            sentence = text[s_start:s_end]
            if len(tokenize(sentence)) < QA_MIN_QUERY_TOKENS:
                continue
            left, right = text[:s_start].rstrip(), text[s_end:].lstrip()
            joiner = " " if left and right else ""
            passage = left + joiner + right
            shift = len(left) + len(joiner) - (len(text) - len(right))  # text -> passage, after the cut
            in_passage: dict[str, list[int]] = {}
            for other, spans_other in enumerate(candidates):
                for a, b in spans_other if other != q else ():
                    in_passage.setdefault(text[a:b], []).append(a if a < s_start else a + shift)
            for c, (a, b) in enumerate(candidates[q]):
                surface = text[a:b]
                question = sentence[:a - s_start] + PLACEHOLDER + sentence[b - s_start:]
                whole_word = re.compile(rf"(?<!\w){re.escape(surface)}(?!\w)")
                if whole_word.search(question):
                    continue  # another copy in the query would give the answer away
                starts = sorted(in_passage.get(surface, []))
                if not starts and whole_word.search(passage):
                    continue  # present, but only inside a longer name: neither clean answer nor absent
                items.append((news.unit[doc], {
                    "id": f"{doc}:{q}:{c}", "doc": doc, "context": passage, "question": question,
                    "answers": {"text": [surface] * len(starts), "answer_start": starts},
                }))
    return tuple(items)


def _qa_stats(rows: list[dict]) -> dict:
    answerable = sum(bool(r["answers"]["text"]) for r in rows)
    return {"answerable": answerable, "unanswerable": len(rows) - answerable}


UNANSWERABLE_SHARE = 1 / 3
"""news_cloze_v2's share of unanswerable items, SQuAD v2's in its training set."""


def _build_news_cloze(*, unanswerable: bool) -> Callable[[], TaskData]:
    def build() -> TaskData:
        items = _news_items()
        answerable = sum(bool(row["answers"]["text"]) for _, row in items)
        candidates = sorted((row["id"] for _, row in items if not row["answers"]["text"]),
                            key=lambda item_id: document_hash("unanswerable", item_id))
        # Unanswerable candidates outnumber the answerable items: keep a hash-ranked sample.
        wanted = round(answerable * UNANSWERABLE_SHARE / (1 - UNANSWERABLE_SHARE)) if unanswerable else 0
        keep = set(candidates[:wanted])
        examples = [(unit, row) for unit, row in items if row["answers"]["text"] or row["id"] in keep]
        notes = {"unanswerable_candidates": len(candidates)} if unanswerable else {}
        return TaskData(documents=sorted(set(_news().unit.values())), examples=examples, stats=_qa_stats,
                        notes=notes)
    return build


TASKS = (
    TaskSpec(
        name="news_cloze", family="qa", metric="SQuAD F1 (and exact match)", labels=(),
        description="Entity cloze over Australian news in SQuAD format (CNN/Daily Mail, ReCoRD-like)",
        sources=(("gensim", LEE_BACKGROUND_MEMBER), ("gensim", LEE_MEMBER)), license=LEE_LICENSE,
        construction=(
            "Like CNN/Daily Mail and ReCoRD: for every sentence of an article (Punkt trained on the "
            "corpus), the passage is the article without that sentence and the query is the sentence "
            f"with one entity-like span replaced by {PLACEHOLDER}. Entity-like: a capitalised word "
            "run (internal 'of', 'the', ...) or a number, standing in for their NER tagger. Kept when "
            "the span appears exactly once in the query and as an entity-like span in the passage; "
            "answers list every such occurrence (SQuAD allows several; the first is the training "
            "target). Articles sharing a sentence are split together."
        ),
        test_fraction=0.2, split_key="lee", build=_build_news_cloze(unanswerable=False),
    ),
    TaskSpec(
        # Deliberately news_cloze's entry again with unanswerable queries added (SQuAD v2 beside v1).
        name="news_cloze_v2", family="qa", metric="SQuAD v2 F1 (and exact match)", labels=(),
        description="news_cloze plus unanswerable queries with empty answers (SQuAD v2-like)",
        sources=(("gensim", LEE_BACKGROUND_MEMBER), ("gensim", LEE_MEMBER)), license=LEE_LICENSE,
        construction=(
            "news_cloze's items plus, like SQuAD v2, unanswerable ones: queries whose replaced span "
            "does not occur in the passage at all (empty answers). Spans that occur only inside a "
            "longer name of the passage are left out of both kinds. Same splits as news_cloze."
        ),
        test_fraction=0.2, split_key="lee", build=_build_news_cloze(unanswerable=True),
    ),
)
