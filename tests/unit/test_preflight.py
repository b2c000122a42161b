"""One pre-flight (``training.preflight``): the run, ``--dry-run`` and the study planner reach the same
checks, so the same bad recipe is refused by each in the same line; and who runs which."""

from __future__ import annotations

import pytest
import yaml

from megatron_ext.cli import pretrain_encoder
from helpers import tiny_recipe
from megatron_ext.cli import plan_study
from megatron_ext.config_loading import UserError
from megatron_ext.training.layout import check_layout
from megatron_ext.training.preflight import Caller, preflight
from megatron_ext.training.recipe import run_config_from_dict

FAKE = {"tokenizer": "/nonexistent/tok", "data": "/nonexistent/data_text_document"}

BAD = [
    # the layout (check 3): the model does not split over the pipeline, whatever the world size
    pytest.param({"model": {"num_layers": 3}, "parallel": {"pipeline_model_parallel_size": 2}},
                 "pipeline_model_parallel_size=2 must divide num_layers=3", id="layout"),
    # the config (check 1): a CUDA-graph rule across sections
    pytest.param({"training": {"train_iters": 8, "cuda_graphs": "megatron"},
                  "parallel": {"pipeline_model_parallel_size": 2}},
                 "training.cuda_graphs='megatron' with parallel.pipeline_model_parallel_size=2", id="config"),
]


def _error(err: str) -> str:
    lines = [line for line in err.splitlines() if ": error: " in line]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("sections, message", BAD)
def test_the_run_the_dry_run_and_the_study_planner_refuse_a_bad_recipe_in_the_same_line(
        tmp_path, tiny_corpus, capsys, monkeypatch, sections, message):
    recipe = tiny_recipe(tiny_corpus, tmp_path, **sections)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    monkeypatch.setenv("WORLD_SIZE", "2")  # the run's world: TP 1 x PP 2 divides it

    assert pretrain_encoder.main(["--config", str(path)]) == 2  # the run: refused before anything starts
    run = _error(capsys.readouterr().err)
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "log").exists()

    assert pretrain_encoder.main(["--config", str(path), "--dry-run", "--world-size", "2"]) == 2
    dry_run = _error(capsys.readouterr().err)

    base = {key: value for key, value in recipe.items() if key != "phases"}  # a study's base sets no phases
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    study = {"name": "t", "sizes": [{"name": "tiny", "base": str(tmp_path / "base.yaml")}], "budgets": [8],
             "objectives": [{"objective": "clm"}]}
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(study))
    assert plan_study.main([str(tmp_path / "study.yaml"), "--dry-run"]) == 2
    planner = _error(capsys.readouterr().err)

    for line in (run, dry_run, planner):
        assert line.endswith(message) or message + ":" in line, (line, message)
    assert run.split(": error: ")[1] == dry_run.split(": error: ")[1]
    assert planner.endswith(run.split(": error: ")[1])  # after the study file and the run it names


def test_each_caller_runs_its_checks(tmp_path):
    """The planner checks the model's split without a world size; the dry run says what this machine
    lacks (paths, tokenizer) in lines instead of refusing; a caller that needs a world size says so."""
    config = run_config_from_dict(tiny_recipe(FAKE, tmp_path))
    assert preflight(config, Caller.STUDY_PLAN).data_parallel is None
    assert check_layout(config, None) is None and check_layout(config, 2) == 2
    found = preflight(config, Caller.DRY_RUN, world_size=1)
    assert found.data_parallel == 1 and found.memory.startswith("memory/rank")
    assert [line.split(":")[0] for line in found.lines] == ["paths", "tokenizer"]
    assert all("NOT READY, a run would stop here" in line for line in found.lines), found.lines
    with pytest.raises(ValueError, match="needs a world size"):
        preflight(config, Caller.DRY_RUN)
    with pytest.raises(UserError, match=r"data\.data_path: "):  # the run refuses what the dry run said
        preflight(config, Caller.RUN_BEFORE_PROCESS_GROUP, world_size=1)
    three_layers = run_config_from_dict(tiny_recipe(FAKE, tmp_path, model={"num_layers": 3},
                                                   parallel={"pipeline_model_parallel_size": 2}))
    with pytest.raises(UserError, match="pipeline_model_parallel_size=2 must divide num_layers=3"):
        preflight(three_layers, Caller.STUDY_PLAN)


def test_the_module_states_every_check_and_caller():
    """The docstring is the list: every caller, and every check this module runs, is named in it."""
    import megatron_ext.training.preflight as module

    doc = module.__doc__
    for caller in Caller:
        assert caller.name in doc or caller.value in doc, caller
    for check in ("check_paths", "layout.check_layout", "layout.model_parallel_problem", "check_machine", "check_save_space",
                  "check_run_fits", "memory_report", "check_tokenizer_serves", "check_data_tokenizer",
                  "machine_problem", "run_problem", "training_problem", "check_sources", "plan_source_reads",
                  "check_enough_data", "train_split_tokens", "check_source", "check_split_blends", "read_index",
                  "check_token_dtype", "scan_token_ids"):
        assert check in doc, check
