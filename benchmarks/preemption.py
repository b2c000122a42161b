"""What a preemption costs: steps lost and the time from SIGTERM to a complete checkpoint.

    .venv/bin/python -m benchmarks.preemption                    # CPU: the demo model and 210M
    .venv/bin/python -m benchmarks.preemption --sizes demo       # the demo model only

For each size, ``pretrain_encoder.py`` trains on real text (300 news articles, a BPE tokenizer of
8,192 ids trained on them) with asynchronous saves every ``--save-interval`` steps, and gets
SIGTERM (what SLURM sends at a time limit, on preemption and on ``scancel``) once it has logged
step ``--signal-at``, a step past a save. Twice, side by side:
- ``handler_off`` (``--no-exit-signal-handler``, what every run did before): the process dies at
  once; the steps since the last complete checkpoint are lost;
- ``handler_on`` (the default): the step in flight finishes and is saved, then the process exits
  75. ``signal_to_exit_s`` is from the signal to the process's exit, the checkpoint published.
Writes ``benchmarks/results/preemption_<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.results_file import write_record

REPO = Path(__file__).resolve().parent.parent


SIZES = {  # model section, data shape: the demo recipe's, and the paper's 210M at a CPU-sized batch
    "demo": ({"preset": "tiny", "vocab_size": 8192}, {"seq_length": 128, "micro_batch_size": 8, "global_batch_size": 16}),
    "210m": ({"preset": "210m", "vocab_size": 8192}, {"seq_length": 128, "micro_batch_size": 1, "global_batch_size": 1}),
}


def build_corpus(root: Path) -> dict[str, str]:
    """Tokenizer and indexed dataset of gensim's 300 Lee news articles (fetched through PyPI)."""
    from megatron_ext import assets
    from megatron_ext.cli import train_tokenizer
    from megatron_ext.data.preprocess import PreprocessConfig, preprocess
    from megatron_ext.tokenizer import TokenizerConfig

    source = assets.member("gensim", "gensim/test/test_data/lee_background.cor")
    texts = [line.strip() for line in source.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    jsonl = root / "news.jsonl"
    jsonl.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    assert train_tokenizer.main(["--input", str(jsonl), "--output-dir", str(root / "tok"), "--vocab-size", "8192",
                                 "--no-progress"]) == 0
    preprocess(PreprocessConfig(inputs=(str(jsonl),), output_prefix=str(root / "news"),
                                tokenizer=TokenizerConfig(tokenizer_model=str(root / "tok")), append_eod=True,
                                progress=False))
    return {"tokenizer": str(root / "tok"), "data": str(root / "news_text_document")}


def run_once(recipe: dict, run_dir: Path, *, signal_at: int, handler: bool) -> dict:
    from megatron_ext.checkpoint.reader import latest_checkpoint

    path = run_dir / "recipe.json"
    run_dir.mkdir(parents=True)
    path.write_text(json.dumps(recipe))
    command = [sys.executable, str(REPO / "pretrain_encoder.py"), "--config", str(path)]
    if not handler:
        command.append("--no-exit-signal-handler")
    run = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    logged, signalled = 0, None
    for line in run.stdout:
        if match := re.match(r"step +(\d+)/", line):
            logged = int(match[1])
            if logged == signal_at and signalled is None:
                run.send_signal(signal.SIGTERM)
                signalled = time.perf_counter()
    run.wait()
    exited = time.perf_counter()
    if signalled is None:
        raise RuntimeError(f"the run ended (exit {run.returncode}) before step {signal_at}")
    saved = latest_checkpoint(run_dir / "ckpt")
    saved_step = int(saved.name.split("_")[1]) if saved else 0
    return {"exit_code": run.returncode, "signalled_after_step": signal_at, "last_step_done": logged,
            "saved_step": saved_step, "steps_lost": logged - saved_step,
            "signal_to_exit_s": round(exited - signalled, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["demo", "210m"])
    parser.add_argument("--save-interval", type=int, default=5)
    parser.add_argument("--signal-at", type=int, default=8, help="send SIGTERM once this step is logged")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    from megatron_ext import hardware

    if args.signal_at % args.save_interval == 0:
        parser.error("--signal-at on a save step measures nothing: choose a step between saves")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        corpus = build_corpus(Path(tmp))
        for size in args.sizes:
            model, data = SIZES[size]
            for handler in (False, True):
                name = "handler_on" if handler else "handler_off"
                run_dir = Path(tmp) / size / name
                recipe = {
                    "model": model, "tokenizer": {"tokenizer_model": corpus["tokenizer"]},
                    "data": {"data_path": [corpus["data"]], "split": "100,0,0", "eval_iters": 0,
                             "data_cache_path": str(run_dir / "index_cache"), **data},
                    "schedule": {"lr": 1e-3, "lr_decay_style": "constant"},
                    "phases": [{"objective": "mlm", "mask_ratio": 0.4, "share": 1.0}],
                    "training": {"train_iters": 10_000, "eval_interval": 0, "log_interval": 1},
                    "checkpoint": {"save": str(run_dir / "ckpt"), "save_interval": args.save_interval,
                                   "async_save": True},
                    "logging": {"log_dir": str(run_dir / "log"), "wandb_mode": "disabled"},
                }
                results.setdefault(size, {})[name] = row = run_once(recipe, run_dir, signal_at=args.signal_at,
                                                                      handler=handler)
                print(f"{size:>5} {name:<11}: exit {row['exit_code']:>3} | SIGTERM after step {args.signal_at}, "
                      f"last done {row['last_step_done']}, saved {row['saved_step']}: {row['steps_lost']} steps lost | "
                      f"signal to exit {row['signal_to_exit_s']:.1f} s", flush=True)
    device = hardware.device_name() if hardware.on_gpu() else f"cpu{os.cpu_count()}"
    record = {"device": device, **hardware.software_versions(), "save_interval": args.save_interval,
              "signal_at": args.signal_at, "async_save": True, "results": results}
    write_record("preemption", device, record, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
