"""The multilingual sample built from pinned real registry text (``fetch_sample_data.py
--multilingual``): a corpus per language, one tokenizer trained on them all, a dataset prefix per
language and split whose tokens decode to that language's script, and whose tokenizer record names
that tokenizer."""

from __future__ import annotations

import contextlib
import io
import json
import unicodedata
import urllib.request
from pathlib import Path

import pytest
import requests

from megatron_ext.cli.fetch_sample_data import SPLITS, dataset_prefix, main
from megatron_ext.data.sample_corpus import LANGUAGES

# What the build prints (train / valid): documents exactly (they depend on the cleaning and the
# split only); tokens of the 8,192-id tokenizer within 5 % (they depend on the tokenizers library's
# BPE training as well).
DOCUMENTS = {"en": (92, 6), "bg": (65, 10), "uk": (152, 13), "ko": (17, 1)}
TOKENS = {"en": (661_090, 59_160), "bg": (64_077, 8_113), "uk": (87_465, 12_121), "ko": (15_019, 303)}
SCRIPT = {"en": "LATIN", "bg": "CYRILLIC", "uk": "CYRILLIC", "ko": "HANGUL"}
# Letters that tell the two Cyrillic languages apart: Ukrainian writes і ї є ґ and no ъ, Bulgarian
# the reverse (its sample quotes one Ukrainian і among 130,000 Cyrillic letters; ъ is 1.5 % of them).
ONLY_IN = {"uk": "іїєґ", "bg": "ъ"}


def _run(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def sample(multilingual_sample) -> dict:
    print(multilingual_sample["report"])  # the documented counts, shown with pytest -s
    return multilingual_sample


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _mtimes(folder: Path) -> dict[Path, int]:
    return {path: path.stat().st_mtime_ns for path in folder.rglob("*") if path.is_file()}


def _script_shares(text: str) -> dict[str, float]:
    letters = [c for c in text if c.isalpha()]
    scripts = [unicodedata.name(c, "?").split()[0] for c in letters]
    return {script: scripts.count(script) / len(letters) for script in set(scripts)}


def test_each_language_has_its_prefixes_with_its_script(sample):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_ext.tokenizer import TokenizerConfig, build_tokenizer

    out_dir = sample["dir"]
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_model=str(out_dir / "tokenizer")))
    assert tokenizer.vocab_size == 8192
    for lang in LANGUAGES:
        for split, documents, tokens in zip(SPLITS, DOCUMENTS[lang], TOKENS[lang]):
            prefix = dataset_prefix(out_dir, lang, split)
            assert prefix == str(out_dir / lang / f"{split}_text_document")
            dataset = IndexedDataset(prefix)
            assert len(dataset) == documents, (lang, split)
            assert abs(int(dataset.sequence_lengths.sum()) - tokens) <= 0.05 * tokens, (lang, split)
            # What the prefix holds decodes to the language's script (the whole split, EOD tokens dropped).
            ids = [int(t) for i in range(len(dataset)) for t in dataset[i] if t != tokenizer.eod]
            text = tokenizer.detokenize(ids)
            shares = _script_shares(text)
            assert shares.get(SCRIPT[lang], 0) > 0.9, (lang, split, shares)
            jsonl = [json.loads(line) for line in _text(out_dir / lang / f"{split}.jsonl").splitlines()]
            assert len(jsonl) == documents and {d["lang"] for d in jsonl} == {lang}
            assert {d["source"] for d in jsonl} == set(LANGUAGES[lang])
    for lang, other in (("bg", "uk"), ("uk", "bg")):
        text = _text(out_dir / lang / "train.jsonl").lower()
        cyrillic = sum("\u0400" <= c <= "\u04ff" for c in text)
        share = {key: sum(text.count(c) for c in ONLY_IN[key]) / cyrillic for key in (lang, other)}
        assert share[lang] > 0.01 and share[other] < 0.0001, (lang, share)


def test_every_prefix_records_the_one_tokenizer(sample):
    from megatron_ext.data.provenance import check_data_tokenizer, record_path
    from megatron_ext.tokenizer import TokenizerConfig, build_tokenizer

    out_dir = sample["dir"]
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_model=str(out_dir / "tokenizer")))
    prefixes = [dataset_prefix(out_dir, lang, split) for lang in LANGUAGES for split in SPLITS]
    assert check_data_tokenizer(prefixes, tokenizer) is None  # every prefix has a record, and it matches
    for prefix in prefixes:
        record = json.loads(record_path(prefix).read_text(encoding="utf-8"))
        assert record["fingerprint"] == tokenizer.fingerprint()
        assert record["reference"]["tokenizer_model"] == str(out_dir / "tokenizer")
    # The tokenizer was trained on every language: their words take at least two bytes per token (one
    # that never saw a script codes its letters byte by byte: 2 bytes a Cyrillic letter, 3 a Hangul syllable).
    for word in ("language", "календар", "мова", "대한민국"):
        assert len(tokenizer.tokenize(word)) <= len(word.encode("utf-8")) / 2, word


def test_report_names_each_language_and_a_second_run_is_offline(sample, monkeypatch):
    report, out_dir = sample["report"], sample["dir"]
    for lang, (train_docs, valid_docs) in DOCUMENTS.items():
        row = next(line for line in report.splitlines() if line.startswith(f"{lang} "))
        assert f" {train_docs:,} " in row and f" {valid_docs:,} " in row
        assert dataset_prefix(out_dir, lang, "valid") in row
    assert f"tokenizer: {out_dir / 'tokenizer'}" in report and "outputs written for en, bg, uk, ko" in report
    for lang in LANGUAGES:
        for entry in json.loads(_text(out_dir / lang / "manifest.json"))["sources"].values():
            assert entry["lang"] == lang and entry["license"] and entry["asset_sha256"]

    before = _mtimes(out_dir)

    def no_network(*args, **kwargs):
        raise AssertionError("the second run must not download anything")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    monkeypatch.setattr(requests, "get", no_network)
    assert "already up to date; nothing written" in _run(["--multilingual", "--output-dir", str(out_dir)])
    assert _mtimes(out_dir) == before


def test_multilingual_sources_are_fixed(tmp_path, capsys):
    assert main(["--multilingual", "--sources", "kolaw", "--output-dir", str(tmp_path / "out")]) == 2
    assert "--sources and --multilingual" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
