"""Study files and the planner: the paper's 610M grid as a tree of exact branches, the shared-prefix
check a trainer reuses before a branch, errors that name the key, and ``plan_study.py --dry-run``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from megatron_ext.cli import plan_study as cli
from megatron_ext.config_loading import ConfigError
from megatron_ext.study.plan import plan_study, plan_to_dict
from megatron_ext.study.spec import read_study
from megatron_ext.training.branching import check_branch, first_divergence, shared_steps
from megatron_ext.training.recipe import read_recipe, run_config_from_dict

ROOT = Path(__file__).resolve().parents[2]
STUDIES = ROOT / "examples" / "studies"
GRID = STUDIES / "paper_610m.yaml"
SIZES = STUDIES / "paper_sizes.yaml"
TOKENS_PER_STEP = 1152 * 2048


@pytest.fixture(scope="module")
def grid():
    return plan_study(read_study(GRID), GRID)


def _expected_grid() -> dict[str, tuple[int, int, str, str | None, int | None]]:
    """``run: (start, end, start_from, parent, branch_step)`` of the 610M grid, by hand.

    The base recipe: WSD with W = 2,000 warmup and D = 2,000 decay steps; Megatron's first lowered
    rate is one step past the decay start (``lr_at(B - D) = lr``, ``lr_at(B - D + 1) < lr``).

    - MLM-r and CLM at 12K/22K share 10,001/20,001 steps with the 42K run and branch where their
      decay starts: 10,000 and 20,000. Each trains [B - D, B) = 2,000 steps.
    - Biphasic with CLM share s at budget B is CLM up to s x B (resolve_phases at B), all before
      any decay: 25 %: 3,000 / 5,500 / 10,500; 50 %: 6,000 / 11,000 / 21,000; 75 %: 9,000 /
      16,500 / 31,500. The CLM 42K run trains every one of those steps, so each branches off it.
    - CPT +22K starts from the final weights (step 42,000) of CLM-42K and of MLM-40-42K; +12K shares
      its stable trunk up to 10,000; +2K warms up over 200 steps (lr_at(1) = 2.5e-6 against 2.5e-7
      for the 2,000-step warmup), so it shares step 0 only and starts from the source's weights.
    """
    runs = {}
    for kind in ("mlm_20", "mlm_30", "mlm_40", "mlm_50", "clm"):
        trunk = f"610m_{kind}_42k"
        runs[trunk] = (0, 42000, "scratch", None, None)
        runs[f"610m_{kind}_22k"] = (20000, 22000, "branch", trunk, 20000)
        runs[f"610m_{kind}_12k"] = (10000, 12000, "branch", trunk, 10000)
    for split, share in (("25_75", 0.25), ("50_50", 0.5), ("75_25", 0.75)):
        for budget in (12000, 22000, 42000):
            switch = int(share * budget)
            runs[f"610m_biphasic_{split}_{budget // 1000}k"] = (switch, budget, "branch", "610m_clm_42k", switch)
    for source in ("610m_clm_42k", "610m_mlm_40_42k"):
        runs[f"{source}_cpt_mlm_40_22k"] = (0, 22000, "weights", source, 42000)
        runs[f"{source}_cpt_mlm_40_12k"] = (10000, 12000, "branch", f"{source}_cpt_mlm_40_22k", 10000)
        runs[f"{source}_cpt_mlm_40_2k"] = (0, 2000, "weights", source, 42000)
    return runs


def test_the_610m_grid_as_a_tree(grid):
    """30 runs (12 MLM, 3 CLM, 9 biphasic, 6 CPT). Steps as separate runs: 4 x (12K + 22K + 42K)
    MLM + 76K CLM + 3 x 76K biphasic + 2 x (2K + 12K + 22K) CPT = 304K + 76K + 228K + 72K = 680,000.
    In the tree: MLM 4 x (42K + 2K + 2K) = 184K; CLM 46K; biphasic sum of (1 - s) x B =
    0.75 x 76K + 0.5 x 76K + 0.25 x 76K = 114K; CPT 2 x (22K + 2K + 2K) = 52K: 396,000. Saved 284,000
    steps (41.8 %), x 2,359,296 tokens per step = 670,040,064,000 tokens."""
    expected = _expected_grid()
    assert len(grid.runs) == 30 and {r.name for r in grid.runs} == set(expected)
    got = {s.run: (s.start, s.end, s.start_from, s.parent, s.branch_step) for s in grid.segments}
    assert got == expected
    assert grid.steps_separate == 680_000
    assert grid.steps_tree == 396_000
    assert grid.tokens_separate - grid.tokens_tree == 284_000 * TOKENS_PER_STEP == 670_040_064_000
    for run in grid.runs:
        assert grid.segment(run.name).steps == run.train_iters - grid.segment(run.name).start
    # Every step a child starts from is saved and kept by its parent (a CPT's: the final one).
    assert grid.segment("610m_clm_42k").saves == (3000, 5500, 6000, 9000, 10000, 10500, 11000, 16500, 20000,
                                                   21000, 31500, 42000)
    assert grid.segment("610m_mlm_40_42k").saves == (10000, 20000, 42000)
    assert grid.segment("610m_mlm_20_42k").saves == (10000, 20000)
    assert grid.segment("610m_clm_42k_cpt_mlm_40_22k").saves == (10000,)
    assert grid.segment("610m_clm_12k").saves == ()
    # The exact shared prefix is one step past the decay start; a phase switch is exact.
    assert grid.segment("610m_clm_12k").shared_steps == 10001
    assert grid.segment("610m_biphasic_25_75_42k").shared_steps == 10500
    # With one machine per segment: CLM 42K then CPT +22K is the longest chain either way; waiting
    # for the parent to finish delays biphasic 25/75 at 42K to 42K + 31.5K.
    assert grid.wall_steps("separate") == 64000
    assert grid.wall_steps("checkpoint") == 64000
    assert grid.wall_steps("parent_done") == 73500


def test_the_recipes_train_the_tree(grid):
    """Each run's recipe names where its segment starts (a branch: its parent's save and the step)
    and what it keeps for its children, its config is that recipe, and each branch passes the
    check the trainer makes before it loads the parent's checkpoint."""
    recipes = {run["name"]: run["recipe"] for run in plan_to_dict(grid)["runs"]}
    for segment in grid.segments:
        run = grid.run(segment.run)
        checkpoint = recipes[run.name]["checkpoint"]
        assert run.recipe is recipes[run.name] and run_config_from_dict(run.recipe) == run.config
        assert checkpoint.get("keep_steps", []) == list(segment.saves) == list(run.config.checkpoint.keep_steps)
        if segment.start_from == "branch":
            parent = grid.run(segment.parent)
            assert (checkpoint["branch_from"], checkpoint["branch_step"]) == (
                parent.recipe["checkpoint"]["save"], segment.branch_step)
            assert segment.branch_step in parent.config.checkpoint.keep_steps
            check_branch(parent.config, run.config, segment.branch_step)
        else:
            assert "branch_from" not in checkpoint and run.config.checkpoint.branch_from is None
    assert recipes["610m_biphasic_25_75_42k"]["checkpoint"] == {
        "save": "/checkpoints/paper/610m_biphasic_25_75_42k", "save_interval": 1000, "async_save": True,
        "optimizer_format": "dp_reshardable", "branch_from": "/checkpoints/paper/610m_clm_42k", "branch_step": 10500}
    cpt12 = recipes["610m_clm_42k_cpt_mlm_40_12k"]["checkpoint"]  # a CPT branching off its sibling CPT
    assert (cpt12["load"], cpt12["finetune"], cpt12["branch_from"], cpt12["branch_step"]) == (
        "/checkpoints/paper/610m_clm_42k", True, "/checkpoints/paper/610m_clm_42k_cpt_mlm_40_22k", 10000)
    assert recipes["610m_clm_42k"]["checkpoint"]["keep_steps"][-1] == 42000  # the CPT sources' weights


def test_planned_runs_are_the_shipped_recipes(grid):
    """A run of the study is the paper recipe of the same name, output paths aside."""
    for run, recipe in (("610m_biphasic_25_75_42k", "610m_biphasic_25_75"), ("610m_clm_42k", "610m_clm"),
                        ("610m_mlm_40_42k", "610m_mlm_40")):
        shipped = run_config_from_dict(read_recipe(ROOT / "examples" / "recipes" / "paper" / f"{recipe}.yaml"))
        planned = grid.run(run).config
        assert first_divergence(shipped, planned) is None
        assert shared_steps(shipped, planned) == 42000
    cpt = grid.run("610m_clm_42k_cpt_mlm_40_2k").recipe
    assert (cpt["checkpoint"]["load"], cpt["checkpoint"]["finetune"], cpt["checkpoint"]["save"]) == (
        "/checkpoints/paper/610m_clm_42k", True, "/checkpoints/paper/610m_clm_42k_cpt_mlm_40_2k")
    assert cpt["schedule"]["lr_warmup_iters"] == 200 and cpt["training"]["train_iters"] == 2000


def test_the_branch_check_refuses_schedules_that_differ_before_the_branch(grid):
    config = {r.name: r.config for r in grid.runs}
    clm42, clm12 = config["610m_clm_42k"], config["610m_clm_12k"]
    check_branch(clm42, clm12, 10000)
    check_branch(clm42, clm12, 10001)  # lr_at(10000) is still the stable rate in both
    with pytest.raises(ConfigError, match=r"step 10001: learning rate 0\.0005 \(train_iters 42000, decay "
                                          r"from step 40000\) vs 0\.0004997\d* \(train_iters 12000, decay from "
                                          r"step 10000\)") as err:
        check_branch(clm42, clm12, 10002)
    assert "cannot branch at step 10002" in str(err.value)
    # The phase list is the same (shares 0.25/0.75); its steps depend on train_iters.
    bi12, bi42 = config["610m_biphasic_25_75_12k"], config["610m_biphasic_25_75_42k"]
    check_branch(clm42, bi42, 10500)
    with pytest.raises(ConfigError, match=r"step 10500: phase clm \(steps 0-41999\) vs mlm 0\.4"):
        check_branch(clm42, bi42, 10501)
    with pytest.raises(ConfigError, match=r"step 3000: phase mlm 0\.4 \(steps 3000-11999\) vs clm \(steps 0-10499\)"):
        check_branch(bi12, bi42, 4000)
    # A continued pretraining with a shorter warmup: only step 0 (at learning rate 0) is shared.
    cpt22, cpt2 = config["610m_clm_42k_cpt_mlm_40_22k"], config["610m_clm_42k_cpt_mlm_40_2k"]
    assert shared_steps(cpt22, cpt2) == 1
    with pytest.raises(ConfigError, match=r"step 1: learning rate"):
        check_branch(cpt22, cpt2, 2)
    # The run definition: another seed, or another start, differs from step 0.
    other_seed = dataclasses.replace(clm12, training=dataclasses.replace(clm12.training, seed=7))
    with pytest.raises(ConfigError, match=r"training\.seed: 1234 vs 7"):
        check_branch(clm42, other_seed, 10000)
    with pytest.raises(ConfigError, match=r"start: 'from scratch' vs 'weights of /checkpoints/paper/610m_clm_42k'"):
        check_branch(clm42, cpt22, 100)
    # The sample order, where the caller can tell it from the datasets.
    with pytest.raises(ConfigError, match=r"sample order at train_iters 42000 \(2\) vs 12000 \(1\)"):
        check_branch(clm42, clm12, 10000, data_order=lambda c: 1 + (c.training.train_iters > 30000))
    check_branch(clm42, clm12, 10000, data_order=lambda c: 1)
    # Outside the parent's or the child's steps.
    with pytest.raises(ConfigError, match=r"leaves the child nothing to train"):
        check_branch(clm42, clm12, 12000)
    with pytest.raises(ConfigError, match=r"past the parent's last step"):
        check_branch(clm12, clm42, 12001)


def _write(tmp_path: Path, study: dict) -> Path:
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    return path


def _minimal() -> dict:
    return {"name": "t", "sizes": [{"name": "610m", "base": str(ROOT / "examples/recipes/base/610m.yaml")}],
            "budgets": [12000], "objectives": [{"objective": "clm"}]}


@pytest.mark.parametrize("change, message", [
    (lambda s: s.update(budget=s.pop("budgets")),
     r"study\.yaml: study: unknown key\(s\) \['budget'\] \(did you mean 'budgets'\?\); valid keys: \['biphasic', 'budgets', 'cpt', "),
    (lambda s: s.update(cpt={"sources": ["clm"], "continuations": [{"step": 2000}]}),
     r"study\.cpt\.continuations\[0\]: unknown key\(s\) \['step'\] \(did you mean 'steps'\?\); valid keys: \['overrides', 'steps'\]"),
    (lambda s: s.update(cpt={"sources": ["mlm_40"], "continuations": [{"steps": 2000}]}),
     r"cpt\.sources: unknown run kind\(s\) \['mlm_40'\]; the study's: \['clm'\]"),
    (lambda s: s.update(overrides={"training": {"train_iters": 5}}),
     r"overrides\.training\.train_iters: set by the study"),
    (lambda s: s.update(overrides={"trainig": {}}), r"overrides: unknown section\(s\) \['trainig'\]"),
    (lambda s: s.update(overrides={"optimizer": {"adam_beta": 0.9}}),
     r"run 610m_clm_12k: optimizer: unknown key\(s\) \['adam_beta'\]"),
    (lambda s: s["objectives"].append({"objective": "mlm"}), r"study\.objectives\[1\]: missing required key\(s\) \['mask_ratio'\]"),
    (lambda s: s["objectives"].append({"objective": {"name": "mlm", "mask_ratio": 1.5}}),
     r"study\.objectives\[1\]\.objective: mask_ratio must be in \(0, 1\), got 1\.5"),
    (lambda s: s.update(output={"save": "/ckpt/{name}"}), r"study\.output: save: unknown placeholder\(s\) \['name'\]"),
    (lambda s: s.update(budgets=[3000]), r"run 610m_clm_3k: schedule: lr_warmup_iters \+ lr_wsd_decay_iters"),
    (lambda s: s["sizes"][0].update(base="nope.yaml"), r"sizes\[0\]\.base: .*nope\.yaml: no such recipe"),
    (lambda s: s["sizes"][0].update(base=str(ROOT / "examples/recipes/paper/610m_clm.yaml")),
     r"sizes\[0\]\.base: .*610m_clm\.yaml sets phases"),
])
def test_a_bad_study_file_names_the_key(tmp_path, change, message):
    study = _minimal()
    change(study)
    path = _write(tmp_path, study)
    with pytest.raises(ConfigError, match=message):
        plan_study(read_study(path), path)


def test_the_tool_prints_the_totals_and_refuses_bad_files(tmp_path, capsys):
    assert cli.main([str(GRID), "--dry-run", "--plan-json", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "├── 610m_biphasic_25_75_12k" in out and "keeps 3,000 5,500 6,000 9,000 10,000" in out
    assert "  total                             680,000      396,000" in out
    assert "separate runs:     680,000 steps  1,604,321,280,000 (1.60T) tokens" in out
    assert "saved:             284,000 steps  670,040,064,000 (670.04B) tokens  (41.8 % of the steps)" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert len(plan["runs"]) == len(plan["segments"]) == 30
    assert plan["totals"]["steps_tree"] == 396_000

    assert cli.main([str(SIZES), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "12 runs (210m, 610m, 1b)" in out
    assert "saved:              94,500 steps  222,953,472,000 (222.95B) tokens  (18.8 % of the steps)" in out

    study = _minimal()
    study["budgets"] = "twelve"
    assert cli.main([str(_write(tmp_path, study)), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "study.budgets[0]: expected an integer, got 'twelve'" in err
