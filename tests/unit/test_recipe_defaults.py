"""The paper recipes' GPU defaults follow the committed GPU measurements (benchmarks/recipe_defaults.py):
the committed table is what the committed visits give, the size recipes set what it says, and the
rule picks the fastest configuration among those whose ``gpu`` tests passed."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from benchmarks import recipe_defaults as defaults
from megatron_ext.cli import pretrain_encoder

REPO = Path(__file__).resolve().parents[2]


def test_committed_table_is_what_the_committed_visits_give():
    table = defaults.decide()
    assert json.loads(defaults.TABLE_JSON.read_text()) == table
    assert defaults.TABLE_MD.read_text() == defaults.render_markdown(table)
    # The 2026-11-27 H100 row (2 micro-batches of 9): the TE spec (67,364 tok/s) over the local spec's
    # fastest side (60,890, with CUDA graphs); its gpu tests ran out of time with none failed.
    one_b = table["sizes"]["1b"]["model.transformer_impl"]
    assert (one_b["value"], one_b["source"], one_b["visit"]) == ("te", "measured", "h100-2026-11-27")
    assert [c["value"] for c in one_b["candidates"]] == ["te", "local"]
    assert 0.42 < one_b["candidates"][0]["mfu"] < 0.43
    assert one_b["gpu_tests"] == "16 passed, none failed, the rest not finished (stopped at its time limit)"
    graphs = table["sizes"]["1b"]["training.cuda_graphs"]
    assert graphs["value"] == "none" and [c["value"] for c in graphs["candidates"]] == ["none", "megatron"]


def test_size_recipes_set_what_the_table_says():
    assert defaults.disagreements(defaults.decide()) == []


def test_a_recipe_that_drifts_from_the_table_is_named():
    table = copy.deepcopy(defaults.decide())
    table["sizes"]["610m"]["model.transformer_impl"]["value"] = "local"
    (problem,) = defaults.disagreements(table)
    assert problem.startswith("examples/recipes/base/610m.yaml: model.transformer_impl is 'te'")


def _visit(root: Path, name: str, *, tests_passed: bool, sides: dict[str, tuple[float, dict]],
           tests_stage: dict | None = None) -> None:
    """A suite visit folder as benchmarks/gpu_suite.py writes it: a gpu test stage (``tests_stage``, or
    one that passed or failed) and one throughput stage whose sides recorded their settings."""
    records = [{"row": "1b seq 2048 bf16", "side": side, "tokens_per_s": speed, "settings": settings,
                "flops_per_token": 6.0e9} for side, (speed, settings) in sides.items()]
    tests_stage = tests_stage or {"name": "gpu_tests", "status": "passed" if tests_passed else "failed",
                                  "exit_code": 0 if tests_passed else 1, "reason": None, "figures": {}}
    stages = [tests_stage, {"name": "throughput_1b_bf16", "status": "passed", "exit_code": 0, "reason": None,
                            "figures": {"rows": [], "sides": records}}]
    (root / name).mkdir()
    (root / name / "summary.json").write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "commit": name[-7:],
                                                          "budget_s": 600, "elapsed_s": 590, "stages": stages}))


def test_the_newest_visit_with_passing_gpu_tests_decides(tmp_path):
    local, te, te_graphs = ({"transformer_impl": "local", "cuda_graphs": None},
                            {"transformer_impl": "te", "cuda_graphs": None},
                            {"transformer_impl": "te", "cuda_graphs": "megatron"})
    _visit(tmp_path, "h100-2026-12-01", tests_passed=True,
           sides={"megatron_ext": (50_000.0, local), "te_spec": (40_000.0, te)})
    # Newer and faster with the TE spec under CUDA graphs, but its gpu tests failed: not eligible.
    _visit(tmp_path, "h100-2026-12-02", tests_passed=False,
           sides={"megatron_ext": (50_000.0, local), "te_spec_cuda_graphs": (70_000.0, te_graphs)})
    table = defaults.decide(tmp_path)
    assert table["sizes"]["1b"]["model.transformer_impl"]["value"] == "local"
    assert table["sizes"]["1b"]["model.transformer_impl"]["visit"] == "h100-2026-12-01"
    assert table["sizes"]["1b"]["training.cuda_graphs"]["source"].startswith("not compared")

    # The same newer visit with passing tests takes both settings: TE and CUDA graphs.
    _visit(tmp_path, "h100-2026-12-02b", tests_passed=True,
           sides={"megatron_ext": (50_000.0, local), "te_spec_cuda_graphs": (70_000.0, te_graphs)})
    table = defaults.decide(tmp_path)
    for name, value in (("model.transformer_impl", "te"), ("training.cuda_graphs", "megatron")):
        entry = table["sizes"]["1b"][name]
        assert (entry["value"], entry["visit"]) == (value, "h100-2026-12-02b")
    assert table["sizes"]["210m"]["model.transformer_impl"]["source"] == "follows 1b (not timed at 210m)"
    # MFU from the side's own FLOPs per token and the H100's dense bf16 peak.
    assert table["sizes"]["1b"]["model.transformer_impl"]["candidates"][0]["mfu"] == pytest.approx(
        70_000 * 6.0e9 / 989e12, abs=1e-4)


def test_a_gpu_test_stage_that_ran_out_of_time_counts_only_without_a_failure(tmp_path):
    """A visit whose gpu tests stopped at their time limit decides only if none of those that ran
    failed (the 2026-11-27 H100 visit: 16 passed, the rest not reached)."""
    local, te = {"transformer_impl": "local", "cuda_graphs": None}, {"transformer_impl": "te", "cuda_graphs": None}
    out_of_time = {"name": "gpu_tests", "status": "timed_out", "exit_code": 124, "reason": "stopped itself",
                   "figures": {"counts": {"passed": 5, "unfinished": 1}, "collected": 9, "collection_errors": []}}
    _visit(tmp_path, "h100-2026-12-01", tests_passed=True, sides={"megatron_ext": (50_000.0, local), "te_spec": (40_000.0, te)})
    _visit(tmp_path, "h100-2026-12-02", tests_passed=False, tests_stage=out_of_time,
           sides={"megatron_ext": (50_000.0, local), "te_spec": (60_000.0, te)})
    entry = defaults.decide(tmp_path)["sizes"]["1b"]["model.transformer_impl"]
    assert (entry["value"], entry["visit"]) == ("te", "h100-2026-12-02")
    assert entry["gpu_tests"] == "5 of 9 passed, none failed, 4 not finished (stopped at its time limit)"
    out_of_time["figures"]["counts"]["failed"] = 1  # one that ran failed: the older visit decides
    _visit(tmp_path, "h100-2026-12-03", tests_passed=False, tests_stage=out_of_time,
           sides={"megatron_ext": (50_000.0, local), "te_spec": (60_000.0, te)})
    (tmp_path / "h100-2026-12-02" / "summary.json").unlink()
    entry = defaults.decide(tmp_path)["sizes"]["1b"]["model.transformer_impl"]
    assert (entry["value"], entry["visit"], entry["gpu_tests"]) == ("local", "h100-2026-12-01", "passed")


def test_a_failure_in_any_gpu_test_stage_or_a_tie_within_the_noise_keeps_the_default(tmp_path):
    local, te = {"transformer_impl": "local", "cuda_graphs": None}, {"transformer_impl": "te", "cuda_graphs": None}
    _visit(tmp_path, "h100-2026-12-01", tests_passed=True, sides={"megatron_ext": (50_000.0, local), "te_spec": (40_000.0, te)})
    # Its full gpu_tests stage passed, but the fusion tests' stage saw a failure: the visit decides nothing.
    visit = tmp_path / "h100-2026-12-02"
    _visit(tmp_path, visit.name, tests_passed=True, sides={"megatron_ext": (50_000.0, local), "te_spec": (60_000.0, te)})
    summary = json.loads((visit / "summary.json").read_text())
    summary["stages"].append({"name": "gpu_tests_fusions", "status": "failed", "exit_code": 1, "reason": None,
                              "figures": {"counts": {"failed": 1}}})
    (visit / "summary.json").write_text(json.dumps(summary))
    assert defaults.decide(tmp_path)["sizes"]["1b"]["model.transformer_impl"]["visit"] == "h100-2026-12-01"
    # Faster by less than the timing noise: the trainer's default (local) stands, and the table says why.
    _visit(tmp_path, "h100-2026-12-03", tests_passed=True,
           sides={"megatron_ext": (50_000.0, local), "te_spec": (51_000.0, te)})
    entry = defaults.decide(tmp_path)["sizes"]["1b"]["model.transformer_impl"]
    assert (entry["value"], entry["visit"]) == ("local", "h100-2026-12-03")
    assert entry["source"].startswith("measured: within the timing noise (3 %)")
    assert [c["value"] for c in entry["candidates"]] == ["te", "local"]


def test_fp8_needs_the_te_spec_and_a_local_one_is_refused_in_one_line(capsys):
    recipe = REPO / "examples" / "recipes" / "paper" / "1b_mlm_40.yaml"
    code = pretrain_encoder.main(["--config", str(recipe), "--dry-run", "--world-size", "8", "--fp8-format", "hybrid",
                                  "--transformer-impl", "local"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].endswith("training.fp8_format='hybrid' (FP8) needs model.transformer_impl: te (FP8 matmuls are "
                            "Transformer Engine layers), got 'local': add --transformer-impl te")
    # The recipes' measured default is the TE spec: FP8 is one flag, Megatron-LM's.
    code = pretrain_encoder.main(["--config", str(recipe), "--dry-run", "--world-size", "8", "--fp8-format", "hybrid"])
    assert code == 0 and "(te layers)" in capsys.readouterr().out


def test_device_kinds_that_disagree_at_the_recipe_shape_need_a_default_each(tmp_path):
    """One default serves every device kind when the kinds agree at the size recipe's micro-batch, or
    when the one that disagrees measured another shape (not comparable: its next visit re-times it);
    kinds that disagree at the recipe's own shape fail ``--check``, naming both."""
    micro = defaults._recipe_micro_batch("1b")
    local, te = ({"transformer_impl": "local", "cuda_graphs": None, "micro_batch_size": micro},
                 {"transformer_impl": "te", "cuda_graphs": None, "micro_batch_size": micro})
    _visit(tmp_path, "h100-2026-12-01", tests_passed=True, sides={"megatron_ext": (60_000.0, te), "local_spec": (50_000.0, local)})
    stale = {k: v for k, v in local.items() if k != "micro_batch_size"}
    _visit(tmp_path, "h200-2026-12-02", tests_passed=True,
           sides={"megatron_ext": (40_000.0, {**te, "micro_batch_size": None}), "local_spec": (55_000.0, stale)})
    entry = defaults.decide(tmp_path)["device_kinds"]["1b"]["model.transformer_impl"]
    assert entry["one_value_serves"] and "h200's comparison (local, h200-2026-12-02)" in entry["why"]
    assert "not comparable" in entry["why"]
    _visit(tmp_path, "h200-2026-12-03", tests_passed=True,
           sides={"megatron_ext": (40_000.0, te), "local_spec": (55_000.0, local)})
    table = defaults.decide(tmp_path)
    entry = table["device_kinds"]["1b"]["model.transformer_impl"]
    assert not entry["one_value_serves"]
    assert entry["kinds"]["h100"]["value"] == "te" and entry["kinds"]["h200"]["value"] == "local"
    problems = defaults.disagreements(table)
    assert any(p.startswith("1b: model.transformer_impl: the device kinds disagree at the recipe's micro-batch")
               for p in problems)
