"""The demo corpus: a small English pretraining corpus built from real text on package registries;
and the other languages of the multilingual sample.

The demo's three English sources, all fetched and sha256-verified through :mod:`megatron_ext.assets`
(nothing third-party is committed; a second build works offline from the cache):

- ``wikipedia``: the ~100 English Wikipedia articles of gensim's shortened 2016 dump. The XML is
  streamed with the stdlib parser, redirects, other namespaces and disambiguation pages are
  skipped, and the wikitext is stripped with mwparserfromhell (all in
  :mod:`megatron_ext.data.wikipedia`).
- ``lee_news``: the 300 Australian news articles of gensim's Lee background corpus.
- ``botchan``: the Project Gutenberg English translation of Natsume Soseki's *Botchan* shipped as
  sentencepiece's test text, without the Gutenberg boilerplate, re-flowed into paragraphs and cut
  into chapter parts of a few thousand characters.

(gensim's ``crime-and-punishment.txt`` is not used: it is a 3.8 KB excerpt in Russian.)

The multilingual sample (:data:`LANGUAGES`; ``tools/fetch_sample_data.py --multilingual`` builds
one corpus per language, one tokenizer over them all and one dataset prefix per language and split)
adds three languages, none of them selected unless named:

- ``bgwiki`` (Bulgarian): the three pages of gensim's shortened 2017 Bulgarian dump, one article and
  two project pages (an editing help page and a discussion archive of the village pump), one
  document per section (per discussion thread), cleaned like the English articles.
- ``ua_gec`` (Ukrainian): the 166 texts of the UA-GEC corpus' test partition (essays, letters and
  translations written by Ukrainian speakers) in their fluency-corrected form, annotator 1.
- ``kolaw`` (Korean): the Constitution of the Republic of Korea as KoNLPy ships it, cut into parts
  of about 1,500 characters along its chapters, sections and articles.

The output directory receives ``train.jsonl`` and ``valid.jsonl`` (one ``{"id", "source", "lang",
"title", "text"}`` object per line; ``text`` is what the preprocessing pipeline reads) and a
``manifest.json`` with per-source counts, asset hashes and licenses. Outputs are byte-for-byte
deterministic and written atomically; the held-out split is decided per document by a hash of its
id, so a document lands in the same split whichever sources are selected.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megatron_ext.config_loading import UserError
from megatron_ext.fileio import write_files
from megatron_ext import assets
from megatron_ext.data.wikipedia import (
    DUMP_ASSET,
    DUMP_MEMBER,
    EMPTY_PARENS,
    article_sections,
    tidy,
    unmark,
    wikipedia_articles,
    wikitext_to_text,
)

TRAIN_FILE = "train.jsonl"
VALID_FILE = "valid.jsonl"
MANIFEST_FILE = "manifest.json"


@dataclass(frozen=True, kw_only=True)
class Document:
    """One output document (one JSONL line)."""

    id: str
    """Stable identifier, ``<source>:<key>``; it also decides the train/valid split."""
    source: str
    """Name of the source in :data:`SOURCES`."""
    title: str | None
    """Article or chapter title; ``None`` for the untitled news articles."""
    text: str
    """Plain text; paragraphs separated by a blank line."""


@dataclass(frozen=True, kw_only=True)
class CorpusConfig:
    """What to build and where."""

    output_dir: Path
    """Directory receiving ``train.jsonl``, ``valid.jsonl`` and ``manifest.json``."""
    sources: tuple[str, ...] = ()
    """Names from :data:`SOURCES` to include; empty means the demo's, :data:`DEMO_SOURCES`. Output
    order is always canonical."""
    valid_fraction: float = 0.05
    """Expected share of documents in the held-out split, in [0, 1)."""
    min_chars: int = 200
    """Documents shorter than this after cleaning are dropped (and counted)."""
    book_part_chars: int = 4000
    """Chapters of the novel longer than this are cut into roughly equal paragraph groups."""
    overwrite: bool = False
    """Replace existing outputs whose content differs; without it that is an error."""

    def __post_init__(self) -> None:
        unknown = [name for name in self.sources if name not in SOURCES]
        if unknown:
            raise UserError(f"sources: unknown {unknown}; valid names are {list(SOURCES)}")
        if not 0.0 <= self.valid_fraction < 1.0:
            raise UserError(f"valid_fraction must be in [0, 1), got {self.valid_fraction}")
        if self.min_chars < 1 or self.book_part_chars < self.min_chars:
            raise UserError(
                f"need 1 <= min_chars <= book_part_chars, got {self.min_chars} and {self.book_part_chars}"
            )

    @property
    def selected(self) -> list[str]:
        return [name for name in SOURCES if name in (self.sources or DEMO_SOURCES)]


@dataclass(kw_only=True)
class Extracted:
    """What a source reader returns."""

    documents: list[Document]
    """Cleaned documents in file order, before the minimum-length filter."""
    skipped: int = 0
    """Entries that are not documents at all (redirects, other namespaces, disambiguation pages)."""


@dataclass(frozen=True, kw_only=True)
class CorpusSource:
    """One source of the demo corpus."""

    name: str
    """Key used in ``--sources``, document ids and the manifest."""
    lang: str
    """ISO 639-1 code of its language."""
    asset: str
    """Asset in :data:`megatron_ext.assets.ASSETS` holding the raw text."""
    member: str
    """Path of the raw file inside the asset's archive, or of a folder of them with ``folder``."""
    description: str
    """One line for the manifest and the report."""
    read: Callable[[Path, CorpusConfig], Extracted]
    """Turns the extracted raw file (or folder) into documents."""
    folder: bool = False
    """``member`` is a folder: every file under it is extracted and ``read`` gets the folder."""


@dataclass(kw_only=True)
class SourceStats:
    """Counts for one source (kept documents only, unless named otherwise)."""

    documents: int = 0
    characters: int = 0
    words: int = 0
    dropped_short: int = 0
    """Documents under ``min_chars`` after cleaning."""
    skipped: int = 0
    """Raw entries that are not documents (see :attr:`Extracted.skipped`)."""
    valid_documents: int = 0
    """Of ``documents``, how many went to the held-out split."""


@dataclass(kw_only=True)
class CorpusResult:
    """Outcome of :func:`build_corpus`."""

    paths: dict[str, Path]
    """``train``, ``valid`` and ``manifest`` output paths."""
    stats: dict[str, SourceStats]
    """Per source, in canonical order."""
    split_documents: dict[str, int]
    """Documents per split (``train``, ``valid``)."""
    unchanged: bool
    """True when the outputs already existed with exactly this content (nothing was written)."""
    total: SourceStats = field(init=False)

    def __post_init__(self) -> None:
        self.total = SourceStats()
        for stats in self.stats.values():
            for name in vars(self.total):
                setattr(self.total, name, getattr(self.total, name) + getattr(stats, name))


# ----------------------------------------------------------------------------- Wikipedia


def read_wikipedia(path: Path, config: CorpusConfig) -> Extracted:
    articles, skipped = wikipedia_articles(path)
    documents = [
        Document(
            id=f"wikipedia:{a.page_id}", source="wikipedia", title=a.title,
            text=wikitext_to_text(a.wikitext),
        )
        for a in articles
    ]
    return Extracted(documents=documents, skipped=skipped)


# ----------------------------------------------------------------------------- news


def read_lee_news(path: Path, config: CorpusConfig) -> Extracted:
    lines = path.read_text(encoding="utf-8").splitlines()
    return Extracted(documents=[
        Document(id=f"lee_news:{number:03d}", source="lee_news", title=None, text=tidy(line))
        for number, line in enumerate(lines, start=1)
        if line.strip()
    ])


# ----------------------------------------------------------------------------- Gutenberg novel

_GUTENBERG_START = re.compile(r"^\*\*\* ?START OF (?:THIS|THE) PROJECT GUTENBERG EBOOK.*$", re.MULTILINE)
_GUTENBERG_END = re.compile(r"^\*\*\* ?END OF (?:THIS|THE) PROJECT GUTENBERG EBOOK.*$", re.MULTILINE)
_GUTENBERG_LINES = re.compile(r"^(?:Produced by .*|End of (?:the )?Project Gutenberg.*)\n", re.MULTILINE)
# Editorial apparatus inside the book: translator's footnotes (whole lines, may span several),
# transcriber's notes on typos ("[A: Insitent]") and the markers pointing at them.
_FOOTNOTE_BLOCK = re.compile(r"^\s*\[(?:Footnote \d+|[A-Z]):[^\]]*\]\n", re.MULTILINE)
_NOTE_MARKER = re.compile(r" ?\[(?:\d+|[A-Z])\]")


def strip_gutenberg(raw: str) -> str:
    """The book's own text: between the START/END markers, without producer lines or apparatus."""
    start, end = _GUTENBERG_START.search(raw), _GUTENBERG_END.search(raw)
    if start is None or end is None or end.start() < start.end():
        raise ValueError("not a Project Gutenberg text: no '*** START/END OF ... GUTENBERG EBOOK' lines")
    body = raw[start.end():end.start()].strip("\n") + "\n"
    body = _GUTENBERG_LINES.sub("", body)
    body = _FOOTNOTE_BLOCK.sub("", body)
    return EMPTY_PARENS.sub("", _NOTE_MARKER.sub("", body))  # one marker stood alone: "shape ([D])"


def _is_heading(line: str) -> bool:
    """Headings of this transcription ("CHAPTER IV", "A NOTE BY THE TRANSLATOR") have no lowercase."""
    stripped = line.strip()
    return bool(stripped) and not any(c.islower() for c in stripped)


_SENTENCE_END = re.compile(r"""[.!?:;"')\]]$""")


def reflow(lines: list[str], width: int) -> list[str]:
    """Rebuild the paragraphs of text hard-wrapped at ``width`` whose blank lines were removed.

    A line ends a paragraph when it ends a sentence and the next line's first word would have
    fitted on it: a wrapping typesetter would have put the word there, so the break is deliberate.
    The sentence-end condition matters because this transcription is not wrapped greedily
    everywhere ("Come and see me sometime,|ha, ha, ha!").
    """
    paragraphs, current = [], []
    for i, line in enumerate(lines):
        line = line.rstrip()
        current.append(line.strip())
        next_words = lines[i + 1].split() if i + 1 < len(lines) else []
        if not next_words or (
            _SENTENCE_END.search(line) and len(line) + 1 + len(next_words[0]) <= width
        ):
            paragraphs.append(" ".join(current))
            current = []
    return paragraphs


def _split_even(paragraphs: list[str], max_chars: int) -> list[list[str]]:
    """Consecutive paragraph groups of about equal size, about ``max_chars`` at most.

    A group closes once it reaches ``total / ceil(total / max_chars)``, so a chapter is cut into
    as many parts as ``max_chars`` asks for without leaving a tiny last part.
    """
    total = sum(len(p) + 2 for p in paragraphs)
    goal = total / math.ceil(total / max_chars)
    groups, current, size = [], [], 0
    for paragraph in paragraphs:
        current.append(paragraph)
        size += len(paragraph) + 2
        if size >= goal:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


def _slug(heading: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", heading.lower()).strip("-")


def read_botchan(path: Path, config: CorpusConfig) -> Extracted:
    body = strip_gutenberg(path.read_text(encoding="utf-8-sig").replace("\r\n", "\n"))
    sections: list[tuple[str, list[str]]] = [("front matter", [])]
    for line in body.split("\n"):
        if _is_heading(line):
            sections.append((line.strip().rstrip("."), []))
        elif line.strip():
            sections[-1][1].append(line)
    width = max(len(line.rstrip()) for _, lines in sections for line in lines)
    out = Extracted(documents=[])
    for heading, lines in sections:
        paragraphs = reflow(lines, width)
        if not paragraphs:
            continue  # a heading directly followed by another one
        groups = _split_even(paragraphs, config.book_part_chars)
        for part, group in enumerate(groups, start=1):
            out.documents.append(Document(
                id=f"botchan:{_slug(heading)}:{part}", source="botchan",
                title=f"Botchan (Master Darling), {heading} ({part}/{len(groups)})",
                text="\n\n".join(group),
            ))
    return out


# ----------------------------------------------------------------------------- Bulgarian Wikipedia


def read_bgwiki(path: Path, config: CorpusConfig) -> Extracted:
    """One document per section: the sample's three pages are one article and two project pages,
    the larger a discussion archive whose sections are threads on unrelated topics."""
    articles, skipped = wikipedia_articles(path, namespaces=("0", "4"))
    out = Extracted(documents=[], skipped=skipped)
    for article in articles:
        for number, section in enumerate(article_sections(article), start=1):
            out.documents.append(Document(
                id=f"bgwiki:{article.page_id}:{number}", source="bgwiki",
                title=" / ".join((article.title, *section.headings)),
                text="\n\n".join(unmark(paragraph)[0] for paragraph in section.paragraphs),
            ))
    return out


# ----------------------------------------------------------------------------- Ukrainian essays


def read_ua_gec(path: Path, config: CorpusConfig) -> Extracted:
    """``path``: UA-GEC's ``target`` folder of one partition, ``NNNN.aK.txt`` per text and annotator.

    Annotator 1's correction of each text (a text corrected by two annotators would otherwise be
    in twice); its lines are paragraphs. None of the test partition is marked sensitive in the
    corpus' metadata.csv (7 texts of the train partition are).
    """
    return Extracted(documents=[
        Document(
            id=f"ua_gec:{file.name.split('.')[0]}", source="ua_gec", title=None,
            text=tidy("\n\n".join(file.read_text(encoding="utf-8").split("\n"))),
        )
        for file in sorted(path.glob("*.a1.txt"))
    ])


# ----------------------------------------------------------------------------- Korean constitution

_LAW_CHAPTER = re.compile(r"^제\d+장 ")
_LAW_SECTION = re.compile(r"^제\d+절 ")
_LAW_ARTICLE = re.compile(r"^제\d+조")
_LAW_PART_CHARS = 1500
"""Parts of about this many characters: the constitution's ~19,000 give ~15 parts, so that the
held-out split gets some (the novel's 4,000-character parts would give 7 here)."""


def read_kolaw(path: Path, config: CorpusConfig) -> Extracted:
    """The constitution (its title line, the preamble, 10 chapters, the supplementary provisions):
    articles (an article with its numbered clauses, one per line) grouped into parts of a chapter
    or section."""
    lines = [line.strip() for line in path.read_text(encoding="utf-8").replace("\r\n", "\n").split("\n")]
    law, *lines = [line for line in lines if line]
    sections: list[tuple[str, list[list[str]]]] = [("전문", [[]])]  # the preamble
    chapter = ""
    for line in lines:
        if _LAW_CHAPTER.match(line):
            chapter = line
            sections.append((chapter, [[]]))
        elif _LAW_SECTION.match(line):
            sections.append((f"{chapter}, {line}", [[]]))
        elif line.startswith("펼침") and "부칙" in line:  # "expand ... view" around it: page chrome
            sections.append(("부칙", [[]]))
        else:
            articles = sections[-1][1]
            if _LAW_ARTICLE.match(line) and articles[-1]:
                articles.append([])
            articles[-1].append(line)
    out = Extracted(documents=[])
    for number, (heading, articles) in enumerate(sections):
        paragraphs = ["\n".join(article) for article in articles if article]
        if not paragraphs:
            continue  # a chapter whose articles are all in its sections
        groups = _split_even(paragraphs, _LAW_PART_CHARS)
        for part, group in enumerate(groups, start=1):
            out.documents.append(Document(
                id=f"kolaw:{number}:{part}", source="kolaw",
                title=f"{law}, {heading} ({part}/{len(groups)})", text="\n\n".join(group),
            ))
    return out


# ----------------------------------------------------------------------------- registry and build

SOURCES: dict[str, CorpusSource] = {
    source.name: source
    for source in (
        CorpusSource(
            name="wikipedia", lang="en", asset=DUMP_ASSET, member=DUMP_MEMBER,
            description="English Wikipedia articles (2016 dump excerpt), markup stripped",
            read=read_wikipedia,
        ),
        CorpusSource(
            name="lee_news", lang="en", asset="gensim", member="gensim/test/test_data/lee_background.cor",
            description="Australian news articles (Lee background corpus)",
            read=read_lee_news,
        ),
        CorpusSource(
            name="botchan", lang="en", asset="sentencepiece-sdist", member="sentencepiece-0.2.3/test/botchan.txt",
            description="Botchan by Natsume Soseki, English translation (Project Gutenberg #8868)",
            read=read_botchan,
        ),
        CorpusSource(
            name="bgwiki", lang="bg", asset="gensim",
            member="gensim/test/test_data/bgwiki-latest-pages-articles-shortened.xml.bz2",
            description="Bulgarian Wikipedia (2017 dump excerpt: an article, a help page, a discussion "
                        "archive), one document per section, markup stripped",
            read=read_bgwiki,
        ),
        CorpusSource(
            name="ua_gec", lang="uk", asset="ua-gec", member="ua_gec/data/gec-fluency/test/target",
            folder=True,
            description="Ukrainian texts by native speakers (UA-GEC test partition, fluency-corrected)",
            read=read_ua_gec,
        ),
        CorpusSource(
            name="kolaw", lang="ko", asset="konlpy", member="konlpy/data/corpus/kolaw/constitution.txt",
            description="Constitution of the Republic of Korea (KoNLPy's kolaw corpus), in parts",
            read=read_kolaw,
        ),
    )
}

DEMO_SOURCES = ("wikipedia", "lee_news", "botchan")
"""The demo corpus: what an empty :attr:`CorpusConfig.sources` selects."""

LANGUAGES: dict[str, tuple[str, ...]] = {
    "en": ("wikipedia",),
    "bg": ("bgwiki",),
    "uk": ("ua_gec",),
    "ko": ("kolaw",),
}
"""The multilingual sample: its languages, in the order the example recipe adds them, and the
sources of each (English: Wikipedia alone, beside the Bulgarian Wikipedia)."""


def is_valid_document(doc_id: str, valid_fraction: float) -> bool:
    """Whether a document belongs to the held-out split: a fixed hash of its id, not its position."""
    bucket = int.from_bytes(hashlib.sha256(doc_id.encode("utf-8")).digest()[:8], "big")
    return bucket < valid_fraction * 2**64


def _jsonl(documents: list[Document]) -> bytes:
    return "".join(
        json.dumps({"id": d.id, "source": d.source, "lang": SOURCES[d.source].lang, "title": d.title,
                    "text": d.text}, ensure_ascii=False)
        + "\n"
        for d in documents
    ).encode("utf-8")


def build_corpus(config: CorpusConfig) -> CorpusResult:
    """Build (or confirm up to date) the demo corpus described by ``config``."""
    train: list[Document] = []
    valid: list[Document] = []
    stats: dict[str, SourceStats] = {}
    manifest_sources: dict[str, dict[str, object]] = {}
    for name in config.selected:
        source = SOURCES[name]
        raw = (assets.member_dir if source.folder else assets.member)(source.asset, source.member)
        extracted = source.read(raw, config)
        s = stats[name] = SourceStats(skipped=extracted.skipped)
        for doc in extracted.documents:
            if len(doc.text) < config.min_chars:
                s.dropped_short += 1
                continue
            s.documents += 1
            s.characters += len(doc.text)
            s.words += len(doc.text.split())
            if is_valid_document(doc.id, config.valid_fraction):
                s.valid_documents += 1
                valid.append(doc)
            else:
                train.append(doc)
        if not s.documents:
            raise UserError(f"source {name!r} gave no document of at least min_chars={config.min_chars}")
        asset = assets.ASSETS[source.asset]
        manifest_sources[name] = {
            "description": source.description,
            "lang": source.lang,
            "asset": source.asset,
            "asset_file": asset.filename,
            "asset_sha256": asset.sha256,
            "member": source.member,
            "license": asset.license,
            **vars(s),
        }
    if not train or (config.valid_fraction > 0 and not valid):
        raise UserError(
            f"valid_fraction={config.valid_fraction} over sources {config.selected} gives "
            f"{len(train)} train and {len(valid)} valid documents; both splits must be non-empty"
        )

    outputs = {"train": _jsonl(train), "valid": _jsonl(valid)}
    manifest = {
        "format": "JSON lines, one document per line: id, source, lang, title, text",
        "valid_fraction": config.valid_fraction,
        "min_chars": config.min_chars,
        "book_part_chars": config.book_part_chars,
        "files": {
            split: {
                "path": file, "documents": len(docs), "sha256": hashlib.sha256(outputs[split]).hexdigest(),
            }
            for split, file, docs in (("train", TRAIN_FILE, train), ("valid", VALID_FILE, valid))
        },
        "sources": manifest_sources,
    }
    outputs["manifest"] = (json.dumps(manifest, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    paths = {
        "train": config.output_dir / TRAIN_FILE,
        "valid": config.output_dir / VALID_FILE,
        "manifest": config.output_dir / MANIFEST_FILE,
    }

    # The manifest last: it vouches for the others.
    written = write_files({paths[key]: outputs[key] for key in ("train", "valid", "manifest")},
                          overwrite=config.overwrite)
    return CorpusResult(
        paths=paths, stats=stats, unchanged=not written,
        split_documents={"train": len(train), "valid": len(valid)},
    )


def format_report(result: CorpusResult) -> str:
    """Per-source and total counts, output paths and whether anything was written."""
    header = (
        f"{'source':<10} {'docs':>6} {'chars':>11} {'words':>9} {'dropped':>8} {'skipped':>8} {'valid':>6}"
    )
    rows = [header, "-" * len(header)]
    for name, s in [*result.stats.items(), ("total", result.total)]:
        rows.append(
            f"{name:<10} {s.documents:>6,} {s.characters:>11,} {s.words:>9,} "
            f"{s.dropped_short:>8,} {s.skipped:>8,} {s.valid_documents:>6,}"
        )
    rows.append("")
    for key, path in result.paths.items():
        count = f" ({result.split_documents[key]:,} documents)" if key in result.split_documents else ""
        rows.append(f"{key + ':':<9} {path}{count}")
    rows.append("outputs already up to date; nothing written" if result.unchanged else "outputs written")
    return "\n".join(rows)
