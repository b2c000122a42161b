"""Fine-tune encoders on the evaluation tasks over the paper's LR x seed grid and report like the paper.

    python tools/evaluate.py --models runs/mlm40/checkpoints hf/clm --output-dir runs/eval
    python tools/evaluate.py --models mlm=runs/mlm40/checkpoints --tasks rt_sentiment wiki_mentions \\
        --lrs 2e-5 1e-4 --seeds 0 1 --max-steps 100 --output-dir /tmp/eval
    python tools/evaluate.py --models mlm=runs/mlm40/checkpoints --tasks sst2 conll2003 squad \\
        --benchmarks-dir /shared/benchmarks --output-dir runs/eval_paper
    python tools/evaluate.py --models mlm=runs/mlm40/checkpoints@all clm=runs/clm/checkpoints@2000,4000 ...
    sbatch --array=0-15 examples/launch/evaluate.sbatch --models ... --output-dir /shared/eval

Models are Hugging Face encoder directories or Megatron checkpoints (a save directory: its newest
checkpoint, or one iter_* directory), exported to EuroBERT under OUTPUT_DIR/exported/ first; name
them with NAME=PATH. PATH@all evaluates every complete checkpoint of a save directory and
PATH@STEP,STEP,... those steps, each as the model NAME@STEP (summary rows carry base_model,
checkpoint_step and pretrain_tokens; summary.md adds score vs pretraining tokens). Tasks are names of the offline suite (built into --suite-dir when absent),
the paper's benchmarks from the Hugging Face hub (sst2 qqp mnli conll2003 ontonotes uner squad
squad_v2 record qed msmarco nq mldr; "paper" = all but qed), converted into --suite-dir when
absent, from --benchmarks-dir (tools/fetch_benchmarks.py) or the hub, task directories with a
task.json (docs/eval_suite.md), or a classification task of your own: a folder of train/validation/test
.csv or .jsonl files with text (and text_pair) and label columns (docs/evaluation.md). Without --tasks: the paper's benchmarks when the hub is reachable
or --benchmarks-dir is given, else the offline suite. Each (model, task, LR, seed) is one
run saved as OUTPUT_DIR/runs/<model>/<task>/lr<LR>_seed<SEED>.json; rerunning skips finished
runs. Zero-shot STS tasks (lee_sts, or an STS-B file converted with python -m
megatron_ext.eval.families.sts) train nothing: one run per model (lr0_seed0.json), Spearman x 100. The best LR maximises mean validation; test is mean +- 95 % CI over seeds; diverged runs
count as 0. Writes summary.{json,md,csv} and plots/<task>.png (score vs LR).
Defaults are the paper's: 6 LRs x 5 seeds, batch 32, 1,000 steps (token classification: one epoch).

Workers: start this same command N times (processes, or a SLURM job array) on one --output-dir
(shared storage): each run is claimed by one worker (a claim file with a heartbeat beside its
record), so it is done once; a claim without a heartbeat for --claim-timeout seconds (or of a dead
process on the same host) is taken over. A worker exits when nothing is left to claim; the last
to finish writes the summary. --summary-only writes it from the runs present, listing the missing.
SIGTERM or SIGUSR1 (a scheduler's stop) gives the run in flight back at once, then exits.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path


from megatron_ext.eval.hub_datasets import BENCHMARKS, hub_offline, hub_reachable
from megatron_ext.claims import DEFAULT_TIMEOUT_S, ClaimPolicy
from megatron_ext.eval.families import FAMILIES
from megatron_ext.eval.finetuning import PAPER_LR_GRID, PAPER_SEEDS
from megatron_ext.eval.suite import TASKS
from megatron_ext.cli.entry import ArgumentParser, entry_point
from megatron_ext.processes import signal_handlers

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
"""A scheduler's stop (SLURM: SIGTERM at the time limit or on scancel; SIGUSR1, the usual warning)
or Ctrl-C: the worker gives back its claim on the run in flight, so another takes it over at once
(one line, exit 128 + the signal; finished runs are kept, each written whole)."""


def default_tasks() -> list[str]:
    """The suite's tasks whose family the harness fine-tunes."""
    return [name for name, spec in TASKS.items() if spec.family in FAMILIES]


def tasks_without_flag(benchmarks_dir: Path | None) -> list[str]:
    """What runs without ``--tasks``: the paper's benchmarks where their data can be had (a
    ``--benchmarks-dir``, offline mode reading the Hugging Face cache, or a reachable hub), else the
    offline suite."""
    if benchmarks_dir is not None or hub_offline() or hub_reachable():
        return ["paper"]
    print("the Hugging Face hub is not reachable and no --benchmarks-dir was given: evaluating on the "
          f"offline suite ({' '.join(default_tasks())})", flush=True)
    return default_tasks()


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--models", nargs="+", required=True, metavar="[NAME=]PATH[@all|@STEP,...]",
        help="HF encoder directories or Megatron checkpoints (default name: the path's last component); "
             "SAVE_DIR@all: each complete checkpoint, SAVE_DIR@STEP,STEP: those steps (models NAME@STEP)")
    add("--tasks", nargs="+", default=None, metavar="TASK",
        help=f"suite tasks ({' '.join(default_tasks())}), benchmarks ({' '.join(BENCHMARKS)}), 'paper' or "
             "task directories, or folders of train/validation/test .csv/.jsonl with text and label (default: 'paper' when the hub or --benchmarks-dir has the data, else the suite)")
    add("--output-dir", type=Path, required=True, help="receives runs/, exported/, summaries and plots")
    add("--lrs", nargs="+", type=float, default=list(PAPER_LR_GRID), metavar="LR", help="fine-tuning LR grid")
    add("--seeds", nargs="+", type=int, default=list(PAPER_SEEDS), metavar="SEED", help="seeds per LR")
    add("--max-steps", type=int, default=None,
        help="optimizer steps per run (default 1,000; also replaces token classification's one epoch)")
    add("--batch-size", type=int, default=None, help="examples per step (default 32)")
    add("--max-length", type=int, default=None,
        help="truncate inputs to this many tokens (default: 99 %% of the model's maximum, the paper's)")
    add("--max-eval-examples", type=int, default=None,
        help="score at most this many validation/test examples (default: all)")
    add("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    add("--suite-dir", type=Path, default=None,
        help="the offline suite and the converted benchmarks (default: <data dir>/eval_suite)")
    add("--claim-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
        help="take over another worker's claim on a run when its heartbeat (every SECONDS/10) is older "
             "than this (default %(default)g)")
    add("--summary-only", action="store_true",
        help="fine-tune nothing: write the summary from the runs recorded so far, listing the missing ones")
    add("--benchmarks-dir", type=Path, default=None,
        help="local copies of the benchmarks' hub datasets (tools/fetch_benchmarks.py --output-dir); "
             "default: the Hugging Face hub, or its cache with HF_HUB_OFFLINE=1")
    return parser


@entry_point("evaluate.py")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_ext.eval.harness import evaluate_models
    from megatron_ext.eval.render import best_lr_label

    overrides = {key: value for key, value in (("max_steps", args.max_steps), ("batch_size", args.batch_size),
                                               ("max_length", args.max_length),
                                               ("max_eval_examples", args.max_eval_examples),
                                               ("device", args.device)) if value is not None}
    tasks = args.tasks or tasks_without_flag(args.benchmarks_dir)

    def stop(signum: int, _frame) -> None:
        print(f"evaluate.py: {signal.Signals(signum).name} received: the run in flight is given back to the "
              "other workers", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)  # leaving the claim's block releases it

    with signal_handlers(STOP_SIGNALS, stop):
        evaluation = evaluate_models(args.models, tasks, output_dir=args.output_dir, lrs=args.lrs, seeds=args.seeds,
                                     overrides=overrides, suite_dir=args.suite_dir,
                                     benchmarks_dir=args.benchmarks_dir,
                                     claims=ClaimPolicy(timeout_s=args.claim_timeout), summary_only=args.summary_only)
    done = (f"{evaluation.executed} run(s) fine-tuned, {evaluation.reused} reused"
            + (f", {evaluation.by_others} by other workers" if evaluation.by_others else ""))
    if not evaluation.summary_written:
        print(f"{done}; {len(evaluation.missing)} left to other workers: no summary yet")
        return 0
    print("model | task | family | metric | best LR | test (mean ± 95 % CI) | validation mean")
    for row in evaluation.results:
        ci = "" if row.test_ci95 is None else f" ± {row.test_ci95:.2f}"
        print(f"{row.model} | {row.task} | {row.family} | {row.metric} | {best_lr_label(row)} | "
              f"{row.test_mean:.2f}{ci} | {row.validation_mean:.2f}")
    if evaluation.missing:
        print(f"summary from {evaluation.reused} run(s); {len(evaluation.missing)} missing (listed in summary.md): "
              f"{args.output_dir / 'summary.md'}")
    else:
        print(f"{done}; summary: {args.output_dir / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
