"""A study's cost (``megatron_ext.study.cost``): its segments on their sizes' GPUs and its evaluation
grid; calibration leaves the warm-up steps out and its speeds come first; a budget refuses a study in
one line naming the biggest items; the study's ETA is corrected by the segments trained."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_ext.config_loading import UserError
from megatron_ext.performance import cost, measured_speeds
from megatron_ext.study import calibration
from megatron_ext.study import cost as study_costs
from megatron_ext.study.state import Progress
from megatron_ext.study.plan import plan_study
from megatron_ext.study.spec import read_study
from helpers import RECIPES, shipped_recipe_config
from megatron_ext.training.dry_run import phase_flops, training_flops

ROOT = Path(__file__).resolve().parents[2]



def test_calibrated_speeds_come_first_and_the_warmup_is_left_out():
    tokens = 2048
    records = [{"kind": "train", "step": 1, "tokens_per_s": 20.48},   # 100 s: compilation, first batches
               {"kind": "train", "step": 2, "tokens_per_s": 204.8},   # 10 s
               {"kind": "valid", "step": 2},
               *({"kind": "train", "step": s, "tokens_per_s": 1024.0} for s in (3, 4, 5))]  # 2 s each
    assert calibration.steady_step_seconds(records, warmup=2, tokens_per_step=tokens) == pytest.approx(2.0)
    with pytest.raises(UserError, match="no step after the 5 warm-up step"):
        calibration.steady_step_seconds(records, warmup=5, tokens_per_step=tokens)

    config = shipped_recipe_config("base/610m.yaml", train_iters=5000)
    here = cost.Speed(flops_per_s=1e12, source="calibrated", detail="timed here", startup_s=30.0)
    speeds = cost.SpeedTable(kind="H100",
                             calibrated={cost.calibration_key(config, "mlm"): here})
    segment = cost.segment_cost(config, phase_flops(config, 100, 600), run="r", start=100, end=600, gpus=1,
                                gpus_per_node=8, speeds=speeds)
    assert segment.seconds == pytest.approx(training_flops(config, 100, 600) / 1e12 + 30.0)
    assert segment.sources == ("calibrated",) and cost.band(segment.sources) == (0.75, 1.25)


def test_study_resources_and_evaluation_grid(tmp_path):
    study = tmp_path / "s.yaml"
    study.write_text(f"""
name: s
sizes:
  - {{name: a, base: {RECIPES / 'base' / '610m.yaml'}, resources: {{slurm: [--nodes=2]}}}}
  - {{name: b, base: {RECIPES / 'base' / '210m.yaml'}, resources: {{slurm: [--gpus=3]}}}}
budgets: [5000]
objectives: [{{objective: clm}}]
resources: {{slurm: [--gpus-per-node=4]}}
evaluation: {{tasks: [rt_sentiment, wiki_mentions, lee_sts], lrs: [1.0e-4, 2.0e-4], seeds: [0, 1, 2], workers: 4,
             max_steps: 100}}
""")
    plan = plan_study(read_study(study), study)
    assert study_costs.study_gpus_per_run(plan, "a", gpus_per_node=8) == 8   # 2 nodes x the study's 4 GPUs per node
    assert study_costs.study_gpus_per_run(plan, "b", gpus_per_node=8) == 3
    speeds = cost.SpeedTable(kind="H100", measured=measured_speeds.MeasuredSpeeds())
    result = study_costs.study_cost(plan, speeds=speeds, gpus=None, gpus_per_node=8)
    assert [c.gpus for c in result.segments] == [8, 3]
    # Per size: SC and TC at 2 LRs x 3 seeds, the zero-shot STS task once.
    assert {(i.what, i.runs) for i in result.evaluation.items} == {
        ("a sc", 6), ("a tc", 6), ("a sts", 1), ("b sc", 6), ("b tc", 6), ("b sts", 1)}
    assert result.evaluation.wall_s == pytest.approx(result.evaluation.seconds / 4)
    assert result.total_gpu_hours == pytest.approx(result.tree_gpu_hours + result.evaluation.seconds / 3600)
    text = study_costs.format_study_cost(plan, result)
    assert "whole study:" in text and "assumed: 6 x " in text


def test_progress_eta_is_the_estimate_corrected_by_the_segments_trained():
    progress = Progress({"a": 10, "b": 10, "c": 20}, estimates={"a": 100.0, "b": 100.0, "c": 200.0})
    assert progress.summary().endswith("ETA 6m40s (estimate)")
    progress.finish("a", 150.0)  # half again as long as estimated
    assert progress.summary().endswith("ETA 7m30s (estimate x1.50, the measured pace of the segments trained)")
    progress.drop("c")
    assert progress.summary().endswith("ETA 2m30s (estimate x1.50, the measured pace of the segments trained)")


def test_the_one_node_study_fits_its_node_and_a_smaller_budget_is_refused(capsys):
    """examples/studies/one_node.yaml: within 8 H100s x 24 h by its own estimate; under 50 GPU-hours refused."""
    from megatron_ext.cli import plan_study as cli

    study = str(ROOT / "examples" / "studies" / "one_node.yaml")
    assert cli.main([study, "--dry-run", "--gpu", "H100", "--budget-gpu-hours", "192"]) == 0
    out = capsys.readouterr().out
    whole = re.search(r"^  whole study: ([\d,.]+) GPU-hours; wall time ([\d.]+) h \(local launcher\)", out, re.M)
    assert whole and float(whole.group(1).replace(",", "")) <= 192 and float(whole.group(2)) <= 24, out
    assert re.search(r"^  210m_clm_12k +8 ", out, re.M)  # 8 GPUs per run: the size's resources
    assert cli.main([study, "--dry-run", "--gpu", "H100", "--budget-gpu-hours", "50"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.match(r"plan_study\.py: error: --budget-gpu-hours 50: study one_node is estimated at "
                                      r"[\d.]+ GPU-hours; the biggest: segment 210m_clm_12k [\d.]+, ", err[0]), err

