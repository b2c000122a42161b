"""Wikipedia from a MediaWiki XML dump: the articles, their wikitext and its plain text.

The demo corpus (:mod:`megatron_ext.data.sample_corpus`) and the evaluation suite
(:mod:`megatron_ext.eval.suite`) both read gensim's shortened 2016 dump through this module, so
they see the same articles cleaned the same way. It owns:

- streaming the bz2 XML dump (stdlib parser) and picking the articles: main namespace, no
  redirects, no empty or disambiguation pages (:func:`wikipedia_articles`);
- wikitext to plain text (:func:`wikitext_to_text`): tables and citation sections cut by a line
  scan, templates, refs and file/category links pruned with mwparserfromhell, then :func:`tidy`;
- an article's sections with their heading paths and paragraphs, the shown text of its internal
  links marked so that it survives the cleaning (:func:`article_sections`, :func:`unmark`).
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
    "източници", "бележки", "литература", "външни препратки", "вижте също",  # the Bulgarian sample's
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


def _table_lines(wikitext: str) -> Iterator[tuple[str, bool]]:
    """Every line of ``wikitext`` and whether it belongs to a ``{| ... |}`` table (possibly nested),
    the delimiter lines included: a heading-like line inside a table is not a heading."""
    table_depth = 0
    for line in wikitext.split("\n"):
        stripped = line.strip()
        if stripped.startswith("{|"):
            table_depth += 1
            yield line, True
        elif table_depth and stripped.startswith("|}"):
            table_depth -= 1
            yield line, True
        else:
            yield line, bool(table_depth)


def _drop_blocks(wikitext: str) -> str:
    """Remove ``{| ... |}`` tables (possibly nested) and the sections in :data:`_DROP_SECTIONS`.

    Both are line-anchored syntax, so a line scan is exact. Doing it before parsing matters:
    mwparserfromhell gives up on many real tables (templates in cells, stray attributes) and
    returns them as text, and an unclosed HTML tag makes it nest every later heading inside it.
    """
    kept, in_dropped_section = [], False
    for line, in_table in _table_lines(wikitext):
        if in_table:
            continue
        heading = _HEADING_LINE.match(line.strip())
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


def wikipedia_articles(path: Path, *, namespaces: tuple[str, ...] = ("0",)) -> tuple[list[WikiArticle], int]:
    """The articles of a bz2 MediaWiki XML dump in file order, and how many pages were skipped
    (redirects, pages outside ``namespaces``, empty and disambiguation pages).

    ``namespaces`` are the dump's numeric keys: "0" the articles, "4" the project's own pages
    (help pages, discussion archives: prose too, which the Bulgarian sample mostly holds)."""
    articles, skipped = [], 0
    for page in _iter_pages(path):
        wikitext = page["text"]
        is_article = page["ns"] in namespaces and page["redirect"] is None and bool(wikitext)
        if not is_article or _DISAMBIGUATION.search(wikitext):
            skipped += 1
            continue
        articles.append(WikiArticle(page_id=page["id"], title=page["title"], wikitext=wikitext))
    return articles, skipped


# ----------------------------------------------------------------------------- sections and links

_LINK = re.compile(r"\[\[([^\[\]|]+)(?:\|([^\[\]]*))?\]\]")
_OPEN, _CLOSE = "\ue000", "\ue001"
"""Private-use characters wrapped around the shown text of internal links; wikitext_to_text keeps
them as plain text, so the links' positions survive the markup stripping."""


def _mark_link(match: re.Match) -> str:
    target, anchor = match.group(1), match.group(2)
    prefix, colon, _ = target.partition(":")
    # Interwiki and interlanguage links (wikt:, fr:, :Category:) are not article mentions; File: and
    # Category: links are dropped whole by wikitext_to_text, markers included.
    if (colon and (not prefix or prefix.islower())) or target.startswith("#"):
        return match.group(0)
    shown = anchor if anchor is not None and anchor.strip() else target.replace("_", " ")
    return f"[[{target}|{_OPEN}{shown}{_CLOSE}]]"


def unmark(text: str) -> tuple[str, list[tuple[int, int]]]:
    """Text without link markers, and the character spans the markers enclosed (the links' shown
    text in a :attr:`Section.paragraphs` paragraph)."""
    out, spans, start = [], [], None
    length = 0
    for piece in re.split(f"([{_OPEN}{_CLOSE}])", text):
        if piece == _OPEN:
            start = length
        elif piece == _CLOSE:
            if start is not None and length > start:
                spans.append((start, length))
            start = None
        else:
            out.append(piece)
            length += len(piece)
    return "".join(out), spans


@dataclass(frozen=True, kw_only=True)
class Section:
    """The paragraphs of one section of an article (the lead counts as one)."""

    article: str
    """``wikipedia:<page id>``."""
    title: str
    headings: tuple[str, ...]
    """Heading path from the top-level section down; empty for the lead."""
    paragraphs: tuple[str, ...]
    """Plain-text paragraphs with link markers (:func:`unmark` removes them)."""


def article_sections(article: WikiArticle) -> list[Section]:
    """The sections of ``article`` with paragraphs, cleaned by :func:`wikitext_to_text` piece by piece.

    The sections :func:`wikitext_to_text` drops (References, See also, ...) and their subsections
    are left out, as are sections without text; a heading's own text is cleaned like the body's.
    """
    # Cut at heading lines (outside tables, as _drop_blocks reads them).
    pieces: list[tuple[int, str, list[str]]] = [(0, "", [])]
    for line, in_table in _table_lines(_LINK.sub(_mark_link, article.wikitext)):
        heading = None if in_table else _HEADING_LINE.match(line.strip())
        if heading:
            pieces.append((len(heading.group(1)), line, []))
        else:
            pieces[-1][2].append(line)
    sections = []
    path: list[tuple[int, str]] = []
    dropped = False
    for level, heading_line, body in pieces:
        if level:
            # wikitext_to_text erases a top-level heading of the sections it drops (References,
            # See also, External links, ...): such a section and its subsections are skipped.
            heading = unmark(wikitext_to_text(heading_line))[0].strip()
            if level <= 2:
                dropped = not heading
            while path and path[-1][0] >= level:
                path.pop()
            path.append((level, heading))
            if dropped or not heading:
                continue
        text = wikitext_to_text("\n".join(body))
        paragraphs = tuple(p.strip() for p in text.split("\n\n") if p.strip())
        if paragraphs:
            sections.append(Section(
                article=f"wikipedia:{article.page_id}", title=article.title,
                headings=tuple(h for _, h in path), paragraphs=paragraphs,
            ))
    return sections
