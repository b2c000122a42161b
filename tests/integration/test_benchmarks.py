"""The throughput benchmark's CPU mode runs the same code as on a GPU, at tiny size (CI)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import fp8_gemm, masking, throughput

REQUIRED = ("model", "seq_length", "precision", "tokens_per_s", "tflops", "mfu", "peak_mem_gb", "hf_tokens_per_s")


def test_throughput_cpu_mode_writes_rows(tmp_path, capsys):
    """Each side (ours, the variant, HF) runs in its own process and reports that process's peak
    memory (peak RSS on CPU, labelled as such); --profile writes one profiled step's top ops."""
    out, profile = tmp_path / "throughput_cpu.json", tmp_path / "profile"
    assert throughput.main(["--cpu-tiny", "--steps", "1", "--rounds", "2", "--warmup", "1", "--output", str(out),
                            "--profile", str(profile), "--variants", "full_lm_head", "no_rope_fusion"]) == 0
    printed = capsys.readouterr().out
    assert "tok/s" in printed and printed.count("peak RSS") == 3  # ours, HF, the variant
    result = json.loads(out.read_text())
    assert result["flops_convention"].startswith("6*N") and result["versions"]["megatron_core"]
    assert result["peak_mem_measure"].startswith("peak resident set size")
    (row,) = result["rows"]
    assert all(key in row for key in REQUIRED)
    assert (row["model"], row["seq_length"], row["precision"], row["engine"]) == ("tiny", 128, "fp32", "megatron")
    assert row["tokens_per_s"] > 0 and row["hf_tokens_per_s"] > 0 and row["tflops"] > 0
    # The demo recipe's shape: 2 micro-batches of 8 sequences per optimizer step, on both sides.
    assert (row["micro_batches_per_step"], row["micro_batch_size"], row["tokens_per_step"]) == (2, 8, 2 * 8 * 128)
    assert row["micro_batch_time_s"] == pytest.approx(row["step_time_s"] / 2)
    assert row["mfu"] is None  # no GPU peak to divide by on CPU
    # Each side's own process: its peak RSS holds torch, the libraries and the model (well over 100 MB).
    assert row["peak_mem_measure"] == result["peak_mem_measure"] and row["errors"] == {}
    assert 0.1 < row["peak_mem_gb"] < 16 and 0.1 < row["hf_peak_mem_gb"] < 16
    assert row["speedup_vs_hf"] == pytest.approx(row["hf_step_time_s"] / row["step_time_s"])
    assert len(row["rounds_s"]["megatron_ext"]) == 2
    variant = row["variants"]["full_lm_head"]  # the default step vs the full LM head, same batches
    assert variant["tokens_per_s"] > 0 and variant["default_speedup"] > 0 and len(variant["rounds_s"]) == 2
    assert 0.1 < variant["peak_mem_gb"] < 16 and variant["same_as_default"] is False
    assert variant["settings"] == {**row["settings"], "lm_head_scored_only": False}
    # No fused RoPE in the tiny recipe (nor on CPU): the undo-variant is the default, reported and not timed.
    assert row["variants"]["no_rope_fusion"]["same_as_default"] is True
    assert "no_rope_fusion" not in row["wall_s"] and "not timed, the default runs the same here" in printed
    # Each side's wall time, for planning a GPU visit: start-up, build, warm-up, timed (profile for ours).
    for side in ("megatron_ext", "hf", "full_lm_head"):
        wall = row["wall_s"][side]
        assert all(wall[k] > 0 for k in ("startup", "build", "warmup", "timed", "total")), (side, wall)
        assert wall["total"] >= wall["startup"] + wall["build"] + wall["warmup"] + wall["timed"]
    assert row["wall_s"]["megatron_ext"]["profile"] > 0 and "wall s per side" in printed
    assert result["wall_s"]["total"] > sum(w["total"] for w in row["wall_s"].values())
    # --profile: one optimizer step of our engine, the top ops by CPU time, as a table and as JSON.
    stem = profile / "profile_tiny_seq128_fp32"
    assert row["profile"] == {"table": f"{stem}.txt", "json": f"{stem}.json"}
    assert "Self CPU" in (profile / "profile_tiny_seq128_fp32.txt").read_text()
    profiled = json.loads((profile / "profile_tiny_seq128_fp32.json").read_text())
    assert profiled["sort_by"] == "self_cpu_time_total" and profiled["step_wall_s"] > 0
    ops = profiled["ops"]
    assert ops and any(op["name"] == "aten::mm" for op in ops)  # the matmuls are where a step goes
    assert [op["self_time_us"] for op in ops] == sorted((op["self_time_us"] for op in ops), reverse=True)
    assert 0 < sum(op["self_share"] for op in ops) <= 1 + 1e-9


def test_recipe_shape_is_one_ranks_share_of_the_paper_batch():
    """1,152 sequences over 64 data-parallel ranks = 18 per rank: 2 x 9 at 1b and 610m; the
    baseline and the micro_batch_N variants split the same 18 sequences their own way."""
    args = throughput.build_parser().parse_args([])
    assert throughput.recipe_shape(args, "1b") == (9, 2)
    assert throughput.recipe_shape(args, "610m") == (9, 2)
    assert throughput.side_shape(args, "1b", "hf") == (3, 6)  # the baseline's largest that fits 80 GB
    assert throughput.side_shape(args, "610m", "hf") == (6, 3)
    assert throughput.side_shape(args, "1b", "micro_batch_3") == (3, 6)
    assert throughput.side_shape(args, "1b", "no_rope_fusion") == (9, 2)
    assert throughput.describe(throughput.run_config(args, "1b", 2048, "bf16", "micro_batch_9")) == \
        throughput.describe(throughput.run_config(args, "1b", 2048, "bf16"))  # the recipe's own: not timed twice
    assert throughput.describe(throughput.run_config(args, "1b", 2048, "bf16", "micro_batch_3"))["micro_batch_size"] == 3
    args = throughput.build_parser().parse_args(["--data-parallel-size", "8", "--micro-batch-size", "4"])
    assert throughput.recipe_shape(args, "610m") == (4, 36)
    args = throughput.build_parser().parse_args(["--micro-batch-size", "16", "--micro-batches", "1"])
    with pytest.raises(SystemExit, match="micro-batch of 6 does not divide the 16 sequences"):
        throughput.side_shape(args, "1b", "micro_batch_6")


def test_every_side_trains_on_the_same_sequences_in_its_own_micro_batches():
    args = throughput.build_parser().parse_args(["--vocab-size", "512"])
    steps = {side: throughput._batches(args, "1b", 32, side)() for side in ("megatron_ext", "hf", "micro_batch_6")}
    assert [len(step) for step in steps.values()] == [2, 6, 3]
    joined = {side: torch.cat([b.input_ids for b in step]) for side, step in steps.items()}
    assert torch.equal(joined["megatron_ext"], joined["hf"]) and torch.equal(joined["hf"], joined["micro_batch_6"])
    assert torch.equal(torch.cat([b.labels for b in steps["hf"]]), torch.cat([b.labels for b in steps["megatron_ext"]]))


def test_the_default_side_is_the_size_recipe_and_variants_undo_one_setting():
    """The default side takes the size recipe's spec, parameter dtype, fusions and optimizer layout
    (what this machine cannot run turned off, as a training run would); each undo-variant changes
    exactly its setting."""
    args = throughput.build_parser().parse_args([])
    assert throughput.recipe_settings("1b") == {
        "model": {"transformer_impl": "te", "params_dtype": "bfloat16"},
        "training": {"bias_activation_fusion": True, "rope_fusion": True, "gradient_accumulation_fusion": True},
        "parallel": {"use_distributed_optimizer": True, "overlap_grad_reduce": True}}
    default = throughput.describe(throughput.run_config(args, "1b", 2048, "bf16"))
    assert default["params_dtype"] == "bfloat16" and default["bias_activation_fusion"] is True
    assert default["use_distributed_optimizer"] is True and default["lm_head_scored_only"] is True
    if not throughput.hardware.on_gpu():  # the fallbacks of a CPU run
        assert default["transformer_impl"] == "local" and not default["rope_fusion"]
        assert not default["gradient_accumulation_fusion"]
    for name, change in (("fp32_params", {"params_dtype": "float32"}), ("no_swiglu_fusion", {"bias_activation_fusion": False}),
                         ("full_lm_head", {"lm_head_scored_only": False})):
        assert throughput.describe(throughput.run_config(args, "1b", 2048, "bf16", name)) == {**default, **change}
    if not throughput.hardware.on_gpu():  # either layer implementation falls back to the same on CPU
        for name in ("te_spec", "local_spec"):
            assert throughput.describe(throughput.run_config(args, "1b", 2048, "bf16", name)) == default
    fp32 = throughput.describe(throughput.run_config(args, "1b", 2048, "fp32"))
    assert fp32["params_dtype"] == "float32" and fp32["bf16_autocast"] is False


def test_a_variant_that_runs_the_default_or_another_variant_is_timed_once():
    """With the TE spec the recipe's default, ``te_spec`` is the default and ``te_spec_cuda_graphs`` is
    ``cuda_graphs``: one side each is timed (a GPU visit's minute)."""
    te = {"transformer_impl": "te", "cuda_graphs": "none"}
    variants = {"cuda_graphs": {**te, "cuda_graphs": "megatron"}, "local_spec": {**te, "transformer_impl": "local"},
                "te_spec": dict(te), "te_spec_cuda_graphs": {**te, "cuda_graphs": "megatron"}}
    assert throughput.same_runs(te, variants) == {"cuda_graphs": None, "local_spec": None, "te_spec": "default",
                                                  "te_spec_cuda_graphs": "cuda_graphs"}


def test_gpu_only_variants_are_refused_on_cpu(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        throughput.main(["--cpu-tiny", "--variants", "full_recompute", "--output", str(tmp_path / "x.json")])
    assert exit_info.value.code == 2 and "--variants full_recompute need CUDA" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_every_variant_changes_a_setting_the_sides_record():
    """A variant whose setting ``describe`` does not record would look the same as the default and not
    be timed (the H200 visit of 2026-11-26 lost the CUDA-graphs side that way)."""
    args = throughput.build_parser().parse_args([])
    recorded = set(throughput.describe(throughput.run_config(args, "1b", 2048, "bf16")))
    renamed = {("optimizer", "fused"): "fused_adam"}
    for name, (change, _) in throughput.VARIANTS.items():
        for section, values in change.items():
            for key in values:
                assert renamed.get((section, key), key) in recorded, f"variant {name}: {section}.{key} not recorded"


def test_masking_benchmark_times_every_objective(tmp_path, capsys, tiny_corpus):
    """benchmarks/masking.py at a small shape: a row per objective, as ratios to plain MLM."""
    out = tmp_path / "masking.json"
    record = masking.main(["--micro-batch-size", "2", "--seq-length", "128", "--repeats", "2", "--output", str(out),
                           "--tokenizer", tiny_corpus["tokenizer"]])
    assert json.loads(out.read_text()) == record
    assert set(record["objectives"]) == set(masking.OBJECTIVES) and record["objectives"]["mlm-40"]["ratio_to_mlm"] == 1.0
    assert all(row["ms_per_micro_batch"] > 0 for row in record["objectives"].values())
    assert "wwm-40" in capsys.readouterr().out


def test_fp8_gemm_benchmark_cpu_mode_times_bf16_and_names_what_it_skips(tmp_path):
    """benchmarks/fp8_gemm.py --cpu-tiny: the bf16 side per size, FP8 sides skipped with the reason
    (they need a GPU), the layer's GEMM shapes and FLOPs those of the presets."""
    record = fp8_gemm.main(["--cpu-tiny", "--warmup", "1", "--steps", "2", "--output", str(tmp_path / "f.json")])
    assert [row["shape"]["name"] for row in record["rows"]] == ["tiny", "tiny x2"]
    for row in record["rows"]:
        assert row["sides"]["bf16"]["ms"] > 0 and row["sides"]["bf16"]["speedup_vs_bf16"] == 1.0
        assert row["sides"]["fp8_delayed"] == {"skipped": "FP8 needs a CUDA GPU"}
    assert record["fp8_delayed_pays_from"] is None
    one_b = next(shape for shape in fp8_gemm.SHAPES if shape.name == "1b")
    # 18 query heads of 96 and 6 KV groups: QKV 1728 -> 2880; SwiGLU FC1 1728 -> 8192.
    assert one_b.gemms() == [("qkv", 1728, 2880), ("proj", 1728, 1728), ("fc1", 1728, 8192), ("fc2", 4096, 1728)]
    assert one_b.flops(1) == 6 * (1728 * 2880 + 1728 * 1728 + 1728 * 8192 + 4096 * 1728)
