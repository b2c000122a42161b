"""Cost of the full start-up check of a Megatron ``.idx`` (sizes, every sequence pointer, document
boundaries) on a corpus of realistic size, next to the time Megatron itself takes to open it.

    .venv/bin/python -m benchmarks.index_check                       # 4 GB corpus: 2B uint16 tokens
    .venv/bin/python -m benchmarks.index_check --tokens 200000000 --mean-length 1000

Writes the index with Megatron-Core's own writer (``_IndexWriter``) for ``--tokens`` tokens in
sequences of geometric lengths (mean ``--mean-length``), and a sparse ``.bin`` of the matching size
(no disk is spent on token bytes: the check reads only the index and the file size). Times
``megatron_ext.data.index_checks.read_index`` (the check) and ``IndexedDataset`` construction
(Megatron's open) over ``--rounds`` rounds each, and writes
``benchmarks/results/index_check_<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2_000_000_000)
    parser.add_argument("--mean-length", type=int, default=1000, help="mean tokens per sequence (document)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "results" / "index_check_cpu.json")
    args = parser.parse_args(argv)
    from megatron.core.datasets.indexed_dataset import IndexedDataset, _IndexWriter

    from megatron_ext.data.index_checks import read_index

    rng = np.random.default_rng(0)
    lengths = rng.geometric(1 / args.mean_length, size=int(args.tokens / args.mean_length * 1.1)).astype(np.int32)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths, dtype=np.int64), args.tokens)) + 1]
    n_tokens = int(lengths.sum(dtype=np.int64))
    with tempfile.TemporaryDirectory() as tmp:
        prefix = f"{tmp}/corpus"
        with _IndexWriter(prefix + ".idx", np.uint16) as writer:
            writer.write(lengths.tolist(), None, list(range(len(lengths) + 1)))
        with open(prefix + ".bin", "wb") as f:
            f.truncate(n_tokens * 2)
        check, megatron_open = [], []
        for _ in range(args.rounds):
            start = time.perf_counter()
            read_index(prefix)
            check.append(time.perf_counter() - start)
            start = time.perf_counter()
            IndexedDataset(prefix, mmap=True)
            megatron_open.append(time.perf_counter() - start)
        idx_bytes = Path(prefix + ".idx").stat().st_size
    record = {"device": f"cpu{torch.get_num_threads()}", "tokens": n_tokens, "bin_gb": n_tokens * 2 / 1e9,
              "sequences": len(lengths), "idx_mb": idx_bytes / 1e6, "check_s_median": statistics.median(check),
              "megatron_open_s_median": statistics.median(megatron_open),
              "check_over_megatron_open": statistics.median(check) / statistics.median(megatron_open),
              "rounds": {"check_s": check, "megatron_open_s": megatron_open}}
    print(f"{n_tokens:,} tokens ({record['bin_gb']:.1f} GB .bin), {len(lengths):,} sequences ({record['idx_mb']:.0f} MB "
          f".idx): full check {record['check_s_median']:.3f} s, Megatron's open {record['megatron_open_s_median']:.3f} s")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
