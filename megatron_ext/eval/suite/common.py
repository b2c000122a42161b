"""What several of the suite's builders share: the raw files they read and their licenses, a
tokenizer, the split hash, a corpus's capitalisation statistics and the Wikipedia dump's sections and
sentence splitter."""

from __future__ import annotations

import functools
import hashlib
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from megatron_ext import assets
from megatron_ext.data.sentences import train_punkt
from megatron_ext.data.wikipedia import DUMP_ASSET, DUMP_MEMBER, Section, article_sections, unmark, wikipedia_articles

LEE_BACKGROUND_MEMBER = "gensim/test/test_data/lee_background.cor"
LEE_MEMBER = "gensim/test/test_data/lee.cor"
LEE_SIMILARITIES_MEMBER = "gensim/test/test_data/similarities0-1.txt"
VADER_MEMBER = "vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz"
VADER_MOVIES = "hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt"

WIKI_LICENSE = "CC BY-SA 3.0 (English Wikipedia text, 2016 dump excerpt shipped with gensim 4.4.0)"
LEE_LICENSE = "research use (Lee, Pincombe & Welsh 2005 corpus, shipped with gensim 4.4.0)"


_TOKEN = re.compile(r"\d+(?:[.,:]\d+)+|(?:[^\W\d_]\.){2,}|[A-Z]\.(?= [A-Z])|\w+(?:['’-]\w+)*|[^\w\s]")
"""Words (letters/digits, keeping inner apostrophes and hyphens), numbers with separators,
dotted abbreviations ("U.S.") and initials ("John F. Kennedy"), and every other non-space
character as its own token."""


def tokenize(text: str) -> list[tuple[int, int]]:
    """Character spans of the words of ``text`` (see :data:`_TOKEN`)."""
    return [m.span() for m in _TOKEN.finditer(text)]


def document_hash(*parts: str) -> bytes:
    return hashlib.sha256(":".join(parts).encode("utf-8")).digest()


@dataclass(frozen=True)
class Capitalisation:
    """How a corpus capitalises each word away from sentence starts, where case is informative.

    A word is *proper* when it is written capitalised more often than not there ("Australia",
    "Greek", "NSW"), the signal WikiNER-style heuristics use to tell names from common nouns.
    """

    upper: Counter
    lower: Counter

    @classmethod
    def count(cls, sentences: Iterable[list[str]]) -> Capitalisation:
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



@functools.cache
def wikipedia_sections() -> tuple[Section, ...]:
    """Sections of the dump's articles (:func:`~megatron_ext.data.wikipedia.article_sections`).

    Cached: parsing the ~100 articles takes several seconds and two tasks use them.
    """
    articles, _ = wikipedia_articles(assets.member(DUMP_ASSET, DUMP_MEMBER))
    return tuple(section for article in articles for section in article_sections(article))


@functools.cache
def wikipedia_splitter():
    """Punkt trained on the dump's own text (nltk's pretrained models are not downloadable here);
    400k characters learn its abbreviations well enough and keep the build fast."""
    texts = (unmark(paragraph)[0] for section in wikipedia_sections() for paragraph in section.paragraphs)
    punkt, _ = train_punkt(texts, max_chars=400_000)
    return punkt
