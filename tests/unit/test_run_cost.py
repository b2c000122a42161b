"""The cost model (``megatron_ext.performance.cost``): FLOPs over a speed give hours; where the speed
comes from (calibrated, a committed measurement, a GPU kind's peak at an assumed MFU) is said, and
a missing measurement falls back and says so; a budget refuses in one line naming the biggest items;
``pretrain_encoder.py --dry-run`` prints a run's cost."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_ext.config_loading import UserError
from megatron_ext.performance import cost, measured_speeds
from helpers import RECIPES, shipped_recipe_config
from megatron_ext.training.recipe import read_recipe, run_config_from_dict
from megatron_ext.training.dry_run import phase_flops, training_flops

ROOT = Path(__file__).resolve().parents[2]



def test_known_flops_at_an_assumed_speed_give_known_hours_and_say_the_fallback(tmp_path):
    """The 1B biphasic recipe's 6.332e20 FLOPs (its --dry-run) on one H100 at 35 % of 989 TFLOP/s."""
    config = shipped_recipe_config("paper/1b_biphasic_25_75.yaml")
    assert training_flops(config) == pytest.approx(6.332e20, rel=1e-3)
    speeds = cost.SpeedTable(kind="H100", measured=measured_speeds.MeasuredSpeeds(), mfu=0.35)
    one = cost.segment_cost(config, phase_flops(config), run="r", gpus=1, gpus_per_node=8, speeds=speeds)
    startup = cost.ASSUMED_STARTUP_S["gpu"]
    assert one.seconds == pytest.approx(6.332e20 / (989e12 * 0.35) + startup, rel=1e-3)
    assert one.gpu_hours == pytest.approx(508.1, abs=0.5) and one.sources == ("assumed",)
    assert "dense peak 989 TFLOP/s (datasheet) x 35 % MFU, an assumption" in one.speeds[0]
    assert any(line.startswith("no measurement for H100") for line in speeds.notices)
    # 8 GPUs of a node: an eighth of the compute plus the optimizer's traffic per step, half of it
    # hidden by overlap_grad_reduce (docs/scaling.md: 2 x 4 x N x 7/8 bytes at 400 GB/s).
    eight = cost.segment_cost(config, phase_flops(config), run="r", gpus=8, gpus_per_node=8, speeds=speeds)
    n = 1_202_447_808
    traffic = 2 * 4 * n * 7 / 8 / 400e9 * (1 - 0.5)
    assert eight.seconds == pytest.approx((one.seconds - startup) / 8 + 42_000 * traffic + startup, rel=1e-6)
    assert "over NVLink at 400 GB/s" in eight.scaling and "50 % overlapped" in eight.scaling
    # A directory without measurements for the kind: the same assumption, and a notice naming it.
    empty = cost.SpeedTable(kind="H100", measured=measured_speeds.MeasuredSpeeds(), results_dir=tmp_path, mfu=0.35)
    assert cost.segment_cost(config, phase_flops(config), run="r", gpus=1, gpus_per_node=8,
                             speeds=empty).seconds == one.seconds
    assert any(line.startswith("no measurement for H100 at 1,202,447,808 parameters, seq 2048, bf16 in the "
                               f"measurements or {tmp_path}")
               for line in empty.notices)


def test_a_committed_measurement_is_used_with_its_device_commit_and_date():
    config = shipped_recipe_config("base/610m.yaml", train_iters=5000)
    speeds = cost.SpeedTable(kind="H100")
    speed = speeds.speed(config, "mlm")
    assert speed.source == "measured"
    assert re.search(r"gpu_visits/h100-2026-11-2\d/throughput\S*\.json: NVIDIA H100 80GB HBM3, (added in )?commit "
                     r"[0-9a-f]{7,}, 2026-11-2\d: 610m seq 2048 bf16", speed.detail), speed.detail
    assert 1e14 < speed.flops_per_s < 989e12  # between 10 % and 100 % MFU
    # No A100 measurement: the peak at the assumed MFU, said.
    a100 = cost.SpeedTable(kind="A100")
    assert a100.speed(config, "mlm").flops_per_s == pytest.approx(312e12 * cost.ASSUMED_MFU)
    assert a100.notices and a100.notices[0].startswith("no measurement for A100")
    # A CPU has no peak: without a measurement or calibration the cost is unknown, and says how to get it.
    cpu = cost.segment_cost(config, phase_flops(config), run="r", gpus=1, gpus_per_node=8,
                            speeds=cost.SpeedTable(kind=cost.CPU, measured=measured_speeds.MeasuredSpeeds()))
    assert cpu.seconds is None and "--calibrate" in cpu.speeds[0]


def test_a_variant_that_ran_the_same_step_another_way_is_a_speed_of_that_spec(tmp_path):
    """A throughput row's timed variants that change only how the step runs (the layer implementation,
    CUDA graphs, fusions) are speeds of the same FLOPs: a TE config is costed at the TE variant's speed
    though the row's default ran the local spec; a variant with other FLOPs per token is not a speed."""
    import json

    config = shipped_recipe_config("base/1b.yaml", train_iters=5000)
    local = {"transformer_impl": "local", "cuda_graphs": "none", "gradient_accumulation_fusion": False,
             "lm_head_scored_only": True}
    row = {"model": "1b", "seq_length": 2048, "precision": "bf16", "parameters": cost.parameter_count(config.model),
           "transformer_impl": "local", "tflops": 300.0, "tokens_per_s": 50_000.0, "settings": local,
           "variants": {"te_spec": {"tokens_per_s": 60_000.0, "settings": {**local, "transformer_impl": "te",
                                                                           "gradient_accumulation_fusion": True}},
                        "full_lm_head": {"tokens_per_s": 70_000.0, "settings": {**local, "lm_head_scored_only": False}}}}
    visit = tmp_path / "gpu_visits" / "h100-2030-01-01"
    visit.mkdir(parents=True)
    (visit / "throughput.json").write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "rows": [row]}))
    speeds = cost.SpeedTable(kind="H100", results_dir=tmp_path)
    assert config.model.transformer_impl == "te"
    te = speeds.speed(config, "mlm")
    assert te.flops_per_s == pytest.approx(360e12) and "te spec (variant te_spec)" in te.detail
    raw = read_recipe(RECIPES / "base" / "1b.yaml") | {"phases": [{"objective": "mlm", "mask_ratio": 0.4, "share": 1.0}]}
    raw["model"]["transformer_impl"] = "local"
    raw["training"]["train_iters"] = 5000
    local_config = run_config_from_dict(raw)  # the row's own side, not full_lm_head's
    assert speeds.speed(local_config, "mlm").flops_per_s == pytest.approx(300e12)


def test_budget_refuses_in_one_line_naming_the_biggest_items():
    with pytest.raises(UserError) as refused:
        cost.check_budget(100, 160.0, [("segment a", 10.0), ("segment b", 90.0), ("fine-tuning x", 60.0)], "study s")
    assert str(refused.value) == ("--budget-gpu-hours 100: study s is estimated at 160.0 GPU-hours; the biggest: "
                                  "segment b 90.0, fine-tuning x 60.0, segment a 10.0")
    cost.check_budget(200, 160.0, [], "study s")  # within: nothing


def test_pretrain_dry_run_prints_the_cost_and_refuses_a_budget(capsys):
    from megatron_ext.cli import pretrain_encoder

    argv = ["--config", str(RECIPES / "paper" / "610m_mlm_40.yaml"), "--dry-run", "--world-size", "64",
            "--gpu", "h100"]
    assert pretrain_encoder.main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"^cost +[\d,.]+ GPU-hours, wall time [\d.]+ h on 64 H100 GPU\(s\) \([\d.e+]+ FLOPs\); expected "
                     r"within x0.5 to x2 of the estimate \(measured speeds\)$", out, re.M), out
    assert re.search(r"^  speed +measured: gpu_visits/h100-", out, re.M) and "over InfiniBand" in out
    assert pretrain_encoder.main([*argv, "--budget-gpu-hours", "10"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.match(r"pretrain_encoder\.py: error: --budget-gpu-hours 10: the run is estimated at "
                                      r"[\d,.]+ GPU-hours; the biggest: the run ", err[0]), err



def test_parts_of_a_run_add_up_to_it_with_one_start_up_and_a_step_leaves_it_out():
    """A run priced in parts (``RunPricing.steps``: each phase, each data span) shared by weights
    (``split_cost``: each source's samples) adds up to the run: the parts' steps to the run's steps,
    the run's one trainer start-up apart, in none of them; its seconds per step leave it out."""
    from functools import partial

    config = shipped_recipe_config("paper/1b_biphasic_25_75.yaml")
    speeds = cost.SpeedTable(kind="H100", measured=measured_speeds.MeasuredSpeeds(), mfu=0.35)
    pricing = cost.RunPricing(config=config, flops=partial(phase_flops, config), gpus=8, gpus_per_node=8, speeds=speeds)
    run = pricing.steps(run="the run")
    startup = cost.ASSUMED_STARTUP_S["gpu"]
    steps = config.training.train_iters
    assert run.startup_seconds == startup and run.startup_gpu_hours == pytest.approx(startup * 8 / 3600)
    assert run.step_seconds == pytest.approx((run.seconds - startup) / steps)
    assert run.steps_gpu_hours + run.startup_gpu_hours == pytest.approx(run.gpu_hours)
    # Three spans of the run, each read from its sources in its own proportions.
    cuts = [0, steps // 5, steps // 2, steps]
    weights = [{"web": 3, "code": 1}, {"web": 1, "books": 1}, {"books": 2, "code": 5}]
    parts = [(pricing.steps(lo, hi, run=f"[{lo}, {hi})"), w) for lo, hi, w in zip(cuts, cuts[1:], weights)]
    assert all(part.startup_seconds == startup for part, _ in parts)  # each priced alone has its start-up...
    split = cost.split_cost(parts)
    assert [name for name, _, _ in split] == ["web", "code", "books"]
    # ...but the sources' hours add up to the run's steps, the start-up once beside them.
    assert sum(hours for _, _, hours in split) == pytest.approx(run.steps_gpu_hours, rel=1e-9)
    assert sum(hours for _, _, hours in split) + run.startup_gpu_hours == pytest.approx(run.gpu_hours, rel=1e-9)
    assert sum(hours for _, _, hours in split) < sum(part.gpu_hours for part, _ in parts)  # 3 start-ups there
    assert sum(flops for _, flops, _ in split) == pytest.approx(run.flops, rel=1e-9)
    first, second, _ = parts
    web = dict((name, hours) for name, _, hours in split)["web"]
    assert web == pytest.approx(first[0].steps_gpu_hours * 3 / 4 + second[0].steps_gpu_hours / 2)
    # The save cadence is the steps' time: 1000 steps of it, not a start-up more.
    from megatron_ext.training.dry_run import save_cadence

    from dataclasses import replace

    saving = replace(config, checkpoint=replace(config.checkpoint, save="/tmp/x", save_interval=1000,
                                                save_interval_minutes=None))
    line = save_cadence(saving, run.step_seconds)
    assert cost.hours(1000 * run.step_seconds) in line
    # Unknown speeds stay unknown.
    cpu = cost.RunPricing(config=config, flops=partial(phase_flops, config), gpus=1, gpus_per_node=8,
                          speeds=cost.SpeedTable(kind=cost.CPU, measured=measured_speeds.MeasuredSpeeds()))
    unknown = cpu.steps(run="r")
    assert unknown.step_seconds is None and unknown.startup_gpu_hours is None
    assert [hours for _, _, hours in cost.split_cost([(unknown, {"web": 1})])] == [None]
