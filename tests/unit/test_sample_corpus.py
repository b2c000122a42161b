"""The demo corpus built from real registry text: sources, cleaning, split, determinism, CLI."""

from __future__ import annotations

import contextlib
import io
import json
import re
import urllib.request
from pathlib import Path

import pytest
import requests

from megatron_ext.data.sample_corpus import DEMO_SOURCES, is_valid_document
from megatron_ext.cli.fetch_sample_data import main

FILES = ("train.jsonl", "valid.jsonl", "manifest.json")


def _run(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


def _snapshot(out_dir: Path) -> dict[str, tuple[bytes, int]]:
    return {name: ((out_dir / name).read_bytes(), (out_dir / name).stat().st_mtime_ns) for name in FILES}


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    out_dir = tmp_path_factory.mktemp("demo_corpus")
    report = _run(["--output-dir", str(out_dir)])
    train, valid = _read_jsonl(out_dir / "train.jsonl"), _read_jsonl(out_dir / "valid.jsonl")
    return {
        "dir": out_dir, "report": report, "train": train, "valid": valid,
        "docs": {name: [d for d in train + valid if d["source"] == name] for name in DEMO_SOURCES},
        "manifest": json.loads((out_dir / "manifest.json").read_text(encoding="utf-8")),
    }


def test_every_source_yields_plausible_documents(corpus):
    docs = corpus["docs"]
    assert 90 <= len(docs["wikipedia"]) <= 110  # 206 pages: ~100 redirects, 1 project page, 8 disambiguations
    assert len(docs["lee_news"]) == 300
    assert 55 <= len(docs["botchan"]) <= 80
    chars = {name: sum(len(d["text"]) for d in items) for name, items in docs.items()}
    assert chars["wikipedia"] > 2_000_000 and chars["lee_news"] > 300_000 and chars["botchan"] > 200_000
    assert min(len(d["text"]) for items in docs.values() for d in items) >= 200

    manifest = corpus["manifest"]
    for name, items in docs.items():
        entry = manifest["sources"][name]
        assert entry["documents"] == len(items) and entry["characters"] == chars[name]
        assert entry["asset_sha256"] and entry["license"]
    assert manifest["sources"]["botchan"]["dropped_short"] == 1  # the title page
    assert manifest["files"]["valid"]["documents"] == len(corpus["valid"])
    assert set(manifest["sources"]) == set(DEMO_SOURCES)  # the other languages only when named
    for name in [*DEMO_SOURCES, "total", str(corpus["dir"] / "train.jsonl"), str(corpus["dir"] / "manifest.json")]:
        assert name in corpus["report"]


def test_wikipedia_text_has_no_markup(corpus):
    docs = corpus["docs"]["wikipedia"]
    leftovers = ("[[", "]]", "{{", "}}", "{|", "|}", "<ref", "</", "/>", "''", "__TOC__", "thumb|",
                 "Category:")
    for doc in docs:
        found = [marker for marker in leftovers if marker in doc["text"]]
        assert not found, f"{doc['title']}: markup {found} left in the text"
        lines = set(doc["text"].split("\n"))
        assert not lines & {"References", "External links", "See also", "Further reading"}, doc["title"]
    titles = {d["title"] for d in docs}
    assert "AccessibleComputing" not in titles  # a redirect
    assert not [t for t in titles if "disambiguation" in t]
    anarchism = next(d for d in docs if d["title"] == "Anarchism")
    assert anarchism["id"] == "wikipedia:12"
    assert anarchism["text"].startswith("Anarchism is a political philosophy that advocates self-governed")
    assert sum("\n\n" in d["text"] for d in docs) > 0.9 * len(docs)  # paragraph breaks survive


def test_botchan_is_clean_reflowed_prose(corpus):
    docs = corpus["docs"]["botchan"]
    text = "\n\n".join(d["text"] for d in docs)
    for boilerplate in ("Gutenberg", "*** ", "Produced by", "[Footnote", "Insitent", "\ufeff"):
        assert boilerplate not in text
    assert not re.search(r"\[(?:\d+|[A-Z])\]|\(\)", text)  # footnote and transcriber-note markers
    paragraphs = text.split("\n\n")
    assert not [p for p in paragraphs if "\n" in p or p[0].islower()]  # no hard wraps, no false breaks
    assert "I have been playing always a losing game since my childhood." in text
    assert '"You\'re the man newly appointed, eh? Come and see me sometime, ha, ha, ha!"' in text
    ids = [d["id"] for d in docs]
    assert ids[0] == "botchan:a-note-by-the-translator:1" and ids[-1].startswith("botchan:chapter-xi:")
    assert max(len(d["text"]) for d in docs) < 8000


def test_jsonl_records_and_held_out_split(corpus):
    train, valid = corpus["train"], corpus["valid"]
    for doc in train + valid:
        assert set(doc) == {"id", "source", "lang", "title", "text"} and doc["text"].strip()
        assert doc["lang"] == "en"
    train_ids, valid_ids = {d["id"] for d in train}, {d["id"] for d in valid}
    assert len(train_ids) == len(train) and len(valid_ids) == len(valid)
    assert not train_ids & valid_ids
    assert 0.01 * len(train) < len(valid) < 0.12 * len(train)
    assert all(is_valid_document(i, 0.05) for i in valid_ids)
    assert not any(is_valid_document(i, 0.05) for i in train_ids)


def test_second_run_is_offline_and_byte_identical(corpus, monkeypatch):
    before = _snapshot(corpus["dir"])

    def no_network(*args, **kwargs):
        raise AssertionError("the second run must not download anything")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    monkeypatch.setattr(requests, "get", no_network)  # what the asset downloads use (pooch)
    report = _run(["--output-dir", str(corpus["dir"])])
    assert "up to date" in report  # the regenerated bytes equal the first run's
    assert _snapshot(corpus["dir"]) == before


def test_subset_overwrite_and_atomic_outputs(corpus, tmp_path, capsys):
    argv = ["--output-dir", str(tmp_path), "--sources", "botchan", "lee_news"]
    report = _run(argv)
    assert "wikipedia" not in report and "outputs written" in report
    valid = _read_jsonl(tmp_path / "valid.jsonl")
    # The split is a property of each document, independent of which sources are selected.
    assert {d["id"] for d in valid} == {d["id"] for d in corpus["valid"] if d["source"] != "wikipedia"}
    original = (tmp_path / "valid.jsonl").read_bytes()
    (tmp_path / "valid.jsonl").write_text("edited\n", encoding="utf-8")
    capsys.readouterr()
    assert main(argv) == 2
    assert "fetch_sample_data.py: error: " in (err := capsys.readouterr().err) and "--overwrite" in err
    _run([*argv, "--overwrite"])
    assert (tmp_path / "valid.jsonl").read_bytes() == original
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(FILES)  # no temporary files left


def test_bad_arguments_are_rejected_before_any_work(tmp_path, capsys):
    out_dir = tmp_path / "out"
    assert main(["--output-dir", str(out_dir), "--sources", "wikipedia", "news"]) == 2
    assert re.search(r"'news'.*valid names are \['wikipedia', 'lee_news', 'botchan', 'bgwiki', 'ua_gec', 'kolaw'\]",
                     capsys.readouterr().err)
    assert main(["--output-dir", str(out_dir), "--valid-fraction", "1.0"]) == 2
    assert "fetch_sample_data.py: error: valid_fraction" in capsys.readouterr().err
    assert not out_dir.exists()
