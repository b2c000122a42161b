"""The GPU path's settings on a machine without a GPU: clear errors before any model is built,
the Transformer Engine fallback, and the optimizer format recorded in checkpoints (CPU, no mocks)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_ext.config_loading import ConfigError
from megatron_ext.checkpoint.handle import Checkpoint
from megatron_ext.training.config import run_config_from_dict
from megatron_ext.training.engines import megatron_transformer_overrides
from megatron_ext.training.loop import pretrain
from helpers import tiny_recipe as _recipe

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a CPU-only machine refuses")


@pytest.mark.parametrize("sections, message", [
    ({"training": {"train_iters": 8, "fp8_recipe": "delayed"}}, "training.fp8_recipe='delayed' needs training.bf16"),
    ({"training": {"train_iters": 8, "bf16": True, "fp8_recipe": "tensorwise"}},
     "needs model.attention_backend: te"),
    ({"parallel": {"overlap_param_gather": True}}, "overlap_param_gather needs parallel.use_distributed_optimizer"),
    ({"training": {"train_iters": 8, "recompute_num_layers": 0}}, "recompute_num_layers must be >= 1"),
])
def test_inconsistent_gpu_settings_are_config_errors(tmp_path, tiny_corpus, sections, message):
    with pytest.raises((ConfigError, ValueError)) as err:
        run_config_from_dict(_recipe(tiny_corpus, tmp_path, **sections))
    assert message in str(err.value)


@pytest.mark.parametrize("sections, message", [
    ({"training": {"train_iters": 8, "bf16": True, "fp8_recipe": "delayed"},
      "model": {"attention_backend": "te"}}, "FP8 needs a CUDA GPU with compute capability >= 8.9"),
    ({"parallel": {"pipeline_model_parallel_size": 2}},
     "not divisible by tensor_model_parallel_size=1 x pipeline_model_parallel_size=2"),
    ({"training": {"train_iters": 8, "recompute_granularity": "full"}}, "recompute_granularity='full' runs on CUDA"),
    ({"training": {"train_iters": 8, "bf16": True}}, "training.bf16: true with fp32 parameters (bf16 autocast) runs on CUDA"),
    ({"parallel": {"tensor_model_parallel_size": 2}}, "world size 1 is not divisible by tensor_model_parallel_size=2"),
])
def test_unsupported_requests_fail_before_the_model_is_built(tmp_path, tiny_corpus, sections, message):
    config = run_config_from_dict(_recipe(tiny_corpus, tmp_path, **sections))
    with pytest.raises(ValueError) as err:
        pretrain(config)
    assert message in str(err.value)
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "log").exists()  # nothing ran


def test_te_spec_falls_back_to_local_loudly_and_records_the_optimizer_format(tmp_path, tiny_corpus, capsys):
    """A recipe asking for Transformer Engine trains here with the local spec, says so once, and
    its checkpoint records the spec it ran and the format of its optimizer state."""
    config = run_config_from_dict(_recipe(tiny_corpus, tmp_path, model={"attention_backend": "te"},
                                          training={"train_iters": 4, "eval_interval": 0, "log_interval": 1}))
    result = pretrain(config)
    err = capsys.readouterr().err
    assert err.count("WARNING: model.attention_backend: te needs a CUDA GPU; this run uses the local spec") == 1
    assert result.final_step == 4 and all(math.isfinite(v) for v in result.losses.values())
    checkpoint = Checkpoint.open(result.checkpoint)
    assert checkpoint.run_config()["model"]["attention_backend"] == "local"
    assert checkpoint.optimizer_format()["optimizer"] == "megatron"


def test_transformer_overrides_carry_fp8_and_recomputation(tmp_path, tiny_corpus):
    config = run_config_from_dict(_recipe(
        tiny_corpus, tmp_path, model={"attention_backend": "te"},
        training={"train_iters": 8, "bf16": True, "fp8_recipe": "tensorwise", "recompute_granularity": "full",
                  "recompute_num_layers": 2}))
    assert megatron_transformer_overrides(config) == {
        "calculate_per_token_loss": True, "fp8": "hybrid", "fp8_recipe": "tensorwise",
        "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2}


def test_platform_imports_no_model_code():
    """platform.py sits below the model: importing it pulls in nothing of megatron_ext.model (the
    Transformer Engine probe is Megatron-Core's own), so there is no import circle."""
    import subprocess
    import sys

    probe = "import sys, megatron_ext.platform; print(sorted(m for m in sys.modules if m.startswith('megatron_ext.')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert "megatron_ext.model" not in out and "megatron_ext.platform" in out
