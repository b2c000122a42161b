"""Decay mixtures and merges in a study file: decay runs branch off their trunk where the decay starts,
a merge's TIES base is the checkpoint where its runs part (kept by its owner), and bad entries are
refused naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megatron_ext.cli import plan_study as cli
from megatron_ext.config_loading import ConfigError
from megatron_ext.performance import cost
from megatron_ext.study.cost import evaluation_cost
from megatron_ext.study.evaluation import evaluation_grids
from megatron_ext.study.plan import plan_study, plan_to_dict
from megatron_ext.study.spec import read_study

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "studies" / "decay_mixtures_merge.yaml"
EN, BG, UK, KO = (f"data/multilingual_sample/{lang}/train_text_document" for lang in ("en", "bg", "uk", "ko"))


def test_the_example_branches_its_decays_off_one_trunk_and_merges_them(tmp_path):
    plan = plan_study(read_study(EXAMPLE), EXAMPLE)
    trunk, uk, ko = "tiny_mlm_30_300", "tiny_mlm_30_decay_uk_300", "tiny_mlm_30_decay_ko_300"
    assert [r.name for r in plan.runs] == [trunk, uk, ko]
    # 300 steps with a 60-step decay: each decay run is the trunk up to step 240 and trains 60 steps.
    assert [(s.run, s.start, s.start_from, s.parent) for s in plan.segments] == [
        (trunk, 0, "scratch", None), (uk, 240, "branch", trunk), (ko, 240, "branch", trunk)]
    assert plan.segment(trunk).saves == (240,)
    trunk_data = {"data_path": [EN, BG], "temperature": 0.7}
    objective = plan.run(trunk).recipe["phases"][0]["objective"]
    assert plan.run(trunk).recipe["phases"] == [{"objective": objective, "steps": 240, **trunk_data},
                                                {"objective": objective, "steps": 60, **trunk_data}]
    assert plan.run(ko).recipe["phases"] == [{"objective": objective, "steps": 240, **trunk_data},
                                             {"objective": objective, "steps": 60, "data_path": [EN, BG, KO],
                                              "temperature": 0.3}]
    uniform, ties = plan.merges
    save = "runs/decay_mixtures_merge/pretrain/{}/checkpoints".format
    assert uniform.name == "tiny_merged_uniform_300" and uniform.base is None
    assert uniform.args() == ["--method", "uniform", save(uk), save(ko), "--out", save("tiny_merged_uniform_300")]
    assert (ties.base_run, ties.base_step, ties.base) == (trunk, 240, save(trunk) + "/iter_0000240")
    assert ties.args()[-6:] == ["--base", save(trunk) + "/iter_0000240", "--density", "0.2", "--lambda", "1.0"]
    as_dict = plan_to_dict(plan)["merges"]
    assert [m["name"] for m in as_dict] == ["tiny_merged_uniform_300", "tiny_merged_ties_300"]
    assert as_dict[1]["parents"] == [uk, ko] and as_dict[1]["base_step"] == 240
    json.dumps(as_dict)
    (grid,) = evaluation_grids(plan)  # the merges are evaluated beside the runs, in their grid
    models = grid.argv[grid.argv.index("--models") + 1:grid.argv.index("--output-dir")]
    assert models == (*(f"{r.name}={save(r.name)}" for r in plan.runs),
                      f"tiny_merged_uniform_300={save('tiny_merged_uniform_300')}",
                      f"tiny_merged_ties_300={save('tiny_merged_ties_300')}")
    # and priced: 5 models x 2 tasks x 3 LRs x 2 seeds
    assert evaluation_cost(plan, speeds=cost.SpeedTable(kind=cost.CPU)).runs == 60


def _write(tmp_path: Path, **fields) -> Path:
    study = {"name": "t", "sizes": [{"name": "610m", "base": str(ROOT / "examples/recipes/base/610m.yaml")}],
             "budgets": [12000, 22000], "objectives": [{"objective": "mlm", "mask_ratio": 0.4}, {"objective": "clm"}],
             "decay_mixtures": {"trunk": {"data_path": ["/d/web"]},
                                "decays": [{"name": "a", "data_path": ["/d/web", "/d/code"], "temperature": 0.5},
                                           {"name": "b", "data_path": ["/d/books"]}]},
             **fields}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    return path


def test_decay_runs_at_every_budget_and_the_ties_base_is_the_trunk_where_they_part(tmp_path, capsys):
    merges = [{"name": "m", "runs": ["mlm_40_decay_a", "mlm_40_decay_b"], "method": "ties", "density": 0.5},
              {"name": "short", "runs": ["mlm_40_decay_a", "mlm_40"], "budget": 12000, "weights": [3, 1]}]
    path = _write(tmp_path, merges=merges)
    plan = plan_study(read_study(path), path)
    assert len(plan.runs) == 2 * 2 * 3
    # The base recipe decays over its last 2,000 steps: the 12K decay runs branch off the 22K trunk
    # at 10,000, where their own decay starts; the 22K ones at 20,000.
    for kind in ("mlm_40_decay_a", "mlm_40_decay_b", "mlm_40"):
        segment = plan.segment(f"610m_{kind}_12k")
        assert (segment.parent, segment.branch_step) == ("610m_mlm_40_22k", 10000)
    ties, short = plan.merges
    assert (ties.name, ties.base_run, ties.base_step) == ("610m_m_22k", "610m_mlm_40_22k", 20000)
    assert ties.parents == ("610m_mlm_40_decay_a_22k", "610m_mlm_40_decay_b_22k")
    assert short.parents == ("610m_mlm_40_decay_a_12k", "610m_mlm_40_12k") and short.base is None
    assert short.args()[-3:] == ["--weights", "3.0", "1.0"]
    assert plan.segment("610m_mlm_40_22k").saves == (10000, 20000)

    assert cli.main([str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert ("  610m_m_22k: ties (density 0.5, lambda 1) of 610m_mlm_40_decay_a_22k, 610m_mlm_40_decay_b_22k, "
            "base 610m_mlm_40_22k at 20,000") in out


@pytest.mark.parametrize("fields, message", [
    ({"merges": [{"name": "m", "runs": ["mlm_40", "mlm_40_decay_c"]}]},
     r"merges\[0\]\.runs: unknown run kind\(s\) \['mlm_40_decay_c'\]; the study's: \['mlm_40', 'mlm_40_decay_a', "),
    ({"merges": [{"name": "m", "runs": ["mlm_40", "clm"], "scale": 2.0}]},
     r"study\.merges\[0\]: scale: TIES's settings; method 'uniform' takes none"),
    ({"merges": [{"name": "m", "runs": ["mlm_40", "clm"], "weights": [1.0]}]},
     r"study\.merges\[0\]: weights: one per run \(2\), got \[1\.0\]"),
    ({"merges": [{"name": "m", "runs": ["mlm_40", "clm"], "method": "ties", "density": 0}]},
     r"study\.merges\[0\]: --density 0\.0: expected a share of each task vector in \(0, 1\]"),
    ({"merges": [{"name": "m", "runs": ["mlm_40"]}]}, r"runs: give at least two run kinds"),
    ({"merges": [{"name": "m", "runs": ["mlm_40", "clm"], "budget": 5}]}, r"merges\[0\]\.budget: 5 is not one of"),
    ({"merges": [{"name": "m", "runs": ["mlm_40", "clm"], "method": "ties"}]},
     r"merges m \(610m_m_22k\), method ties: its runs share no steps"),
    ({"merges": [{"name": "m", "runs": ["mlm_40", "mlm_40_decay_a", "clm_decay_a"], "method": "ties"}]},
     r"must branch off one trajectory at one step .* and 610m_clm_decay_a_22k part at step 0; "
     r"610m_mlm_40_22k and 610m_mlm_40_decay_a_22k part at step 20,000; merge those of one branch step"),
    ({"decay_mixtures": {"trunk": {"data_path": ["/d"], "temperature": 2}, "decays": [{"name": "e", "data_path": ["/e"]}]}},
     r"study\.decay_mixtures\.trunk: temperature: expected a number in \[0, 1\]"),
    ({"decay_mixtures": {"trunk": {"data_path": ["/d"]}, "decays": [{"data_path": ["/e"]}]}},
     r"study\.decay_mixtures: decays\[0\]: give it a name"),
    ({"overrides": {"schedule": {"lr_decay_style": "cosine"}}},
     r"run 610m_mlm_40_12k: decay_mixtures needs schedule\.lr_decay_style: wsd"),
])
def test_bad_merges_and_decays_are_refused_naming_the_key(tmp_path, fields, message):
    path = _write(tmp_path, **fields)
    with pytest.raises(ConfigError, match=message):
        plan_study(read_study(path), path)


def test_a_decay_run_branches_off_the_trunk_of_its_own_objective(tmp_path):
    """The first divergence is the earliest difference: the objectives (from step 0) come before the
    decay mixture's context change (at 20,000)."""
    path = _write(tmp_path)
    plan = plan_study(read_study(path), path)
    assert plan.segment("610m_clm_decay_b_22k").parent == "610m_clm_22k"
