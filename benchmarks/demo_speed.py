"""The demo's training speed at two commits, side by side: whether a change (a refactor meant to
change nothing) left the CPU trainer as fast as before, and whether it trained the same numbers.

    .venv/bin/python -m benchmarks.demo_speed --baseline 514d773 [--candidate HEAD] [--steps 300]
        [--rounds 2] [--output benchmarks/results/demo_speed_cpu2.json]

Each commit is checked out in a temporary git worktree (its ``data`` the checkout's, so both read
the same demo corpus: ``make demo-data`` first) and runs the demo recipe
(``examples/recipes/demo_tiny_biphasic.yaml``) for ``--steps`` steps with this checkout's Python,
as ``python pretrain_encoder.py`` (the one command every commit has), in its own process. Rounds
alternate the sides (baseline, candidate, candidate, baseline, ...), so a machine that slows down
during the run slows both alike. Per run: the wall time of the process, and the median of the
trainer's own ``tokens_per_s`` over its log windows (the first left out: it holds the start-up of
the step loop). Reported: each side's best and median, the candidate / baseline ratio of the medians
(>1: the candidate is faster), and whether every step's training loss was identical. Uncommitted
changes are not measured: a worktree holds the commit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.results_file import write_record

REPO = Path(__file__).resolve().parent.parent
RECIPE = "examples/recipes/demo_tiny_biphasic.yaml"


def _commit(ref: str) -> str:
    return subprocess.run(["git", "rev-parse", "--verify", f"{ref}^{{commit}}"], cwd=REPO, check=True,
                          capture_output=True, text=True).stdout.strip()


def _worktree(commit: str, root: Path) -> Path:
    path = root / commit[:12]
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(path), commit], cwd=REPO, check=True)
    (path / "data").symlink_to(REPO / "data")
    return path


def _train(tree: Path, steps: int, run_dir: Path) -> dict:
    """One demo run of ``steps`` steps in ``tree``: wall time, the trainer's tokens/s, each step's loss."""
    command = [sys.executable, "pretrain_encoder.py", "--config", RECIPE, "--train-iters", str(steps),
               "--save", str(run_dir / "checkpoints"), "--save-interval", str(steps), "--log-dir", str(run_dir)]
    environment = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.perf_counter()
    done = subprocess.run(command, cwd=tree, env=environment, capture_output=True, text=True)
    wall_s = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{tree}: the demo run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    speeds = [r["tokens_per_s"] for r in train if "tokens_per_s" in r][1:]
    return {"wall_s": wall_s, "tokens_per_s": statistics.median(speeds),
            "losses": {r["step"]: r["loss"] for r in train}}


def _side(runs: list[dict]) -> dict:
    return {"wall_s": [round(r["wall_s"], 2) for r in runs],
            "tokens_per_s": [round(r["tokens_per_s"]) for r in runs],
            "best_tokens_per_s": round(max(r["tokens_per_s"] for r in runs)),
            "median_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in runs)),
            "median_wall_s": round(statistics.median(r["wall_s"] for r in runs), 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.demo_speed", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("--baseline", required=True, help="the commit (any git ref) compared against")
    parser.add_argument("--candidate", default="HEAD", help="the commit measured (default: HEAD)")
    parser.add_argument("--steps", type=int, default=300, help="steps per run (default: 300)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per side, alternating (default: 2)")
    parser.add_argument("--output", type=Path, help="the JSON record (default: results/demo_speed_cpu<N>.json)")
    args = parser.parse_args(argv)
    if args.steps < 260 or args.rounds < 1:
        parser.error("--steps must be >= 260 (the recipe's 50 warm-up and 200 decay steps, and two log windows) "
                     "and --rounds >= 1")
    if not (REPO / "data/demo_dataset/train_text_document.idx").exists():
        parser.error(f"no demo corpus in {REPO / 'data'}: run make demo-data first")
    sides = {"baseline": _commit(args.baseline), "candidate": _commit(args.candidate)}
    # A timeout's SIGTERM unwinds like Ctrl-C, so the worktrees below are removed either way.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    with tempfile.TemporaryDirectory(prefix="demo_speed_") as scratch:
        root = Path(scratch)
        trees = {}
        try:
            for name, commit in sides.items():
                trees[name] = _worktree(commit, root / "trees")
            for round_index in range(args.rounds):
                order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
                for name in order:
                    run = _train(trees[name], args.steps, root / "runs" / f"{name}_{round_index}")
                    runs[name].append(run)
                    print(f"round {round_index + 1}/{args.rounds} {name:9s} {sides[name][:9]}: "
                          f"{run['tokens_per_s']:,.0f} tok/s, {run['wall_s']:.1f} s", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)
    baseline, candidate = (_side(runs[name]) for name in sides)
    reference = runs["baseline"][0]["losses"]
    same_losses = all(run["losses"] == reference for name in sides for run in runs[name])
    ratio = candidate["median_tokens_per_s"] / baseline["median_tokens_per_s"]
    record = {"recipe": RECIPE, "steps": args.steps, "rounds": args.rounds, "cores": os.cpu_count(),
              "machine": platform.processor() or platform.machine(), "load_average": os.getloadavg(),
              "baseline": {"commit": sides["baseline"], **baseline},
              "candidate": {"commit": sides["candidate"], **candidate},
              "candidate_over_baseline_tokens_per_s": round(ratio, 3), "identical_losses": same_losses}
    print(f"candidate / baseline tokens/s (medians): {ratio:.3f}; every step's loss identical: {same_losses}")
    write_record("demo_speed", f"cpu{os.cpu_count()}", record, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
