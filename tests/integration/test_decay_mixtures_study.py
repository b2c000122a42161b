"""A study of decay branches and their merges, trained, merged and evaluated by ``tools/run_study.py``
with the local launcher: examples/studies/decay_mixtures_merge.yaml at a few steps on the multilingual
sample built here. The trunk reads English and Bulgarian, each decay run is the trunk up to its decay
start and then reads a mix with another language; both decays are merged (uniform, and TIES against
the trunk checkpoint where they part, which the trunk keeps); the merges are evaluated beside the runs
and sit in the report as other models; a rerun finds everything done."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from megatron_ext.checkpoint.merge import PROVENANCE
from megatron_ext.checkpoint.reader import Checkpoint
from megatron_ext.cli import run_study as cli
from megatron_ext.study.plan import plan_study
from megatron_ext.study.spec import read_study

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "studies" / "decay_mixtures_merge.yaml"
STEPS, DECAY = 12, 4


def _small(tmp_path: Path, sample: Path) -> Path:
    """The example at 12 steps (a 4-step decay) on ``sample``, one task, one LR, outputs under ``tmp_path``."""
    shutil.copytree(ROOT / "examples" / "recipes" / "base", tmp_path / "examples" / "recipes" / "base")
    study = yaml.safe_load(EXAMPLE.read_text().replace("data/multilingual_sample", str(sample)))
    study["budgets"] = [STEPS]
    study["overrides"]["data"].update(eval_iters=1, data_cache_path=str(tmp_path / "index_cache"))
    study["overrides"].update(schedule={"lr_warmup_iters": 2, "lr_wsd_decay_iters": DECAY},
                              training={"eval_interval": STEPS, "log_interval": 4},
                              checkpoint={"save_interval": 4, "keep_last": 1})
    study["output"] = {"save": str(tmp_path / "pretrain" / "{run}" / "checkpoints"),
                       "log_dir": str(tmp_path / "pretrain" / "{run}")}
    study["evaluation"] = {"tasks": ["rt_sentiment"], "lrs": [1e-3], "seeds": [0], "max_steps": 2, "max_length": 64,
                           "max_eval_examples": 16, "output_dir": str(tmp_path / "eval")}
    path = tmp_path / "examples" / "studies" / "decay_ci.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


@pytest.mark.timeout(900)
def test_decay_branches_are_merged_and_evaluated_beside_their_runs(tmp_path, multilingual_sample, capsys):
    path = _small(tmp_path, multilingual_sample["dir"])
    plan = plan_study(read_study(path), path)
    trunk, uk, ko = (plan.run(f"tiny_mlm_30{kind}_{STEPS}") for kind in ("", "_decay_uk", "_decay_ko"))
    branch = STEPS - DECAY
    assert [(s.run, s.branch_step) for s in plan.segments] == [(trunk.name, None), (uk.name, branch), (ko.name, branch)]
    uniform, ties = plan.merges

    argv = [str(path), "--launcher", "local", "--study-dir", str(tmp_path / "study")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "training: every run complete" in out and f"merge {ties.name}: complete" in out

    # Each decay run trained its own decay from the trunk's checkpoint at the decay start.
    for run in (uk, ko):
        assert Checkpoint.open(run.recipe["checkpoint"]["save"]).step == STEPS
        log = (Path(run.recipe["logging"]["log_dir"]) / "metrics.jsonl").read_text().splitlines()
        assert min(r["step"] for line in log if (r := json.loads(line))["kind"] == "train") > branch
    kept = {Checkpoint(p).step for p in Path(trunk.recipe["checkpoint"]["save"]).glob("iter_*")}
    assert kept == {branch, STEPS}  # keep_last 1 left the branch step: the TIES base

    # The merges: the decays' final checkpoints, TIES against the trunk at the decay start.
    finals = [str((Path(run.recipe["checkpoint"]["save"]) / f"iter_{STEPS:07d}").resolve()) for run in (uk, ko)]
    for merge in (uniform, ties):
        provenance = json.loads((Path(merge.save) / PROVENANCE).read_text())
        assert [p["path"] for p in provenance["parents"]] == finals and provenance["method"] == merge.spec.method
    provenance = json.loads((Path(ties.save) / PROVENANCE).read_text())
    assert provenance["base"] == {"path": str((Path(trunk.recipe["checkpoint"]["save"]) / f"iter_{branch:07d}").resolve()),
                                  "step": branch}
    assert (provenance["density"], provenance["lambda"]) == (0.2, 1.0)

    # Evaluated beside the runs; in the report as other models.
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert sorted(row["model"] for row in summary["results"]) == sorted(
        [r.name for r in plan.runs] + [uniform.name, ties.name])
    report = json.loads((tmp_path / "eval" / "report" / "report.json").read_text())
    assert report["missing"] == []
    assert sorted(m for row in report["other_models"] for m in row["models"]) == sorted([uniform.name, ties.name])

    # A rerun: nothing to train, merge or evaluate again.
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "nothing to run" in out and f"merge {uniform.name}: complete" in out and "submitted" not in out


def test_a_failed_merge_is_run_again_by_the_next_command(tmp_path, capsys):
    """Merges whose runs are not trained fail (the tool names the missing checkpoint), leave nothing,
    and the next command runs them again."""
    from megatron_ext.launch import launcher_class
    from megatron_ext.study.merges import MergeStage, merge_complete
    from megatron_ext.study.state import StudyDir

    study = yaml.safe_load(EXAMPLE.read_text())
    study["sizes"][0]["base"] = str(ROOT / "examples" / "recipes" / "base" / "tiny.yaml")
    study["merges"] = study["merges"][:1]
    study["output"]["save"] = str(tmp_path / "{run}")
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    plan = plan_study(read_study(path), path)
    (merge,) = plan.merges
    launcher = launcher_class("local")()
    for attempt in (1, 2):
        stage = MergeStage(plan, StudyDir(root=tmp_path / "study"), launcher)
        assert stage.run(after=lambda run: None) == 1
        out = capsys.readouterr().out
        assert f"merge {merge.name}: FAILED" in out and "tiny_mlm_30_decay_uk_300" in out
        assert not merge_complete(merge) and not Path(merge.save).exists()
        assert (tmp_path / "study" / "logs" / "merges" / f"{merge.name}.log").read_text().count("=== ") == attempt
