"""Download the paper's benchmarks from the Hugging Face hub into a folder, for a cluster without network.

On a machine that reaches the hub::

    python tools/fetch_benchmarks.py --output-dir /shared/benchmarks               # the paper's twelve
    python tools/fetch_benchmarks.py --tasks sst2 conll2003 squad --output-dir /shared/benchmarks
    python tools/fetch_benchmarks.py --list                                       # what would be fetched

Each split of each hub dataset is written with ``Dataset.save_to_disk`` to
``OUTPUT_DIR/<dataset id>/<config or default>/<split>/``; copies already there are kept, so an
interrupted fetch resumes. Copy the folder to the cluster and evaluate there with::

    python tools/evaluate.py --models ... --tasks paper --benchmarks-dir /shared/benchmarks --output-dir runs/eval

The datasets, their columns and splits are in :mod:`megatron_ext.eval.hub_datasets` and
docs/eval_suite.md ("The paper's benchmarks"). MS MARCO's and NQ's BEIR corpora are large
(8.8 M and 2.7 M passages); the conversion keeps only the passages the qrels judge.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_ext.eval.hub_datasets import BENCHMARKS, TASK_GROUPS, expand_tasks, fetch, hub_endpoint, hub_reachable
from megatron_ext.cli.entry import ArgumentParser, entry_point
from megatron_ext.config_loading import UserError


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["paper"], choices=[*BENCHMARKS, *TASK_GROUPS],
                        metavar="TASK", help=f"benchmarks among {list(BENCHMARKS)} or 'paper' (default: paper)")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="folder receiving <dataset id>/<config>/<split>/ (pass it as --benchmarks-dir later)")
    parser.add_argument("--list", action="store_true", help="print the hub splits the tasks need and exit")
    return parser


@entry_point("fetch_benchmarks.py")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = expand_tasks(args.tasks)
    if args.list:
        for name in names:
            bench = BENCHMARKS[name]
            print(f"{name:<10} {bench.family}  " + "; ".join(f"{role}: {source.describe()}"
                                                          for role, source in bench.sources.items()))
        return 0
    if args.output_dir is None:
        raise UserError("--output-dir is required (unless --list)")
    if not hub_reachable():
        raise UserError(f"the Hugging Face hub ({hub_endpoint()}) is not reachable from here (or HF_HUB_OFFLINE "
                        "is set); run this on a machine with network access")
    written = fetch(names, args.output_dir)
    print(f"{len(written)} split(s) fetched into {args.output_dir}; evaluate with --benchmarks-dir {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
