"""``training.rope_fusion``, ``training.gradient_accumulation_fusion`` and
``training.cross_entropy_fusion_impl`` on CPU: the
settings parse and reach Megatron's ``TransformerConfig``, turn off with one announced warning
where they cannot run (here: no GPU, no Transformer Engine, no apex), refusals name the key, and
the model builder keeps Megatron's own LM head off the fused weight-gradient path when apex is
missing. Their numerics against the unfused paths are GPU tests (tests/integration/test_gpu.py)."""

from __future__ import annotations

import types

import pytest
import torch

from helpers import tiny_recipe as _recipe
from megatron_ext import hardware, process_group
from megatron_ext.config_loading import ConfigError, UserError
from megatron_ext.training.recipe import run_config_from_dict

FUSIONS = {"rope_fusion": True, "gradient_accumulation_fusion": True}
cpu_only = pytest.mark.skipif(hardware.on_gpu(), reason="the CPU fallbacks (a GPU keeps the settings)")


def _config(corpus, tmp_path, *, data=None, model=None, **training):
    return run_config_from_dict(_recipe(corpus, tmp_path, training={"train_iters": 8, **training},
                                        data={**(data or {})}, model={**(model or {})}))


def test_settings_parse_and_reach_the_transformer_config(tmp_path, tiny_corpus):
    from megatron_ext.training.megatron_engine import megatron_transformer_overrides

    config = _config(tiny_corpus, tmp_path, **FUSIONS)
    assert config.training.rope_fusion and config.training.gradient_accumulation_fusion
    overrides = megatron_transformer_overrides(config)
    assert overrides["apply_rope_fusion"] is True and overrides["gradient_accumulation_fusion"] is True
    off = megatron_transformer_overrides(_config(tiny_corpus, tmp_path))
    assert "apply_rope_fusion" not in off and "gradient_accumulation_fusion" not in off  # Megatron's defaults: off


def test_command_line_flags(tmp_path, tiny_corpus):
    import argparse

    from megatron_ext.training.recipe import add_override_flags, apply_overrides

    parser = argparse.ArgumentParser()
    dests = add_override_flags(parser)
    args = parser.parse_args(["--rope-fusion", "--no-gradient-accumulation-fusion"])
    raw = apply_overrides(_recipe(tiny_corpus, tmp_path, training={"gradient_accumulation_fusion": True}), args, dests)
    config = run_config_from_dict(raw)
    assert config.training.rope_fusion is True and config.training.gradient_accumulation_fusion is False


def test_the_cross_entropy_kernel_reaches_the_transformer_config(tmp_path, tiny_corpus):
    """``training.cross_entropy_fusion_impl`` picks Megatron's kernel (``TransformerConfig.
    cross_entropy_fusion_impl``) under ``cross_entropy_loss_fusion``; alone it is refused in one line,
    and its flag has Megatron-LM's name."""
    import argparse

    from megatron_ext.training.recipe import add_override_flags, apply_overrides
    from megatron_ext.training.megatron_engine import megatron_transformer_overrides

    for impl in ("native", "te"):
        overrides = megatron_transformer_overrides(
            _config(tiny_corpus, tmp_path, cross_entropy_loss_fusion=True, cross_entropy_fusion_impl=impl))
        assert overrides["cross_entropy_loss_fusion"] is True and overrides["cross_entropy_fusion_impl"] == impl
    assert "cross_entropy_loss_fusion" not in megatron_transformer_overrides(_config(tiny_corpus, tmp_path))
    with pytest.raises(UserError, match=r"training\.cross_entropy_fusion_impl: te chooses the kernel of "
                                        r"training\.cross_entropy_loss_fusion, which is off"):
        _config(tiny_corpus, tmp_path, cross_entropy_fusion_impl="te")
    parser = argparse.ArgumentParser()
    dests = add_override_flags(parser)
    args = parser.parse_args(["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"])
    config = run_config_from_dict(apply_overrides(_recipe(tiny_corpus, tmp_path), args, dests))
    assert config.training.cross_entropy_loss_fusion and config.training.cross_entropy_fusion_impl == "te"


@cpu_only
def test_te_cross_entropy_on_cpu_runs_the_native_kernel_with_the_unfused_loss(model_parallel_cpu, tmp_path, tiny_corpus,
                                                                               capsys):
    """Where TE's kernel cannot run the run takes Megatron's native fused kernel, announced once, and
    the model built from what it runs gives the unfused per-token loss (fp32, CPU)."""
    from megatron_ext.model import build_encoder_model
    from megatron_ext.objectives import MaskingConfig, apply_mlm
    from megatron_ext.training.loop import runnable_here
    from megatron_ext.training.megatron_engine import MicroBatch, megatron_transformer_overrides, per_token_loss

    asked = _config(tiny_corpus, tmp_path, cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te")
    runs = runnable_here(asked)
    assert runs.training.cross_entropy_fusion_impl == "native" and runs.training.cross_entropy_loss_fusion
    assert capsys.readouterr().err.count("WARNING: training.cross_entropy_fusion_impl: te needs a CUDA GPU") == 1
    gen = torch.Generator().manual_seed(0)
    vocab = runs.model.vocab_size
    batch = apply_mlm(torch.randint(4, vocab, (2, 32), generator=gen), config=MaskingConfig(mask_ratio=0.4),
                      mask_id=3, vocab_size=vocab, special_ids=(0, 1, 2, 3), generator=gen)
    losses = {}
    for name, config in (("fused", runs), ("unfused", _config(tiny_corpus, tmp_path))):
        torch.manual_seed(0)
        model = build_encoder_model(config.model, transformer_overrides=megatron_transformer_overrides(config))
        assert model.config.cross_entropy_loss_fusion is (name == "fused")
        with torch.no_grad():
            losses[name] = per_token_loss(model, MicroBatch(batch, None), bf16=False, lm_head_scored_only=True)
    assert float(losses["unfused"].abs().sum()) > 0
    torch.testing.assert_close(losses["fused"], losses["unfused"], rtol=1e-5, atol=1e-5)


def test_rope_fusion_with_per_document_positions_is_refused(tmp_path, tiny_corpus):
    with pytest.raises(ConfigError, match=r"training\.rope_fusion needs data\.reset_position_ids: false"):
        _config(tiny_corpus, tmp_path, data={"reset_position_ids": True}, rope_fusion=True)


@cpu_only
def test_on_cpu_each_fusion_turns_off_with_one_warning_naming_it():
    settings, warnings = hardware.fusion_fallbacks(rope_fusion=True, gradient_accumulation_fusion=True,
                                                   transformer_impl="local", cross_entropy_fusion_impl="te")
    assert settings == {"rope_fusion": False, "gradient_accumulation_fusion": False, "cross_entropy_fusion_impl": "native"}
    assert len(warnings) == 3
    assert warnings[0].startswith("WARNING: training.cross_entropy_fusion_impl: te needs a CUDA GPU")
    assert warnings[1].startswith("WARNING: training.rope_fusion needs a CUDA GPU")
    assert warnings[2].startswith("WARNING: training.gradient_accumulation_fusion needs a CUDA GPU")
    assert hardware.fusion_fallbacks(rope_fusion=False, gradient_accumulation_fusion=False,
                                     transformer_impl="te") == (
        {"rope_fusion": False, "gradient_accumulation_fusion": False, "cross_entropy_fusion_impl": "native"}, [])


def test_fallback_reasons_on_a_gpu_without_te_or_apex(monkeypatch):
    """What a GPU machine without Transformer Engine (no fused RoPE) or without apex (the local
    spec's linears cannot fuse) is told; the te spec without apex keeps the fusion (TE's linears)."""
    monkeypatch.setattr(hardware, "on_gpu", lambda: True)
    monkeypatch.setattr(hardware, "fused_rope_available", lambda: False)
    monkeypatch.setattr(hardware, "megatron_linear_wgrad_fusion_available", lambda: False)
    monkeypatch.setattr(hardware, "transformer_engine_available", lambda: False)
    settings, warnings = hardware.fusion_fallbacks(rope_fusion=True, gradient_accumulation_fusion=True,
                                                   transformer_impl="local", cross_entropy_fusion_impl="te")
    assert settings == {"rope_fusion": False, "gradient_accumulation_fusion": False, "cross_entropy_fusion_impl": "native"}
    assert "training.cross_entropy_fusion_impl: te needs Transformer Engine" in warnings[0]
    assert "training.rope_fusion needs Transformer Engine" in warnings[1]
    assert "training.gradient_accumulation_fusion needs apex's fused_weight_gradient_mlp_cuda" in warnings[2]
    monkeypatch.setattr(hardware, "transformer_engine_available", lambda: True)
    settings, warnings = hardware.fusion_fallbacks(rope_fusion=False, gradient_accumulation_fusion=True,
                                                   transformer_impl="te", cross_entropy_fusion_impl="te")
    assert settings == {"rope_fusion": False, "gradient_accumulation_fusion": True, "cross_entropy_fusion_impl": "te"}
    assert warnings == []


@cpu_only
def test_the_run_announces_each_fallback_once(tmp_path, tiny_corpus, capsys):
    from megatron_ext.training.loop import runnable_here

    config = _config(tiny_corpus, tmp_path, **FUSIONS)
    runnable = runnable_here(config)
    assert not runnable.training.rope_fusion and not runnable.training.gradient_accumulation_fusion
    err = capsys.readouterr().err
    assert err.count("WARNING: training.rope_fusion") == 1
    assert err.count("WARNING: training.gradient_accumulation_fusion") == 1
    runnable_here(config, announce=False)  # other ranks: the same config, nothing printed
    assert capsys.readouterr().err == ""


@cpu_only
def test_the_gpu_size_recipes_enable_both_and_still_run_on_cpu(capsys):
    """The size bases turn RoPE and weight-gradient fusion on (with the measured default, the TE spec:
    benchmarks/results/recipe_defaults.md); a CPU run of one gets the local spec and both fusions off,
    each announced."""
    from pathlib import Path

    from megatron_ext.training.recipe import read_recipe
    from megatron_ext.training.loop import runnable_here

    bases = Path(__file__).resolve().parents[2] / "examples" / "recipes" / "base"
    for size in ("210m", "610m", "1b"):
        training = read_recipe(bases / f"{size}.yaml")["training"]
        assert training["rope_fusion"] is True and training["gradient_accumulation_fusion"] is True, size
    config = run_config_from_dict(read_recipe(bases.parent / "paper" / "210m_mlm_40.yaml"),
                                  tokenizer_vocab_size=128_256)
    runnable = runnable_here(config)
    assert runnable.model.transformer_impl == "local" and not runnable.training.rope_fusion
    assert not runnable.training.gradient_accumulation_fusion
    err = capsys.readouterr().err
    assert "training.rope_fusion" in err and "training.gradient_accumulation_fusion" in err
    assert "model.transformer_impl: te" in err


def test_training_passes_positions_only_when_they_restart_per_document(tmp_path, tiny_corpus):
    """Without ``data.reset_position_ids`` GPTDataset's positions are 0..s-1 in every row: the
    model gets None and computes one [s, 1, 1, d] RoPE table (what TE's fused RoPE takes)."""
    from megatron_ext.training.loop import model_positions

    batch = {"position_ids": torch.arange(8).repeat(2, 1)}
    assert model_positions(batch, _config(tiny_corpus, tmp_path)) is None
    reset = _config(tiny_corpus, tmp_path, data={"reset_position_ids": True})
    assert model_positions(batch, reset) is batch["position_ids"]


def test_none_positions_give_the_same_rope_angles_as_0_to_s(model_parallel_cpu):
    from megatron_ext.model import build_encoder_model, preset

    model = build_encoder_model(preset("tiny", vocab_size=256))
    rows = model.rotary_embedding(16, torch.arange(16).repeat(3, 1), torch.device("cpu"), base=10_000.0)
    table = model.rotary_embedding(16, None, torch.device("cpu"), base=10_000.0)
    assert table.shape[1:3] == (1, 1) and rows.shape[1] == 3
    torch.testing.assert_close(rows, table.expand_as(rows), rtol=0, atol=0)


def test_per_row_positions_under_fused_rope_are_refused_by_the_model():
    from megatron_ext.model.builder import EncoderModel

    fused = types.SimpleNamespace(config=types.SimpleNamespace(apply_rope_fusion=True))
    with pytest.raises(ValueError, match=r"training\.rope_fusion: false"):
        EncoderModel._check_rope_positions(fused, torch.zeros(2, 8, dtype=torch.long))
    EncoderModel._check_rope_positions(fused, torch.zeros(1, 8, dtype=torch.long))  # one row: one table
    EncoderModel._check_rope_positions(fused, None)


@pytest.fixture
def model_parallel_cpu(tmp_path):
    process_group.init_process_group_and_model_parallel(init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    process_group.destroy_process_group_and_model_parallel()


def test_local_spec_without_apex_is_refused_by_the_builder(model_parallel_cpu):
    from megatron_ext.model import build_encoder_model, preset

    if hardware.megatron_linear_wgrad_fusion_available():
        pytest.skip("apex is installed: the local spec's linears fuse")
    with pytest.raises(UserError, match=r"training\.gradient_accumulation_fusion with model\.transformer_impl: local"):
        build_encoder_model(preset("tiny", vocab_size=256), transformer_overrides={"gradient_accumulation_fusion": True})


def test_without_apex_only_the_te_linears_fuse(model_parallel_cpu, monkeypatch):
    """The ``te`` spec without apex: the block's linears are built with a config copy that fuses,
    the model's config (embedding, LM head) does not, and the caller's config is left as it was.
    (TE cannot be built on CPU: the spec is recorded and the local one built in its place.)"""
    from megatron_ext.model import builder, preset

    asked = {}

    def spec(backend, num_layers, *, qk_layernorm, te_linears_fuse_weight_gradients):
        asked.update(backend=backend, te_linears=te_linears_fuse_weight_gradients)
        return real_spec("local", num_layers, qk_layernorm=qk_layernorm)

    real_spec = builder.encoder_block_spec
    monkeypatch.setattr(builder, "encoder_block_spec", spec)
    monkeypatch.setattr(hardware, "megatron_linear_wgrad_fusion_available", lambda: False)  # no apex
    config = preset("tiny", vocab_size=256, transformer_impl="te")
    transformer_config = builder.transformer_config(config, {"gradient_accumulation_fusion": True})
    model = builder.EncoderModel(config, transformer_config)
    assert asked == {"backend": "te", "te_linears": True}
    assert model.config.gradient_accumulation_fusion is False
    assert model.output_layer.gradient_accumulation_fusion is False
    assert transformer_config.gradient_accumulation_fusion is True


def test_the_te_linear_wrapper_hands_its_layer_a_fusing_copy_of_the_config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.model.spec import _fusing_weight_gradients

    class Linear:
        def __init__(self, size, *, config, bias):
            self.config, self.size, self.bias = config, size, bias

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    layer = _fusing_weight_gradients(Linear)(4, config=config, bias=False)
    assert isinstance(layer, Linear) and type(layer).__name__ == "Linear"
    assert layer.config.gradient_accumulation_fusion is True and layer.config is not config
    assert config.gradient_accumulation_fusion is False and (layer.size, layer.bias) == (4, False)
    assert layer.config.hidden_size == 8
