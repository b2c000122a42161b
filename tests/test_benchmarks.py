"""The throughput benchmark's CPU mode runs the same code as on a GPU, at tiny size (CI)."""

from __future__ import annotations

import json

import pytest

from benchmarks import throughput

REQUIRED = ("model", "seq_length", "precision", "tokens_per_s", "tflops", "mfu", "peak_mem_gb", "hf_tokens_per_s")


def test_throughput_cpu_mode_writes_rows(tmp_path, capsys):
    out = tmp_path / "throughput_cpu.json"
    assert throughput.main(["--cpu-tiny", "--steps", "1", "--rounds", "2", "--warmup", "1", "--output", str(out)]) == 0
    assert "tok/s" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["flops_convention"].startswith("6*N") and result["versions"]["megatron_core"]
    (row,) = result["rows"]
    assert all(key in row for key in REQUIRED)
    assert (row["model"], row["seq_length"], row["precision"], row["engine"]) == ("tiny", 128, "fp32", "megatron")
    assert row["tokens_per_s"] > 0 and row["hf_tokens_per_s"] > 0 and row["tflops"] > 0
    # The demo recipe's shape: 2 micro-batches of 8 sequences per optimizer step, on both sides.
    assert (row["micro_batches_per_step"], row["micro_batch_size"], row["tokens_per_step"]) == (2, 8, 2 * 8 * 128)
    assert row["micro_batch_time_s"] == pytest.approx(row["step_time_s"] / 2)
    assert row["mfu"] is None and row["peak_mem_gb"] is None  # no GPU peak to divide by on CPU
    assert len(row["rounds_s"]["megatron_ext"]) == 2
    variant = row["variants"]["full_lm_head"]  # the default step vs the full LM head, same batches
    assert variant["tokens_per_s"] > 0 and variant["default_speedup"] > 0 and len(variant["rounds_s"]) == 2


def test_recipe_shape_is_one_ranks_share_of_the_paper_batch():
    """1,152 sequences over 64 data-parallel ranks = 18 per rank: 6 x 3 at 1b, 3 x 6 at 610m."""
    args = throughput.build_parser().parse_args([])
    assert throughput.recipe_shape(args, "1b") == (3, 6)
    assert throughput.recipe_shape(args, "610m") == (6, 3)
    args = throughput.build_parser().parse_args(["--data-parallel-size", "8", "--micro-batch-size", "4"])
    assert throughput.recipe_shape(args, "610m") == (4, 36)


def test_gpu_only_variants_are_refused_on_cpu(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        throughput.main(["--cpu-tiny", "--variants", "full_recompute", "--output", str(tmp_path / "x.json")])
    assert exit_info.value.code == 2 and "--variants full_recompute need CUDA" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
