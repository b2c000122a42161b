"""TC: ``wiki_mentions``, mention detection from Wikipedia links, like WikiNER."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from megatron_ext.data.wikipedia import DUMP_ASSET, DUMP_MEMBER, unmark
from megatron_ext.eval.suite.base import TaskData, TaskSpec
from megatron_ext.eval.suite.common import WIKI_LICENSE, Capitalisation, tokenize, wikipedia_sections, wikipedia_splitter

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
    splitter = wikipedia_splitter()
    sentences = []
    for section in wikipedia_sections():
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
    caps = Capitalisation.count(s.words for s in sentences)

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
        documents=sorted({s.article for s in wikipedia_sections()}), examples=examples, stats=stats,
        notes=dict(counts),
    )


TASKS = (
    TaskSpec(
        name="wiki_mentions", family="tc", metric="entity-level F1 (seqeval, micro)", labels=TC_LABELS,
        description="Wikipedia sentences, BIO tags of name mentions derived from links (WikiNER-like)",
        sources=((DUMP_ASSET, DUMP_MEMBER),), license=WIKI_LICENSE,
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
)
