"""``training.cuda_graphs`` on CPU: the setting parses, what cannot run is refused naming the key
before anything is built, the ``TransformerConfig`` fields are Megatron's, and the memory
estimate counts the graphs' pool. Graphs themselves run on the GPU only: tests/integration/test_gpu.py."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from megatron_ext import hardware
from megatron_ext.config_loading import ConfigError, UserError
from megatron_ext.training import cuda_graphs
from megatron_ext.training.recipe import add_override_flags, apply_overrides, run_config_from_dict
from megatron_ext.training.megatron_engine import megatron_transformer_overrides
from megatron_ext.performance.memory import cuda_graph_pool_bytes, layer_activation_bytes
from megatron_ext.training.memory_fit import estimate_memory
from helpers import tiny_recipe

FAKE_CORPUS = {"tokenizer": "unused-tokenizer", "data": "unused-data"}
MLM_ONLY = [{"objective": "mlm", "mask_ratio": 0.4, "share": 1.0}]


def _config(tmp_path, **sections):
    return run_config_from_dict(tiny_recipe(FAKE_CORPUS, tmp_path, **sections))


def test_the_setting_parses_from_recipes_and_flags(tmp_path):
    assert _config(tmp_path).training.cuda_graphs == "none"  # off unless asked for
    assert _config(tmp_path, training={"train_iters": 8, "cuda_graphs": "megatron"}).training.cuda_graphs == "megatron"
    with pytest.raises(ConfigError, match=r"training.cuda_graphs"):  # Megatron's own value name is not ours
        _config(tmp_path, training={"train_iters": 8, "cuda_graphs": "local"})
    parser = argparse.ArgumentParser()
    dests = add_override_flags(parser)
    raw = apply_overrides(tiny_recipe(FAKE_CORPUS, tmp_path), parser.parse_args(["--cuda-graphs", "megatron"]), dests)
    assert run_config_from_dict(raw).training.cuda_graphs == "megatron"
    with pytest.raises(UserError, match="training.cuda_graphs"):
        _config(tmp_path, training={"train_iters": 8, "cuda_graphs": "full_iteration"})


@pytest.mark.parametrize("sections, keys", [
    ({"training": {"train_iters": 8, "cuda_graphs": "transformer_engine"}},
     ["training.cuda_graphs='transformer_engine'", "make_graphed_callables"]),
    ({"training": {"train_iters": 8, "cuda_graphs": "megatron", "recompute_granularity": "full"}},
     ["training.cuda_graphs='megatron'", "training.recompute_granularity='full'"]),
    ({"training": {"train_iters": 8, "cuda_graphs": "megatron", "recompute_granularity": "selective"}},
     ["training.recompute_granularity='selective'"]),
    ({"training": {"train_iters": 8, "cuda_graphs": "megatron"}, "data": {"reset_attention_mask": True}},
     ["training.cuda_graphs='megatron'", "data.reset_attention_mask", "Megatron-LM#5619"]),
    ({"training": {"train_iters": 8, "cuda_graphs": "megatron"}, "parallel": {"pipeline_model_parallel_size": 2}},
     ["training.cuda_graphs='megatron'", "parallel.pipeline_model_parallel_size=2"]),
])
def test_incompatible_settings_are_refused_naming_the_keys(tmp_path, sections, keys):
    model = {"preset": "tiny", "vocab_size": 1024, "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128,
             "num_attention_heads": 4, "num_query_groups": 2, **sections.pop("model", {})}
    with pytest.raises(UserError) as refused:
        _config(tmp_path, model=model, **sections)
    message = str(refused.value)
    assert "\n" not in message
    for key in keys:
        assert key in message, message


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_cpu_refuses_graphs_before_building_anything(tmp_path, tiny_corpus):
    from megatron_ext.training.loop import pretrain

    from megatron_ext.training.preflight import check_machine

    config = run_config_from_dict(tiny_recipe(tiny_corpus, tmp_path, training={"train_iters": 8, "cuda_graphs": "megatron"}))
    with pytest.raises(UserError, match=r"training.cuda_graphs='megatron': CUDA graphs need a CUDA GPU"):
        check_machine(config)  # the pre-flight's machine check
    assert cuda_graphs.machine_problem(_config(tmp_path)) is None  # training.cuda_graphs: none
    check_machine(_config(tmp_path))
    with pytest.raises(UserError, match="training.cuda_graphs"):
        hardware.seed_model_parallel(1234, cuda_graph_safe=True)
    with pytest.raises(UserError, match=r"training.cuda_graphs='megatron': CUDA graphs need a CUDA GPU"):
        pretrain(config)
    assert not (tmp_path / "log").exists() and not (tmp_path / "ckpt").exists()  # nothing ran


def test_transformer_config_overrides_are_megatrons_local_impl(tmp_path, single_rank, monkeypatch):
    from megatron_ext.model.builder import transformer_config

    off = _config(tmp_path)
    assert not {"cuda_graph_impl", "use_te_rng_tracker"} & megatron_transformer_overrides(off).keys()
    assert transformer_config(off.model, megatron_transformer_overrides(off)).cuda_graph_impl == "none"

    on = _config(tmp_path, training={"train_iters": 8, "cuda_graphs": "megatron"})
    overrides = megatron_transformer_overrides(on)
    assert overrides["cuda_graph_impl"] == "local" and overrides["use_te_rng_tracker"] is False
    built = transformer_config(on.model, overrides)
    assert built.cuda_graph_impl == "local"
    assert built.cuda_graph_modules == []  # the whole layer is one graph
    assert built.cuda_graph_warmup_steps == 3  # Megatron's default: eager passes per graph before capture
    assert built.calculate_per_token_loss  # the run's other overrides stay

    te_model = {"preset": "tiny", "vocab_size": 1024, "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128,
                "num_attention_heads": 4, "num_query_groups": 2, "transformer_impl": "te"}
    te_run = _config(tmp_path, model=te_model, training={"train_iters": 8, "cuda_graphs": "megatron"})
    monkeypatch.setattr(hardware, "transformer_engine_available", lambda: True)
    assert cuda_graphs.transformer_overrides(te_run)["use_te_rng_tracker"] is True  # as Megatron-LM for TE layers
    monkeypatch.setattr(hardware, "transformer_engine_available", lambda: False)
    assert cuda_graphs.transformer_overrides(te_run)["use_te_rng_tracker"] is False  # te falls back to local


def test_graphs_are_primed_for_every_attention_pattern_of_the_phases(tmp_path):
    biphasic = _config(tmp_path, training={"train_iters": 8, "cuda_graphs": "megatron"})
    assert cuda_graphs.attention_patterns(biphasic) == (True, False)  # CLM causal, MLM bidirectional
    assert cuda_graphs.attention_patterns(_config(tmp_path, phases=MLM_ONLY)) == (False,)
    assert cuda_graphs.attention_patterns(_config(tmp_path, phases=[{"objective": "clm", "share": 1.0}])) == (True,)

    from megatron_ext.objectives import apply_clm
    from megatron_ext.training.megatron_engine import MicroBatch

    tokens = torch.randint(4, 100, (2, 16))
    step = [MicroBatch(apply_clm(tokens, tokens, loss_mask=torch.ones(2, 16)), None) for _ in range(3)]
    priming = cuda_graphs.LayerGraphs.priming_micro_batches(SimpleNamespace(patterns=(True, False)), step)
    assert [m.objective.causal for m in priming] == [True, False]
    for m in priming:  # the same tensors: only the pattern differs
        assert m.objective.input_ids is step[0].objective.input_ids and m.position_ids is step[0].position_ids


def test_memory_estimate_counts_the_graph_pool(tmp_path):
    without = estimate_memory(_config(tmp_path), world_size=1)
    assert without.cuda_graph_pool == 0 and "CUDA graph pool" not in without.describe()
    config = _config(tmp_path, training={"train_iters": 8, "cuda_graphs": "megatron"})
    with_graphs = estimate_memory(config, world_size=1)
    m, d = config.model, config.data
    per_layer = layer_activation_bytes(m, residual_bytes=4, compute_bytes=4)
    expected = cuda_graph_pool_bytes(m, tokens=d.micro_batch_size * d.seq_length, layers=m.num_layers, patterns=2,
                                     per_layer_activation=per_layer, residual_bytes=4)
    assert with_graphs.cuda_graph_pool == expected > 0
    assert with_graphs.total == without.total + expected
    assert "CUDA graph pool" in with_graphs.describe()
    # One micro-batch's layer activations plus two [s, b, h] buffers per layer and pattern.
    tokens = d.micro_batch_size * d.seq_length
    assert expected == pytest.approx(tokens * m.num_layers * (per_layer + 2 * 2 * m.hidden_size * 4), abs=1)
    mlm_only = estimate_memory(_config(tmp_path, phases=MLM_ONLY, training={"train_iters": 8, "cuda_graphs": "megatron"}),
                               world_size=1)
    assert mlm_only.cuda_graph_pool == expected - tokens * m.num_layers * 2 * m.hidden_size * 4
