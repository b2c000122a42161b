"""examples/paper_in_miniature end to end at CI size: five pretraining schemes on one budget, the
reference encoder, fine-tuning through the harness, and the comparison it writes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from megatron_ext.checkpoint.handle import Checkpoint

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "paper_in_miniature" / "run.py"


def _example():
    spec = importlib.util.spec_from_file_location("paper_in_miniature_run", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_scheme_gets_the_same_step_budget():
    example = _example()
    for name, stages in example.MODELS.items():
        assert sum(stage.share for stage in stages) == pytest.approx(1.0), name
        assert sum(example.stage_steps(stage, 400) for stage in stages) == 400, name
    cpt_stages = example.MODELS["cpt"]
    assert [s.phases[0]["objective"] for s in cpt_stages] == ["clm", "mlm"]
    assert cpt_stages[1].start_from == cpt_stages[0].name


@pytest.mark.slow  # six pretraining runs and their evaluation
def test_paper_in_miniature_at_ci_size(tmp_path, capsys):
    example = _example()
    out = tmp_path / "mini"
    rc = example.main(["--output-dir", str(out), "--train-iters", "8", "--tasks", "rt_sentiment", "--lrs", "1e-3",
                       "3e-3", "--seeds", "0", "--finetune-steps", "2", "--max-eval-examples", "16",
                       "--workers", "2"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    summary = json.loads((out / "comparison.json").read_text())
    rows = {row["model"]: row for row in summary["rows"]}
    assert list(rows) == ["mlm40", "clm", "biphasic_25_75", "biphasic_50_50", "cpt", example.REFERENCE_MODEL]
    for name, row in rows.items():
        cell = row["tasks"]["rt_sentiment"]
        assert cell["metric"] == "accuracy" and 0.0 <= cell["test_mean"] <= 100.0, name
        if name != example.REFERENCE_MODEL:
            assert cell["best_lr"] in (1e-3, 3e-3) and row["lr_sensitivity"] is not None
            assert row["final_valid_mlm_loss"] > 0 and row["final_valid_clm_loss"] > 0
    assert rows[example.REFERENCE_MODEL]["tasks"]["rt_sentiment"]["best_lr"] == 1e-4
    # CPT: 6 CLM steps with their own decay, then 2 MLM steps from that checkpoint (weights only).
    curve = summary["pretraining_curves"]["cpt"]
    assert [(r["stage"], r["step"]) for r in curve][-1] == ("cpt", 8)
    cpt_config = Checkpoint.open(out / "pretrain" / "cpt" / "checkpoints").run_config()
    assert cpt_config["checkpoint"]["finetune"] and cpt_config["checkpoint"]["load"].endswith("cpt_stage1_clm/checkpoints")
    assert cpt_config["training"]["train_iters"] == 2 and cpt_config["phases"][0]["objective"] == "mlm"
    assert (out / "pretraining_loss.png").stat().st_size > 10_000
    assert (out / "eval" / "plots" / "rt_sentiment.png").is_file()
    table = (out / "comparison.md").read_text()
    assert "| biphasic_25_75 |" in table and "LR sensitivity" in table
    assert len(list((out / "eval" / "runs").glob("*/rt_sentiment/*.json"))) == 5 * 2
