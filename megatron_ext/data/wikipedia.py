"""English Wikipedia from a MediaWiki XML dump: the articles, their wikitext and its plain text.

The demo corpus (:mod:`megatron_ext.data.sample_corpus`) and the evaluation suite
(:mod:`megatron_ext.eval.suite`) both read gensim's shortened 2016 dump through this module, so
they see the same articles cleaned the same way. It owns:

- streaming the bz2 XML dump (stdlib parser) and picking the articles: main namespace, no
  redirects, no empty or disambiguation pages (:func:`wikipedia_articles`);
- wikitext to plain text (:func:`wikitext_to_text`): tables and citation sections cut by a line
  scan, templates, refs and file/category links pruned with mwparserfromhell, then :func:`tidy`.
"""

from __future__ import annotations

import bz2
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mwparserfromhell
from mwparserfromhell.nodes import Node, Tag, Template, Wikilink
from mwparserfromhell.wikicode import Wikicode

DUMP_ASSET = "gensim"
"""Asset in :data:`megatron_ext.assets.ASSETS` holding the dump."""
DUMP_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
"""Path of the dump inside the asset's archive: ~100 articles of the 2016 English Wikipedia."""


# ----------------------------------------------------------------------------- text helpers

_SPACES = re.compile(r"[ \t\u00a0]{2,}")
# Parentheses left empty (or holding only separators) once templates such as pronunciations are gone.
EMPTY_PARENS = re.compile(r" ?\(\s*(?:[,;:]\s*)*\)")
_BLANK_LINES = re.compile(r"\n{3,}")


def tidy(text: str) -> str:
    """Collapse spaces, strip lines, drop empty parentheses and lines without a letter or digit
    (leftovers of removed markup), keep single blank lines between paragraphs.

    The last step of :func:`wikitext_to_text`; the demo corpus tidies its other sources with it too.
    """
    text = EMPTY_PARENS.sub("", text)
    lines = [_SPACES.sub(" ", line).strip() for line in text.split("\n")]
    lines = [line if any(c.isalnum() for c in line) else "" for line in lines]
    return _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()


# ----------------------------------------------------------------------------- wikitext

_DROP_SECTIONS = frozenset({
    "references", "notes", "footnotes", "citations", "notes and references", "sources",
    "bibliography", "works cited", "further reading", "external links", "see also",
})
"""Level-2 sections that hold link lists and citations rather than prose."""
_DROP_TAGS = frozenset({"ref", "references", "table", "gallery", "math", "div", "timeline", "score"})
_DROP_LINK_NAMESPACES = frozenset({"file", "image", "media", "category"})
_MARKUP_LEFTOVERS = ("[[", "]]", "{{", "}}", "{|", "|}", "<ref")
_HTML_TAG = re.compile(r"</?[A-Za-z][A-Za-z0-9]*(?:\s[^<>]*)?/?>")
_MAGIC_WORD = re.compile(r"__[A-Z]+__")
_QUOTE_RUN = re.compile(r"'{2,}")
_HEADING_LINE = re.compile(r"^(={1,6})\s*(.*?)\s*\1\s*$")
# Disambiguation pages are link lists; they carry one of these templates ({{disambiguation|geo}}).
_DISAMBIGUATION = re.compile(r"\{\{\s*(?:[^{}|]*disambig[^{}|]*|dab|hndis|geodis)\s*[|}]", re.IGNORECASE)


def _drop_blocks(wikitext: str) -> str:
    """Remove ``{| ... |}`` tables (possibly nested) and the sections in :data:`_DROP_SECTIONS`.

    Both are line-anchored syntax, so a line scan is exact. Doing it before parsing matters:
    mwparserfromhell gives up on many real tables (templates in cells, stray attributes) and
    returns them as text, and an unclosed HTML tag makes it nest every later heading inside it.
    """
    kept, table_depth, in_dropped_section = [], 0, False
    for line in wikitext.split("\n"):
        stripped = line.strip()
        if stripped.startswith("{|"):
            table_depth += 1
        elif table_depth and stripped.startswith("|}"):
            table_depth -= 1
        elif not table_depth:
            heading = _HEADING_LINE.match(stripped)
            if heading and len(heading.group(1)) <= 2:
                in_dropped_section = heading.group(2).lower() in _DROP_SECTIONS
            if not in_dropped_section:
                kept.append(line)
    return "\n".join(kept)


def _is_dropped(node: Node) -> bool:
    if isinstance(node, Template):
        return True
    if isinstance(node, Tag):
        return str(node.tag).strip().lower() in _DROP_TAGS
    if isinstance(node, Wikilink):
        prefix, colon, _ = str(node.title).partition(":")
        return bool(colon) and prefix.strip().lower() in _DROP_LINK_NAMESPACES
    return False


def _prune(code: Wikicode) -> None:
    """Delete templates, refs, file/category links and the like, in place, at every depth."""
    kept: list[Node] = []
    for node in code.nodes:
        if _is_dropped(node):
            continue
        for child in node.__children__():
            _prune(child)
        kept.append(node)
    code.nodes = kept


def wikitext_to_text(wikitext: str) -> str:
    """Plain text of an article's wikitext; paragraphs separated by a blank line."""
    text = wikitext
    # mwparserfromhell leaves a malformed construct as literal text; once the markup around it
    # is gone a second parse usually resolves it. Three passes clear every article of the dump.
    for _ in range(3):
        code = mwparserfromhell.parse(_drop_blocks(text))
        _prune(code)
        text = code.strip_code(normalize=True, collapse=True)
        if not any(marker in text for marker in _MARKUP_LEFTOVERS):
            break
    text = _HTML_TAG.sub("", _MAGIC_WORD.sub("", text))
    # Bold/italic quotes the parser left behind: "''Iliad'''s" -> "Iliad's".
    text = _QUOTE_RUN.sub(lambda m: "'" if len(m.group()) % 2 else "", text)
    return tidy(text)


# ----------------------------------------------------------------------------- the dump


def _local(tag: str) -> str:
    return tag.rpartition("}")[2]


def _iter_pages(path: Path) -> Iterator[dict[str, str | None]]:
    """Stream ``<page>`` elements of a bz2 MediaWiki XML dump as flat dicts."""
    with bz2.open(path, "rb") as f:
        for _, elem in ET.iterparse(f, events=("end",)):
            if _local(elem.tag) != "page":
                continue
            page: dict[str, str | None] = {"redirect": None, "text": None}
            for child in elem:
                name = _local(child.tag)
                if name == "redirect":
                    page["redirect"] = child.get("title", "")
                elif name == "revision":
                    for rev_child in child:
                        if _local(rev_child.tag) == "text":
                            page["text"] = rev_child.text or ""
                elif name in ("title", "ns", "id"):
                    page[name] = child.text
            elem.clear()  # keep memory flat while streaming
            yield page


@dataclass(frozen=True, kw_only=True)
class WikiArticle:
    """One main-namespace article of a MediaWiki XML dump, markup intact."""

    page_id: str
    """The page's numeric id in the dump."""
    title: str
    wikitext: str
    """Raw wikitext of the latest revision."""


def wikipedia_articles(path: Path) -> tuple[list[WikiArticle], int]:
    """The articles of a bz2 MediaWiki XML dump in file order, and how many pages were skipped
    (redirects, other namespaces, empty and disambiguation pages)."""
    articles, skipped = [], 0
    for page in _iter_pages(path):
        wikitext = page["text"]
        is_article = page["ns"] == "0" and page["redirect"] is None and bool(wikitext)
        if not is_article or _DISAMBIGUATION.search(wikitext):
            skipped += 1
            continue
        articles.append(WikiArticle(page_id=page["id"], title=page["title"], wikitext=wikitext))
    return articles, skipped
