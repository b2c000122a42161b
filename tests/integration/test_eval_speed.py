"""The fine-tuning speed benchmark (benchmarks/finetune_speed.py) at CI size, and the harness's
fast paths: losses read on the host only every FINITE_CHECK_STEPS steps (a divergence still names
its first step) and scoring in length-sorted batches (predictions in the rows' order)."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_ext.eval import finetuning
from megatron_ext.eval.families import sc
from megatron_ext.eval.finetuning import FinetuneConfig, by_length, load_encoder
from megatron_ext.eval.task_io import load_task
from eval_fixtures import TINY, encoder, suite  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_benchmark_times_ours_and_the_trainer_and_keeps_other_labels(tmp_path, encoder, suite, capsys, monkeypatch):
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (requirements-dev.txt)")
    from benchmarks import finetune_speed

    def no_download(*args):
        raise AssertionError(f"a sized encoder with its own tokenizer needs no asset (a GPU machine has no network): {args}")

    # As the GPU suite's finetune_210m stage runs it: random weights of a size, the tokenizer given.
    monkeypatch.setattr(finetune_speed.assets, "member_dir", no_download)
    out = tmp_path / "finetune_speed.json"
    out.write_text(json.dumps({"measurements": {"before": {"ours_over_trainer": 1.0}}}))
    assert finetune_speed.main(["--model-size", "tiny", "--tokenizer", encoder, "--steps", "2", "--rounds", "1", "--max-length", "32",
                                "--label", "after", "--output", str(out), "--workers", "2", "--grid-runs", "2"]) == 0
    assert "ours / Trainer x" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert set(record["measurements"]) == {"before", "after"} and record["transformers"]
    after = record["measurements"]["after"]
    for side in ("ours", "trainer"):
        (run,) = after["rounds"][side]
        assert run["steps"] == 2 and 0 <= run["validation"] <= 100 and 0 < run["cpu_seconds"]
        assert after["runs_per_hour"][side] == pytest.approx(3600 / run["seconds"])
    assert after["ours_over_trainer"] == pytest.approx(after["runs_per_hour"]["ours"] / after["runs_per_hour"]["trainer"])
    grid = after["workers"]["2"]  # two processes, one run each, at once
    assert grid["runs"] == 2 and grid["runs_per_hour"] == pytest.approx(3600 * 2 / grid["seconds"])


def test_a_paper_sized_encoder_for_the_speed_benchmark_is_a_eurobert_the_harness_loads(tmp_path, encoder):
    """``--model-size``: a EuroBERT of a preset's shape with the given tokenizer, loaded by the harness
    as every fine-tuning run loads its model (the tiny preset here; 210m on a GPU)."""
    from benchmarks import finetune_speed

    model_dir = finetune_speed.sized_encoder("tiny", encoder, tmp_path / "eurobert_tiny")
    _, model = load_encoder(model_dir, FinetuneConfig(lr=1e-4, seed=0, device="cpu"), num_labels=2)
    assert type(model).__name__ == "EuroBertForSequenceClassification"
    from megatron_ext.model.config import preset

    assert model.config.num_hidden_layers == preset("tiny").num_layers


def test_divergence_is_found_without_a_sync_per_step(monkeypatch):
    """A loss that turns non-finite at step 3 is reported as step 3, though read only every 2 steps."""
    monkeypatch.setattr(finetuning, "FINITE_CHECK_STEPS", 2)
    model = torch.nn.Linear(4, 1)
    steps = []

    def loss_fn(m: torch.nn.Linear, batch: torch.Tensor) -> torch.Tensor:
        steps.append(batch)
        return m(batch).sum() * (float("nan") if len(steps) == 4 else 1.0)

    config = FinetuneConfig(lr=1e-4, seed=0, device="cpu")
    with pytest.raises(FloatingPointError, match=r"non-finite loss at step 3 \(lr 0.0001\)"):
        finetuning.finetune(model, iter(torch.ones(10, 4)), config=config, total_steps=6, loss_fn=loss_fn)
    assert len(steps) == 4  # stopped at the next read, not after all 6 steps
    model = torch.nn.Linear(4, 1)
    losses = finetuning.finetune(model, iter(torch.ones(10, 4)), config=config, total_steps=3,
                               loss_fn=lambda m, batch: m(batch).sum())
    assert len(losses) == 3 and all(isinstance(loss, float) for loss in losses) and losses[0] != losses[2]


def test_length_sorted_scoring_keeps_the_rows_order(suite, encoder):
    rows = load_task(suite / "rt_sentiment", "validation")[:40]
    batches = list(by_length(rows, lambda row: len(row["text"]), 16))
    assert sorted(i for positions, _ in batches for i in positions) == list(range(40))
    lengths = [len(row["text"]) for _, batch in batches for row in batch]
    assert lengths == sorted(lengths, reverse=True)
    config = FinetuneConfig(lr=1e-4, seed=0, **TINY)
    tokenizer, model = load_encoder(encoder, config, num_labels=2)
    model = finetuning.OwnHeadModel(model).eval()
    one_by_one = [sc.predict(model, tokenizer, [row], config)[0] for row in rows]
    assert sc.predict(model, tokenizer, rows, config) == one_by_one
