"""The paper recipes' GPU defaults follow the committed GPU measurements (benchmarks/recipe_defaults.py):
the committed table is what the committed visits give, the size recipes set what it says, and the
rule picks the fastest configuration among those whose ``gpu`` tests passed."""

from __future__ import annotations

import copy
import json
import runpy
from pathlib import Path

import pytest

import pretrain_encoder

REPO = Path(__file__).resolve().parents[2]
defaults = runpy.run_path(str(REPO / "benchmarks" / "recipe_defaults.py"), run_name="recipe_defaults")


def test_committed_table_is_what_the_committed_visits_give():
    table = defaults["decide"]()
    assert json.loads(defaults["TABLE_JSON"].read_text()) == table
    assert defaults["TABLE_MD"].read_text() == defaults["render_markdown"](table)
    # The 2026-11-26 H200 row: the local spec (58,609 tok/s) over the TE spec (48,308) at 1B.
    one_b = table["sizes"]["1b"]["model.transformer_impl"]
    assert one_b["value"] == "local" and one_b["source"] == "measured"
    assert [c["value"] for c in one_b["candidates"]] == ["local", "te"]
    assert 0.36 < one_b["candidates"][0]["mfu"] < 0.37


def test_size_recipes_set_what_the_table_says():
    assert defaults["disagreements"](defaults["decide"]()) == []


def test_a_recipe_that_drifts_from_the_table_is_named():
    table = copy.deepcopy(defaults["decide"]())
    table["sizes"]["610m"]["model.transformer_impl"]["value"] = "te"
    (problem,) = defaults["disagreements"](table)
    assert problem.startswith("examples/recipes/base/610m.yaml: model.transformer_impl is 'local'")


def _visit(root: Path, name: str, *, tests_passed: bool, sides: dict[str, tuple[float, dict]]) -> None:
    """A suite visit folder as benchmarks/gpu_suite.py writes it: a gpu test stage and one throughput
    stage whose sides recorded their settings."""
    records = [{"row": "1b seq 2048 bf16", "side": side, "tokens_per_s": speed, "settings": settings,
                "flops_per_token": 6.0e9} for side, (speed, settings) in sides.items()]
    stages = [{"name": "gpu_tests", "status": "passed" if tests_passed else "failed", "figures": {}},
              {"name": "throughput_1b_bf16", "status": "passed", "figures": {"rows": [], "sides": records}}]
    (root / name).mkdir()
    (root / name / "summary.json").write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "commit": name[-7:],
                                                          "stages": stages}))


def test_the_newest_visit_with_passing_gpu_tests_decides(tmp_path):
    local, te, te_graphs = ({"transformer_impl": "local", "cuda_graphs": None},
                            {"transformer_impl": "te", "cuda_graphs": None},
                            {"transformer_impl": "te", "cuda_graphs": "megatron"})
    _visit(tmp_path, "h100-2026-12-01", tests_passed=True,
           sides={"megatron_ext": (50_000.0, local), "te_spec": (40_000.0, te)})
    # Newer and faster with the TE spec under CUDA graphs, but its gpu tests failed: not eligible.
    _visit(tmp_path, "h100-2026-12-02", tests_passed=False,
           sides={"megatron_ext": (50_000.0, local), "te_spec_cuda_graphs": (70_000.0, te_graphs)})
    table = defaults["decide"](tmp_path)
    assert table["sizes"]["1b"]["model.transformer_impl"]["value"] == "local"
    assert table["sizes"]["1b"]["model.transformer_impl"]["visit"] == "h100-2026-12-01"
    assert table["sizes"]["1b"]["training.cuda_graphs"]["source"].startswith("not compared")

    # The same newer visit with passing tests takes both settings: TE and CUDA graphs.
    _visit(tmp_path, "h100-2026-12-02b", tests_passed=True,
           sides={"megatron_ext": (50_000.0, local), "te_spec_cuda_graphs": (70_000.0, te_graphs)})
    table = defaults["decide"](tmp_path)
    for name, value in (("model.transformer_impl", "te"), ("training.cuda_graphs", "megatron")):
        entry = table["sizes"]["1b"][name]
        assert (entry["value"], entry["visit"]) == (value, "h100-2026-12-02b")
    assert table["sizes"]["210m"]["model.transformer_impl"]["source"] == "follows 1b (not timed at 210m)"
    # MFU from the side's own FLOPs per token and the H100's dense bf16 peak.
    assert table["sizes"]["1b"]["model.transformer_impl"]["candidates"][0]["mfu"] == pytest.approx(
        70_000 * 6.0e9 / 989e12, abs=1e-4)


def test_fp8_with_the_recipes_local_default_is_refused_in_one_line(capsys):
    recipe = REPO / "examples" / "recipes" / "paper" / "1b_mlm_40.yaml"
    code = pretrain_encoder.main(["--config", str(recipe), "--dry-run", "--world-size", "8", "--fp8-recipe", "delayed"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].endswith("training.fp8_recipe='delayed' needs model.transformer_impl: te (FP8 matmuls are "
                            "Transformer Engine layers), got 'local': add --transformer-impl te")
    code = pretrain_encoder.main(["--config", str(recipe), "--dry-run", "--world-size", "8", "--fp8-recipe", "delayed",
                          "--transformer-impl", "te"])
    assert code == 0 and "(te layers)" in capsys.readouterr().out
