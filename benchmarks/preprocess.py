"""Preprocessing throughput: end to end vs the tokenizer's raw batch encode, same texts, same cores.

    .venv/bin/python -m benchmarks.preprocess [--repeat 4] [--workers 1 2]

For each worker count N it measures, in one run:
- raw:        ``tokenize_batch`` over all texts, in a fresh process whose tokenizer thread pool
              has N threads (``RAYON_NUM_THREADS=N``) -- the ceiling for N cores;
- end to end: ``tools/preprocess_data.py`` logic with ``--workers N`` (reading JSONL, tokenizing in
              N processes, writing ``.bin``/``.idx``), start-up included.
End-to-end tokens/s is measured after start-up (imports, tokenizer loading, worker spawn), as
Megatron-LM's tool reports it; the start-up seconds and the rate including them are recorded too.
The corpus is the demo corpus repeated ``--repeat`` times (passed as repeated inputs) so that the
run is long enough for process start-up not to dominate. Writes
``benchmarks/results/preprocess_<host>.json`` with ``ratio_to_raw_tokenizer`` per worker count.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from megatron_ext import assets
from megatron_ext.tokenizer import TokenizerConfig, build_tokenizer

REPO = Path(__file__).resolve().parent.parent


def _ensure_demo_inputs() -> tuple[Path, Path]:
    corpus = assets.data_dir() / "demo_corpus" / "train.jsonl"
    tokenizer_dir = assets.data_dir() / "demo_tokenizer"
    if not corpus.exists():
        from megatron_ext.cli import fetch_sample_data

        fetch_sample_data.main(["--output-dir", str(corpus.parent)])
    if not (tokenizer_dir / "tokenizer.json").exists():
        from megatron_ext.cli import train_tokenizer

        train_tokenizer.main(["--input", str(corpus), "--output-dir", str(tokenizer_dir), "--vocab-size", "8192"])
    return corpus, tokenizer_dir


def _raw_worker(tokenizer_dir: str, texts: list[str], threads: int, queue) -> None:
    # The Rust thread pool reads these once, at first use: hence a fresh process per setting.
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_model=tokenizer_dir))
    tokenizer.tokenize_batch(texts[:32], add_special_tokens=True)  # warm-up
    start = time.perf_counter()
    ids = tokenizer.tokenize_batch(texts, add_special_tokens=True)
    seconds = time.perf_counter() - start
    queue.put((sum(len(x) for x in ids), seconds))


def raw_throughput(tokenizer_dir: Path, texts: list[str], threads: int) -> dict:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_raw_worker, args=(str(tokenizer_dir), texts, threads, queue))
    proc.start()
    tokens, seconds = queue.get()
    proc.join()
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def end_to_end_throughput(corpus: Path, tokenizer_dir: Path, repeat: int, workers: int, out_dir: Path) -> dict:
    from megatron_ext.data.preprocess import PreprocessConfig, preprocess

    config = PreprocessConfig(
        inputs=(str(corpus),) * repeat, output_prefix=str(out_dir / f"bench_w{workers}"),
        tokenizer=TokenizerConfig(tokenizer_model=str(tokenizer_dir)), workers=workers,
        append_eod=True, overwrite=True, progress=False,
    )
    summary = preprocess(config)
    return {"tokens": summary.tokens, "seconds": summary.seconds, "startup_seconds": summary.startup_seconds,
            "tokens_per_s": summary.tokens_per_second, "tokens_per_s_incl_startup": summary.tokens / summary.seconds,
            "documents": summary.documents}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=4, help="times the demo corpus is read")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / f"preprocess_cpu{os.cpu_count()}.json"))
    args = parser.parse_args(argv)

    corpus, tokenizer_dir = _ensure_demo_inputs()
    texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()] * args.repeat
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for workers in args.workers:
            raw = raw_throughput(tokenizer_dir, texts, workers)
            e2e = end_to_end_throughput(corpus, tokenizer_dir, args.repeat, workers, Path(tmp))
            assert raw["tokens"] == e2e["tokens"] - e2e["documents"], "raw and end-to-end saw different tokens"
            ratio = e2e["tokens_per_s"] / raw["tokens_per_s"]
            rows.append({"workers": workers, "raw_tokenizer": raw, "end_to_end": e2e, "ratio_to_raw_tokenizer": ratio})
            print(f"workers={workers}: raw {raw['tokens_per_s']:,.0f} tok/s | end-to-end "
                  f"{e2e['tokens_per_s']:,.0f} tok/s | ratio {ratio:.2f}")
    result = {
        "benchmark": "preprocess",
        "corpus": f"demo corpus x{args.repeat} ({len(texts)} documents)",
        "tokenizer": str(tokenizer_dir.name),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
        "rows": rows,
        "ratio_to_raw_tokenizer": {str(r["workers"]): round(r["ratio_to_raw_tokenizer"], 3) for r in rows},
        "target": "end-to-end >= 0.70 x raw tokenizer throughput at 2 workers",
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
