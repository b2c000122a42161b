"""One worker of a sharded preprocessing run (``tools/preprocess_data.py --shard-size``): the
program the launcher starts, as many copies as ``--workers``, on any node that sees the shard
directory. Each copy claims and tokenizes the shards of the plan that are neither done nor held by
a live worker, then exits; ``--finish`` writes the blend (and the merge the plan asks for) once
every shard is done::

    python -m megatron_ext.cli.preprocess_worker --shard-dir out/corpus.shards
    python -m megatron_ext.cli.preprocess_worker --shard-dir out/corpus.shards --finish
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from megatron_ext.claims import DEFAULT_TIMEOUT_S, ClaimPolicy
from megatron_ext.cli.entry import ArgumentParser, configure_logging, entry_point


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shard-dir", required=True, help="the run's {output_prefix}.shards directory")
    parser.add_argument("--finish", action="store_true",
                        help="write the blend (and the merge) once every shard is done; tokenize nothing")
    parser.add_argument("--claim-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help="a shard whose worker showed no sign of life for this long is done again [300]")
    return parser


@entry_point("preprocess_worker")
def main(argv: list[str] | None = None) -> int:
    from megatron_ext.data.shards import ShardDir, finish, run_worker, shard_progress

    args = build_parser().parse_args(argv)
    configure_logging(logging.INFO)
    shard_dir = ShardDir(Path(args.shard_dir))
    if args.finish:
        for what, path in finish(shard_dir).items():
            print(f"{what}  {path}", flush=True)
        return 0
    report = run_worker(shard_dir, policy=ClaimPolicy(timeout_s=args.claim_timeout))
    print(f"worker: {len(report.done)} shard(s) tokenized"
          + (f", {len(report.held_elsewhere)} held by other workers" if report.held_elsewhere else "")
          + f"; {shard_progress(shard_dir).format()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
