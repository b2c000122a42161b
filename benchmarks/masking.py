"""What building a micro-batch costs each objective: ms per ``make_batch`` at a recipe's shape.

    .venv/bin/python -m benchmarks.masking [--micro-batch-size 9] [--seq-length 2048] [--repeats 100]

The trainer builds every micro-batch of a step on the training device before the step's forward
passes (``training/loop.py``), so this is time the accelerator waits for at each step's start
(on a GPU, host time launching the kernels; they are small). Every objective runs on the same
tokens (real news text in the demo tokenizer's ids, tiled to the shape) with a vocabulary the size
of Llama-3's: 128,256 ids of which 256 are special (EuroBERT's tokenizer), where the demo
tokenizer's own ids mark word boundaries for whole-word masking. Side by side in one run, as ratios
to plain MLM, the objectives taking turns in each repeat. On a GPU the time is measured between
synchronisations around each batch.
Writes ``benchmarks/results/masking_<device>.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from megatron_ext import assets
from megatron_ext.objectives import CLM, MLM, MNTP, PhaseProgress, SpanMLM, Vocabulary, WholeWordMLM
from megatron_ext.tokenizer import TokenizerConfig, build_tokenizer

from benchmarks.results_file import write_record

LLAMA3_IDS, LLAMA3_SPECIAL = 128_256, 256

OBJECTIVES = {
    "mlm-40": MLM(mask_ratio=0.4),
    "mlm-40 80/10/10": MLM(mask_ratio=0.4, mask_replace_prob=0.8, random_replace_prob=0.1),
    "clm": CLM(),
    "wwm-40": WholeWordMLM(mask_ratio=0.4),
    "span-40": SpanMLM(mask_ratio=0.4),
    "mntp-20": MNTP(mask_ratio=0.2, mask_replace_prob=0.8, random_replace_prob=0.1),
}


class _Llama3SizedTokenizer:
    """The demo tokenizer's word boundaries and mask id in a vocabulary of Llama-3's size and
    special-id count (what the objectives read of a tokenizer)."""

    def __init__(self, demo) -> None:
        self.vocab_size = LLAMA3_IDS
        self.special_ids = frozenset(range(LLAMA3_IDS - LLAMA3_SPECIAL, LLAMA3_IDS))
        self.mask = LLAMA3_IDS - 1
        self.eod = LLAMA3_IDS - 2  # a special id, as Llama-3's <|end_of_text|> is
        starts, ends = demo.word_boundaries()
        padding = [True] * (LLAMA3_IDS - demo.vocab_size)
        self._boundaries = (starts + padding, ends + padding)

    def word_boundaries(self) -> tuple[list[bool], list[bool]]:
        return self._boundaries


def _tokens(tokenizer_model: Path, micro_batch_size: int, seq_length: int, device: torch.device):
    """The tokenizer, and real news text (gensim's Lee corpus, a registry download) in its ids,
    tiled to ``[micro_batch_size, seq_length]``."""
    if not tokenizer_model.exists():
        raise SystemExit(f"--tokenizer {tokenizer_model}: not found; run `make demo-data` for the demo tokenizer")
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_model=str(tokenizer_model)))
    news = assets.member("gensim", "gensim/test/test_data/lee_background.cor")
    texts = [line for line in news.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    ids = [i for document in tokenizer.tokenize_batch(texts) for i in document]
    need = micro_batch_size * seq_length
    ids = (ids * (need // len(ids) + 1))[:need]
    return tokenizer, torch.tensor(ids, device=device).view(micro_batch_size, seq_length)


def _time_s(build, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    build()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def time_interleaved(builds: dict, repeats: int, device: torch.device) -> dict[str, float]:
    """Median ms per build, the builds taking turns within each repeat (drift in the machine's
    speed then falls on all of them alike); one untimed warm-up each makes the per-device tables."""
    for build in builds.values():
        build()
    samples: dict[str, list[float]] = {name: [] for name in builds}
    for _ in range(repeats):
        for name, build in builds.items():
            samples[name].append(_time_s(build, device) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batch-size", type=int, default=9, help="sequences per micro-batch (the 1B recipe's)")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=100, help="timed batches per objective (median reported)")
    parser.add_argument("--tokenizer", type=Path, default=assets.data_dir() / "demo_tokenizer",
                        help="whose word boundaries whole-word masking reads (default: the demo tokenizer)")
    parser.add_argument("--output", type=Path, help="JSON path (default: results/masking_<device>.json)")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    demo, tokens = _tokens(args.tokenizer, args.micro_batch_size, args.seq_length, device)
    vocabulary = Vocabulary(_Llama3SizedTokenizer(demo), size=LLAMA3_IDS)
    batch = {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(tokens.shape, device=device)}
    def builder(objective):
        def build():
            generator = torch.Generator(device=device).manual_seed(0)
            return objective.make_batch(batch, progress=PhaseProgress(step=0, steps=1), vocabulary=vocabulary,
                                        generator=generator)
        return build

    medians = time_interleaved({name: builder(objective) for name, objective in OBJECTIVES.items()},
                               args.repeats, device)
    rows = {name: {"ms_per_micro_batch": round(ms, 3)} for name, ms in medians.items()}
    base = rows["mlm-40"]["ms_per_micro_batch"]
    name_device = torch.cuda.get_device_name() if device.type == "cuda" else f"cpu{os.cpu_count()}"
    print(f"building one micro-batch of {args.micro_batch_size} x {args.seq_length} on {name_device} "
          f"(vocabulary {LLAMA3_IDS:,} ids, {LLAMA3_SPECIAL} special; median of {args.repeats}):")
    for name, row in rows.items():
        row["ratio_to_mlm"] = round(row["ms_per_micro_batch"] / base, 3)
        print(f"  {name:<16} {row['ms_per_micro_batch']:8.2f} ms   x{row['ratio_to_mlm']:.2f} of mlm-40")
    record = {"device": name_device, "torch_threads": torch.get_num_threads(),
              "shape": [args.micro_batch_size, args.seq_length], "vocabulary_ids": LLAMA3_IDS,
              "special_ids": LLAMA3_SPECIAL, "repeats": args.repeats, "objectives": rows}
    write_record("masking", name_device, record, args.output)
    return record


if __name__ == "__main__":
    main()
