"""Corpus-scale preprocessing (``tools/preprocess_data.py --shard-size``): per-core speed against the
raw batch tokenizer, scaling over workers with the serial share it implies, and peak memory
against the document count.

    .venv/bin/python -m benchmarks.preprocess_shards [--repeat 4] [--scale-repeat 16] [--workers 1 2]
        [--documents 10000 100000 1000000] [--parts per_core scaling memory]

- per core: one shard worker's loop (reading JSONL, tokenizing, writing and publishing the
  ``.bin``/``.idx``) against ``tokenize_batch`` alone (the Rust batch encode, in the worker's
  batches of 256 documents, ids to numpy), one thread, same process and tokenizer, on the same texts (the demo corpus ``--repeat`` times), rounds alternating:
  the ratio of their best rounds (target >= 0.9);
- scaling (meaningful on an otherwise idle machine: the load average is recorded beside each row):
  the whole command through the local launcher with N workers (plan, workers started as
  processes, blend), wall time from the command's start to its end, for each N of ``--workers``;
  the serial share ``s`` that Amdahl's law gives for the largest N (``speedup = 1 / (s + (1 - s) / N)``)
  and the speedup it implies at 100 and 1,000 workers; beside it the serial part measured directly
  (planning and writing the blend, which no worker shares) as a share of the one-worker time;
- memory: the peak RSS of one worker process (and of the merge) on corpora of N tiny documents
  (``--documents``): flat when it does not grow with N.

Writes ``benchmarks/results/preprocess_shards_cpu<cores>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.preprocess import _ensure_demo_inputs

REPO = Path(__file__).resolve().parent.parent

def _config(inputs, tokenizer_dir: Path, prefix: Path, **kwargs):
    from megatron_ext.data.preprocess import PreprocessConfig
    from megatron_ext.tokenizer import TokenizerConfig

    return PreprocessConfig(inputs=tuple(str(i) for i in inputs), output_prefix=str(prefix),
                            tokenizer=TokenizerConfig(tokenizer_model=str(tokenizer_dir)), append_eod=True,
                            progress=False, overwrite=True, **kwargs)


def per_core(corpus: Path, tokenizer_dir: Path, repeat: int, texts: list[str], tmp: Path, rounds: int = 5) -> dict:
    """One shard worker's loop (read, tokenize, write, publish) against ``tokenize_batch`` alone, in
    this process, one thread, same tokenizer object, rounds alternating; the best round of each."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before the tokenizer loads: one thread, both sides
    from megatron_ext.data import shards
    from megatron_ext.data.preprocess import CHUNK_DOCUMENTS, ChunkEncoder, PreprocessSummary, chunked, write_datasets
    from megatron_ext.data.readers import iter_records

    big = tmp / "corpus_x.jsonl"
    big.write_bytes(corpus.read_bytes() * repeat)
    plan = shards.plan_corpus(_config([big], tokenizer_dir, tmp / "core"), 1 << 40)
    encoder = ChunkEncoder(plan.config, None)
    encoder.tokenizer.tokenize_batch(texts[:32], add_special_tokens=True)  # warm-up
    raw_s, worker_s = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        raw_tokens = 0
        for i in range(0, len(texts), CHUNK_DOCUMENTS):  # the worker's batches, ids as one numpy array each
            ids = encoder.tokenizer.tokenize_batch(texts[i:i + CHUNK_DOCUMENTS], add_special_tokens=True)
            flat: list[int] = []
            for piece in ids:
                flat.extend(piece)
            raw_tokens += np.asarray(flat, dtype=np.int32).size
        raw_s.append(time.perf_counter() - start)
        summary = PreprocessSummary()
        start = time.perf_counter()
        records = iter_records(str(big), fmt="jsonl", json_keys=("text",))
        write_datasets(plan.config, map(encoder.encode_chunk, chunked(records, CHUNK_DOCUMENTS)),
                       {"text": str(tmp / "core")}, tokenizer=encoder.tokenizer, summary=summary)
        worker_s.append(time.perf_counter() - start)
    # The worker's tokens include the EODs the raw side does not make (none where a document ends in one).
    assert abs(summary.tokens - summary.documents - raw_tokens) < 0.01 * raw_tokens, (summary.tokens, raw_tokens)
    raw = {"tokens": raw_tokens, "seconds": min(raw_s), "tokens_per_s": raw_tokens / min(raw_s)}
    worker = {"tokens": summary.tokens, "seconds": min(worker_s), "tokens_per_s": raw_tokens / min(worker_s)}
    return {"raw_tokenizer_1_thread": raw, "shard_worker": worker, "rounds": rounds,
            "ratio_to_raw_tokenizer": raw["seconds"] / worker["seconds"]}


def scaling(corpus: Path, tokenizer_dir: Path, repeat: int, workers: list[int], tmp: Path) -> dict:
    """The whole command with each worker count, on ``repeat`` copies of the corpus (4 shards each)."""
    from megatron_ext.data import shards

    inputs = []
    for i in range(repeat):  # one input per repeat: shards of ~1/4 of the demo corpus each
        inputs.append(tmp / f"part{i}.jsonl")
        inputs[-1].write_bytes(corpus.read_bytes())
    shard_size = str(corpus.stat().st_size // 4 + 1)
    rows = []
    for n in workers:
        prefix = tmp / f"scale_w{n}"
        command = [sys.executable, "-m", "megatron_ext.cli.preprocess_data", "--input", *map(str, inputs),
                   "--output-prefix", str(prefix), "--tokenizer-model", str(tokenizer_dir), "--append-eod",
                   "--shard-size", shard_size, "--workers", str(n), "--launcher", "local"]
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True, text=True, cwd=REPO)
        seconds = time.perf_counter() - start
        shard_dir = shards.ShardDir.for_prefix(str(prefix))
        done = shards.shard_progress(shard_dir)
        plan_config = shards.ShardDir.for_prefix(str(prefix)).read_plan().config
        start = time.perf_counter()
        shards.plan_corpus(plan_config, int(shard_size))  # the first call imports the readers (once per driver)
        cold_plan_seconds = time.perf_counter() - start
        start = time.perf_counter()
        plan = shards.plan_corpus(plan_config, int(shard_size))
        plan_seconds = time.perf_counter() - start  # what the plan costs per corpus: the serial part that grows
        start = time.perf_counter()
        shards.finish(shard_dir)
        finish_seconds = time.perf_counter() - start
        rows.append({"workers": n, "shards": len(plan.shards), "tokens": done.tokens, "seconds": seconds,
                     "load_average_1min_after": os.getloadavg()[0],
                     "tokens_per_s": done.tokens / seconds, "plan_seconds": plan_seconds,
                     "plan_seconds_first_call": cold_plan_seconds,
                     "finish_seconds": finish_seconds})
        print(f"workers={n}: {done.tokens:,} tokens in {seconds:.1f} s = {done.tokens / seconds:,.0f} tokens/s "
              f"({len(plan.shards)} shards)")
    one, last = rows[0], rows[-1]
    result: dict = {"rows": rows}
    if last["workers"] > one["workers"]:
        n = last["workers"] / one["workers"]
        speedup = one["seconds"] / last["seconds"]
        serial = min(1.0, max(0.0, (n / speedup - 1) / (n - 1)))
        result["amdahl"] = {"speedup": speedup, "over_workers": n, "serial_share": serial,
                            "implied_speedup": {str(k): 1 / (serial + (1 - serial) / k) for k in (100, 1000)}}
        print(f"speedup {speedup:.2f}x over {n:.0f}x workers: serial share {serial:.3f}, implied speedup "
              + ", ".join(f"{v:,.1f}x at {k}" for k, v in result["amdahl"]["implied_speedup"].items()))
    direct = (one["plan_seconds"] + one["finish_seconds"]) / one["seconds"]
    result["measured_serial"] = {"plan_plus_blend_share_of_one_worker_time": direct,
                                 "implied_speedup": {str(k): 1 / (direct + (1 - direct) / k) for k in (100, 1000)}}
    return result


def memory(tokenizer_dir: Path, documents: list[int], tmp: Path) -> list[dict]:
    """Peak RSS of one worker process and of the merge over corpora of ``n`` tiny documents."""
    from megatron_ext.data import shards

    rows = []
    for n in documents:
        path = tmp / f"tiny_{n}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for i in range(n):
                f.write(f'{{"text": "doc {i} of few words"}}\n')
        config = _config([path], tokenizer_dir, tmp / f"mem_{n}")
        shards.prepare(shards.plan_corpus(config, 1 << 40, merge=True), overwrite=True)
        shard_dir = str(shards.ShardDir.for_prefix(config.output_prefix).root)
        row = {"documents": n}
        for what in ("worker", "merge"):
            # A process of its own per measure (this module's --probe), so that its peak is its own.
            out = subprocess.run([sys.executable, "-m", "benchmarks.preprocess_shards", "--probe", what,
                                  "--shard-dir", shard_dir], check=True, capture_output=True, text=True, cwd=REPO)
            row[what] = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{n:>10,} documents: worker peak RSS {row['worker']['peak_rss_mb']:.0f} MB "
              f"({row['worker']['seconds']:.1f} s), merge {row['merge']['peak_rss_mb']:.0f} MB")
    return rows


def probe(shard_dir: Path, what: str) -> dict:
    """Run one worker over ``shard_dir`` (``what="worker"``) or its finish with the merge
    (``"merge"``) in this process (``--probe``): its peak RSS and seconds."""
    from megatron_ext.data import shards

    shard_dir = shards.ShardDir(shard_dir)
    start = time.perf_counter()
    if what == "worker":
        shards.run_worker(shard_dir)
    else:
        shards.finish(shard_dir)
    seconds = time.perf_counter() - start
    # VmHWM: this process's own peak (ru_maxrss would report the parent's at the fork, when larger).
    with open("/proc/self/status", encoding="ascii") as status:
        peak_kb = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    return {"peak_rss_mb": peak_kb / 1024, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=4, help="times the demo corpus is read")
    parser.add_argument("--scale-repeat", type=int, default=16, help="copies of the demo corpus the scaling reads")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    parser.add_argument("--documents", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--parts", nargs="+", choices=("per_core", "scaling", "memory"),
                        default=["per_core", "scaling", "memory"], help="what to measure [all three]")
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" /
                                                f"preprocess_shards_cpu{os.cpu_count()}.json"))
    parser.add_argument("--probe", choices=("worker", "merge"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--shard-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe is not None:  # one measure of memory(), in the process memory() started for it
        print(json.dumps(probe(args.shard_dir, args.probe)))
        return 0

    corpus, tokenizer_dir = _ensure_demo_inputs()
    texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()] * args.repeat
    core = scale = rss = None
    with tempfile.TemporaryDirectory() as tmp:
        if "per_core" in args.parts:
            core = per_core(corpus, tokenizer_dir, args.repeat, texts, Path(tmp))
            print(f"per core: raw tokenizer {core['raw_tokenizer_1_thread']['tokens_per_s']:,.0f} tokens/s | shard "
                  f"worker {core['shard_worker']['tokens_per_s']:,.0f} tokens/s | ratio "
                  f"{core['ratio_to_raw_tokenizer']:.2f}")
        if "scaling" in args.parts:
            scale = scaling(corpus, tokenizer_dir, args.scale_repeat, args.workers, Path(tmp))
        if "memory" in args.parts:
            rss = memory(tokenizer_dir, args.documents, Path(tmp))
    result = {
        "benchmark": "preprocess_shards",
        "corpus": f"demo corpus x{args.repeat} ({len(texts)} documents); memory: tiny one-line documents",
        "tokenizer": tokenizer_dir.name,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
                 "load_average_at_end": os.getloadavg()},
        "per_core": core, "scaling": scale, "memory": rss,
        "target": "shard worker >= 0.9 x the raw one-thread tokenizer; worker and merge peak RSS flat in the "
                  "document count",
    }
    output = Path(args.output)
    if output.is_file():  # parts not measured this time keep their last figures
        result = {**json.loads(output.read_text()), **{k: v for k, v in result.items() if v is not None}}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
