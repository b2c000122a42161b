"""The paper in miniature (``examples/studies/miniature.yaml``, ``make miniature``) end to end at CI
size through the local launcher: the same study file with smaller budgets and grid, trained as a
tree of branches, evaluated by two workers sharing each grid, and reported. It runs as a user of
the installed package would: the project installed NOT editable (``installed_package``), the
study and its recipes copied out of the checkout, ``python -m megatron_ext.cli.run_study`` run
from a folder outside it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.study_estimate import ci_size_study, training_seconds
from megatron_ext.checkpoint.reader import Checkpoint
from megatron_ext.performance import cost
from megatron_ext.study import cost as study_costs
from megatron_ext.study.plan import plan_study
from megatron_ext.study.spec import read_study

REFERENCE = "all-MiniLM-L6-v2"


@pytest.mark.slow  # twelve pretraining segments, 26 fine-tuning runs, the report, a calibration
@pytest.mark.timeout(1200)  # the study: 453 s in CI beside the other test worker; the calibration ~1 min
def test_the_miniature_study_at_ci_size(tmp_path, tiny_corpus, installed_package):
    path = ci_size_study(tmp_path, tokenizer=tiny_corpus["tokenizer"], data=tiny_corpus["data"])
    plan = plan_study(read_study(path), path)
    assert len(plan.runs) == 12 and plan.steps_tree < plan.steps_separate
    branches = [s for s in plan.segments if s.start_from == "branch"]
    assert {s.run for s in branches} >= {"tiny_clm_8", "tiny_mlm_40_8", "tiny_biphasic_25_75_16"}

    run = subprocess.run([sys.executable, "-m", "megatron_ext.cli.run_study", str(path), "--launcher", "local",
                          "--study-dir", str(tmp_path / "study")], cwd=installed_package["work"],
                         env=installed_package["env"], capture_output=True, text=True, timeout=1100)
    printed = run.stdout
    assert run.returncode == 0, printed + run.stderr
    assert "training: every run complete" in printed and "evaluation: runs: 2 worker(s)" in printed
    # Every job ran the installed package's programs (the log's first line names the command; in the
    # jobs' environment the module is the installed copy's: the installed_package fixture).
    assert (tmp_path / "study" / "logs" / "tiny_clm_16.log").read_text().split("\n", 1)[0].endswith(
        f"-m megatron_ext.cli.pretrain_encoder --config {tmp_path / 'study' / 'recipes' / 'tiny_clm_16.yaml'}")
    assert not (installed_package["work"] / "runs").exists()  # the study wrote where it was told

    # The cost model: the estimate comes from the committed CPU throughput (the installed package reads
    # the measurements it ships: megatron_ext.performance.measured_speeds.packaged) and states its
    # band; the progress lines give an ETA from it, corrected by the segments trained. Whether the
    # training's wall time lies inside the band is measured where the machine is the study's own
    # (benchmarks/study_estimate.py): here it shares two cores with the other test worker.
    assert training_seconds(printed) > 0
    speeds = cost.SpeedTable(kind=cost.CPU)
    estimate = study_costs.study_cost(plan, speeds=speeds, gpus=None, gpus_per_node=8)
    assert estimate.sequential_s > 0
    assert cost.band(source for segment in estimate.segments for source in segment.sources) == \
        cost.BANDS["measured"], estimate.segments[0].speeds
    assert re.search(r"^\[1/12\] \S+: complete in .* ETA \S+ \(estimate x[\d.]+, the measured pace", printed, re.M), printed
    # --calibrate, from the installed package: each training shape and one fine-tuning run per family
    # timed here, every estimate said to come from it.
    calibrated = subprocess.run([sys.executable, "-m", "megatron_ext.cli.run_study", str(path), "--launcher", "local",
                                 "--study-dir", str(tmp_path / "study"), "--dry-run", "--calibrate"],
                                cwd=installed_package["work"], env=installed_package["env"], capture_output=True,
                                text=True, timeout=900)
    assert calibrated.returncode == 0, calibrated.stdout + calibrated.stderr
    for fragment in ("calibrated tiny mlm:", "calibrated tiny clm:", "calibrated fine-tuning tiny sc (rt_sentiment):",
                     "(calibrated speeds)", "[calibrated: one sc run of tiny timed here]"):
        assert fragment in calibrated.stdout, (fragment, calibrated.stdout)

    # Pretraining: every run at its budget; each branch continued its parent's checkpoint in place.
    for run in plan.runs:
        assert Checkpoint.open(run.recipe["checkpoint"]["save"]).step == run.train_iters, run.name
    for segment in branches:
        state = json.loads((Path(plan.run(segment.run).recipe["checkpoint"]["save"]) / "iter_{:07d}".format(
            plan.run(segment.run).train_iters) / "checkpoint_complete.json").read_text())
        assert state["step"] == plan.run(segment.run).train_iters
        log = (Path(plan.run(segment.run).recipe["logging"]["log_dir"]) / "metrics.jsonl").read_text()
        first = next(row for line in log.splitlines() if (row := json.loads(line))["kind"] == "train")
        assert first["step"] > segment.branch_step, segment.run  # it trained from the branch step on
    for parent in plan.segments:
        kept = {Checkpoint(p).step for p in Path(plan.run(parent.run).recipe["checkpoint"]["save"]).glob("iter_*")}
        assert set(parent.saves) <= kept, parent.run  # keep_last 1 pruned none of them

    # Evaluation: each of the 12 runs x 2 LRs fine-tuned once by the two workers, and the reference.
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert sorted(row["model"] for row in summary["results"]) == sorted(r.name for r in plan.runs)
    records = sorted((tmp_path / "eval" / "runs").glob("*/rt_sentiment/*.json"))
    assert len(records) == 12 * 2 and {r.parent.parent.name for r in records} == {r.name for r in plan.runs}
    assert len(list((tmp_path / "eval" / "references" / REFERENCE / "runs").glob("*/rt_sentiment/*.json"))) == 1

    # Report: the four figures, the reference apart, nothing missing.
    report = json.loads((tmp_path / "eval" / "report" / "report.json").read_text())
    assert report["missing"] == []
    assert [row["models"] for row in report["other_models"]] == [[REFERENCE]]
    assert len(report["study_models"]) == 12
    for name in ("clm_share", "tokens", "cpt", "lr_sensitivity"):
        figure = report["figures"][name]
        assert "skipped" not in figure, (name, figure)
        assert (tmp_path / "eval" / "report" / figure["file"]).stat().st_size > 5_000
    assert "tiny_biphasic_25_75_16" in (tmp_path / "eval" / "report" / "report.md").read_text()


def test_an_installed_package_prices_the_1b_recipe_from_the_measured_speed(installed_package):
    """``pip install`` (not editable, nothing of the checkout on the path): ``--dry-run --gpu H100``
    prices the 1B recipe from the measurements the package ships and names the visit they come from."""
    recipe = Path(__file__).resolve().parents[2] / "examples" / "recipes" / "paper" / "1b_mlm_40.yaml"
    run = subprocess.run([sys.executable, "-m", "megatron_ext.cli.pretrain_encoder", "--config", str(recipe), "--dry-run",
                          "--world-size", "64", "--gpu", "h100"], cwd=installed_package["work"],
                         env=installed_package["env"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"^  speed +measured: gpu_visits/h100-2026-11-2\d/\S+: NVIDIA H100", run.stdout, re.M), run.stdout
    assert "(measured speeds)" in run.stdout and "assumed" not in run.stdout.split("speed", 1)[1].split("\n", 1)[0]
