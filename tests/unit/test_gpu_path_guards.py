"""The GPU path's settings on a machine without a GPU: clear errors before any model is built,
the Transformer Engine fallback, and the optimizer format recorded in checkpoints (CPU, no mocks)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_ext.config_loading import ConfigError
from megatron_ext.checkpoint.reader import Checkpoint
from megatron_ext.training.recipe import run_config_from_dict
from megatron_ext.training.megatron_engine import megatron_transformer_overrides
from megatron_ext.training.loop import pretrain
from helpers import tiny_recipe as _recipe

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a CPU-only machine refuses")


@pytest.mark.parametrize("sections, message", [
    ({"training": {"train_iters": 8, "fp8_format": "hybrid"}}, "training.fp8_format='hybrid' (FP8) needs training.bf16"),
    # Megatron-LM's meaning: --fp8-recipe alone does not turn FP8 on, so alone it is refused.
    ({"training": {"train_iters": 8, "bf16": True, "fp8_recipe": "delayed"}},
     "training.fp8_recipe='delayed' chooses how FP8 scales, but FP8 is off: training.fp8_format"),
    ({"training": {"train_iters": 8, "bf16": True, "fp8_format": "hybrid", "fp8_recipe": "tensorwise"}},
     "needs model.transformer_impl: te"),
    ({"parallel": {"overlap_param_gather": True}}, "overlap_param_gather needs parallel.use_distributed_optimizer"),
    ({"training": {"train_iters": 8, "recompute_num_layers": 0}}, "recompute_num_layers must be >= 1"),
])
def test_inconsistent_gpu_settings_are_config_errors(tmp_path, tiny_corpus, sections, message):
    with pytest.raises((ConfigError, ValueError)) as err:
        run_config_from_dict(_recipe(tiny_corpus, tmp_path, **sections))
    assert message in str(err.value)


@pytest.mark.parametrize("sections, message", [
    ({"training": {"train_iters": 8, "bf16": True, "fp8_format": "e4m3"},
      "model": {"transformer_impl": "te"}}, "FP8 needs a CUDA GPU with compute capability >= 8.9"),
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
    config = run_config_from_dict(_recipe(tiny_corpus, tmp_path, model={"transformer_impl": "te"},
                                          training={"train_iters": 4, "eval_interval": 0, "log_interval": 1}))
    result = pretrain(config)
    err = capsys.readouterr().err
    assert err.count("WARNING: model.transformer_impl: te needs a CUDA GPU; this run uses the local spec") == 1
    assert result.final_step == 4 and all(math.isfinite(v) for v in result.losses.values())
    checkpoint = Checkpoint.open(result.checkpoint)
    assert checkpoint.run_config()["model"]["transformer_impl"] == "local"
    assert checkpoint.optimizer_format()["optimizer"] == "megatron"


def test_transformer_overrides_carry_fp8_and_recomputation(tmp_path, tiny_corpus):
    config = run_config_from_dict(_recipe(
        tiny_corpus, tmp_path, model={"transformer_impl": "te"},
        training={"train_iters": 8, "bf16": True, "fp8_format": "hybrid", "fp8_recipe": "tensorwise",
                  "recompute_granularity": "full",
                  "recompute_num_layers": 2}))
    assert megatron_transformer_overrides(config) == {
        "calculate_per_token_loss": True, "fp8": "hybrid", "fp8_recipe": "tensorwise",
        "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2}


def test_hardware_imports_no_model_code():
    """hardware.py sits below the model: importing it pulls in nothing of megatron_ext.model (the
    Transformer Engine probe is Megatron-Core's own), so there is no import circle."""
    import subprocess
    import sys

    probe = "import sys, megatron_ext.hardware; print(sorted(m for m in sys.modules if m.startswith('megatron_ext.')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert "megatron_ext.model" not in out and "megatron_ext.hardware" in out


def test_deterministic_parses_and_reaches_megatrons_transformer_config(tmp_path, tiny_corpus):
    assert run_config_from_dict(_recipe(tiny_corpus, tmp_path)).training.deterministic is False
    config = run_config_from_dict(_recipe(tiny_corpus, tmp_path, training={"train_iters": 8, "deterministic": True}))
    assert config.training.deterministic is True
    overrides = megatron_transformer_overrides(config)
    assert overrides["deterministic_mode"] is True  # the model's TransformerConfig: the run below
    with pytest.raises(ConfigError) as err:  # a misspelt key is refused, naming it
        run_config_from_dict(_recipe(tiny_corpus, tmp_path, training={"train_iters": 8, "determinstic": True}))
    assert "determinstic" in str(err.value)
    with pytest.raises((ConfigError, ValueError), match="training.deterministic: true cannot run with "
                                                         "training.cross_entropy_loss_fusion: true"):
        run_config_from_dict(_recipe(tiny_corpus, tmp_path, training={
            "train_iters": 8, "deterministic": True, "cross_entropy_loss_fusion": True}))


DETERMINISTIC_VARIABLES = ("CUBLAS_WORKSPACE_CONFIG", "NVTE_ALLOW_NONDETERMINISTIC_ALGO", "NCCL_ALGO")


@pytest.fixture
def torch_determinism_restored(monkeypatch):
    """The process's determinism settings as they were before the test (they are process-wide)."""
    for name in DETERMINISTIC_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    flags = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags[2], flags[3]


def test_make_deterministic_sets_torch_and_the_cuda_libraries(torch_determinism_restored, monkeypatch):
    import os

    from megatron_ext import hardware

    torch.backends.cudnn.benchmark = True
    hardware.make_deterministic()
    assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert {name: os.environ[name] for name in DETERMINISTIC_VARIABLES} == {
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "NCCL_ALGO": "Ring"}
    monkeypatch.setenv("NCCL_ALGO", "Tree")  # a deterministic choice of the user's is kept
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    hardware.make_deterministic()
    assert os.environ["NCCL_ALGO"] == "Tree" and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    for name, value in (("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1"), ("NCCL_ALGO", "NVLS"),
                        ("CUBLAS_WORKSPACE_CONFIG", ":0:0")):
        with monkeypatch.context() as env:
            env.setenv(name, value)
            with pytest.raises(hardware.UserError,
                               match=f"training.deterministic: true, but the environment sets {name}={value!r}"):
                hardware.make_deterministic()


def test_a_deterministic_run_sets_determinism_before_the_model_is_built(tmp_path, tiny_corpus, monkeypatch,
                                                                         torch_determinism_restored):
    """The loop calls ``hardware.make_deterministic`` before the process group and the model exist,
    the model's TransformerConfig has Megatron's ``deterministic_mode``, and the run trains (CPU:
    torch's deterministic algorithms cover every op of a step)."""
    import torch.distributed as dist

    from megatron_ext import hardware
    from megatron_ext.model.provider import ENCODER

    seen = []
    make_deterministic = hardware.make_deterministic
    monkeypatch.setattr(hardware, "make_deterministic",
                        lambda: (seen.append(dist.is_initialized()), make_deterministic()))

    class RecordingEncoder:  # the default model provider, watched
        def build_model(self, *args, **kwargs):
            seen.append(torch.are_deterministic_algorithms_enabled())
            model = ENCODER.build_model(*args, **kwargs)
            seen.append(model.config.deterministic_mode)
            return model

    config = run_config_from_dict(_recipe(tiny_corpus, tmp_path, training={
        "train_iters": 5, "eval_interval": 0, "log_interval": 1, "deterministic": True}))
    result = pretrain(config, model_provider=RecordingEncoder())
    assert seen == [False, True, True] and result.final_step == 5
    assert all(math.isfinite(v) for v in result.losses.values())
