"""Whether a study's training takes the time its estimate says: the miniature study at CI size
(the one ``tests/integration/test_miniature_study.py`` runs), trained by the local launcher, its
wall time next to the cost model's estimate and the band the estimate states.

    .venv/bin/python -m benchmarks.study_estimate [--rounds 1] [--work-dir DIR]
        [--tokenizer data/demo_tokenizer --data data/demo_dataset/train_text_document]
        [--output benchmarks/results/study_estimate_cpu2.json]

The estimate (``megatron_ext.study.cost.study_cost``) is made from the committed measured speeds
of this kind of device (``megatron_ext.performance.measured_speeds``) and an assumed start-up per
trainer, for a machine to itself; so the benchmark is meant to run alone on the machine, and it
records the load average before and after each round to show whether it did. Each round trains
the study's twelve runs as a tree of segments (``run_study --train-only``) in a fresh folder.
Reported per round: the measured seconds, the estimate, their ratio and whether it lies inside the
band (``performance.cost.BANDS``). The demo data first: ``make demo-data``.

This is where the estimate's accuracy is checked: the CI test trains the same study beside another
test worker, where the machine is not its own and a wall time says nothing about the model.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.results_file import write_record

REPO = Path(__file__).resolve().parent.parent
MINIATURE = REPO / "examples" / "studies" / "miniature.yaml"


def ci_size_study(root: Path, *, tokenizer: str, data: str) -> Path:
    """The miniature study with budgets of 8 and 16 steps on ``data`` (a dataset prefix read with
    ``tokenizer``), one task, two LRs, written under ``root`` beside a copy of the recipes it links to
    (so outside the checkout); its outputs go under ``root``. Returns the study file's path."""
    shutil.copytree(REPO / "examples" / "recipes", root / "examples" / "recipes")
    study = yaml.safe_load(MINIATURE.read_text())
    if study["sizes"][0]["base"] != "../recipes/base/tiny.yaml":  # the copy's, beside it
        raise SystemExit(f"{MINIATURE}: sizes[0].base is {study['sizes'][0]['base']!r}, expected "
                         "'../recipes/base/tiny.yaml' (the CI-size study copies the recipes beside it)")
    study["budgets"] = [8, 16]
    study["cpt"]["source_budget"] = 16
    study["cpt"]["continuations"] = [
        {"steps": 4, "overrides": {"schedule": {"lr_warmup_iters": 1, "lr_wsd_decay_iters": 1}}}, {"steps": 8}]
    study["overrides"].update({
        "tokenizer": {"tokenizer_model": tokenizer},
        "data": {"data_path": [data], "split": "80,20,0", "eval_iters": 1,
                 "data_cache_path": str(root / "index_cache")},
        "schedule": {"lr_warmup_iters": 2, "lr_wsd_decay_iters": 4},
        "training": {"eval_interval": 8, "log_interval": 4},
        "checkpoint": {"save_interval": 4, "keep_last": 1},
    })
    study["output"] = {"save": str(root / "pretrain" / "{run}" / "checkpoints"),
                       "log_dir": str(root / "pretrain" / "{run}")}
    study["evaluation"].update({"tasks": ["rt_sentiment"], "lrs": [1e-3, 3e-3], "seeds": [0], "max_steps": 2,
                                "max_length": 64, "max_eval_examples": 16, "output_dir": str(root / "eval")})
    path = root / "examples" / "studies" / "miniature_ci.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


TOOK = re.compile(r"^training: every run complete \((\d+) s\)$", re.M)
"""The line ``run_study`` prints when the last segment is trained."""


def training_seconds(printed: str) -> float:
    """The training wall time ``run_study`` printed."""
    found = TOOK.search(printed)
    if found is None:
        raise ValueError("run_study printed no 'training: every run complete (N s)' line")
    return float(found.group(1))


def _round(root: Path, tokenizer: str, data: str, kind: str) -> dict:
    from megatron_ext.performance import cost
    from megatron_ext.study import cost as study_costs
    from megatron_ext.study.plan import plan_study
    from megatron_ext.study.spec import read_study

    path = ci_size_study(root, tokenizer=tokenizer, data=data)
    plan = plan_study(read_study(path), path)
    estimate = study_costs.study_cost(plan, speeds=cost.SpeedTable(kind=kind), gpus=None,
                                      gpus_per_node=8)
    low, high = cost.band(source for segment in estimate.segments for source in segment.sources)
    load_before = os.getloadavg()
    run = subprocess.run([sys.executable, "-m", "megatron_ext.cli.run_study", str(path), "--launcher", "local",
                          "--study-dir", str(root / "study"), "--train-only"], cwd=REPO,
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"run_study failed (exit {run.returncode}):\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    took = training_seconds(run.stdout)
    ratio = took / estimate.sequential_s
    return {"segments": len(plan.segments), "runs": len(plan.runs), "measured_s": took,
            "estimate_s": round(estimate.sequential_s, 1), "ratio": round(ratio, 3), "band": [low, high],
            "inside_band": low <= ratio <= high, "load_average_before": load_before,
            "load_average_after": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tokenizer", default=str(REPO / "data" / "demo_tokenizer"))
    parser.add_argument("--data", default=str(REPO / "data" / "demo_dataset" / "train_text_document"))
    parser.add_argument("--work-dir", type=Path, default=None, help="where the rounds train (default: a temporary folder)")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    if not Path(args.data + ".idx").exists():
        parser.error(f"--data {args.data}: no {args.data}.idx (make demo-data builds the default)")

    from megatron_ext.performance.devices import this_machine_kind

    kind = this_machine_kind()
    rounds = []
    with tempfile.TemporaryDirectory(dir=args.work_dir) as scratch:
        for index in range(args.rounds):
            started = time.perf_counter()
            rounds.append(_round(Path(scratch) / f"round_{index}", args.tokenizer, args.data, kind))
            r = rounds[-1]
            print(f"round {index}: training {r['measured_s']:.0f} s, estimate {r['estimate_s']:.0f} s, "
                  f"x{r['ratio']:.2f} (band x{r['band'][0]:.2g}-x{r['band'][1]:.2g}: "
                  f"{'inside' if r['inside_band'] else 'OUTSIDE'}), load average {r['load_average_before'][0]:.1f} "
                  f"-> {r['load_average_after'][0]:.1f} on {os.cpu_count()} cores "
                  f"({time.perf_counter() - started:.0f} s with the plan)", flush=True)
    device = f"{kind}{os.cpu_count()}" if kind == "cpu" else kind
    write_record("study_estimate", device, {
        "what": "the CI-size miniature study's training (local launcher) vs its cost-model estimate",
        "machine": platform.machine(), "cores": os.cpu_count(), "rounds": rounds,
        "inside_band": all(r["inside_band"] for r in rounds)}, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
