"""The memory estimate against what the real model saves for its backward pass, and the refusal
of a run that cannot fit before anything is allocated."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import yaml

from megatron_ext.cli import pretrain_encoder
from megatron_ext.model.attention import attention_pattern
from megatron_ext.config_loading import UserError
from megatron_ext.model import build_encoder_model, parameter_count, preset
from megatron_ext.training.recipe import read_recipe, run_config_from_dict
from megatron_ext.training.loop import pretrain
from megatron_ext.performance.memory import layer_activation_bytes, stage_parameters
from megatron_ext.training.memory_fit import estimate_memory, largest_micro_batch
from helpers import tiny_recipe as _recipe

REPO = Path(__file__).resolve().parents[2]


def saved_bytes(model, ids: torch.Tensor, loss_mask: torch.Tensor, *, bf16: bool) -> int:
    """Bytes of the distinct storages (parameters excluded) autograd keeps for the backward pass."""
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model(ids, packed_seq_params=attention_pattern(causal=False), labels=ids, loss_mask=loss_mask)
    return sum(n for ptr, n in storages.items() if ptr not in parameters)


SHAPES = [  # hidden, ffn, heads, kv heads: MHA, GQA, MQA and ffn/hidden ratios 2 to 3.3
    (128, 384, 4, 2), (128, 512, 4, 4), (192, 640, 6, 3), (256, 768, 4, 1), (256, 512, 8, 8),
]


@pytest.mark.parametrize("swiglu_fused", [False, True], ids=["torch-swiglu", "fused-swiglu"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_layer_activation_estimate_matches_saved_tensors(single_rank, bf16, swiglu_fused):
    """Per token and layer, within 10 % of what the local spec saves (difference of 1 and 2 layers),
    with torch's SwiGLU and Megatron's fused one (``training.bias_activation_fusion``)."""
    batch, seq = 2, 64
    ids = torch.randint(3, 500, (batch, seq), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(batch, seq)
    for hidden, ffn, heads, groups in SHAPES:
        config = preset("tiny", vocab_size=512, hidden_size=hidden, ffn_hidden_size=ffn,
                        num_attention_heads=heads, num_query_groups=groups, seq_length=seq)
        one, two = (saved_bytes(build_encoder_model(dataclasses.replace(config, num_layers=n), transformer_overrides={
            "bias_activation_fusion": swiglu_fused}), ids, mask, bf16=bf16) for n in (1, 2))
        measured = (two - one) / (batch * seq)
        estimated = layer_activation_bytes(config, residual_bytes=4, compute_bytes=2 if bf16 else 4,
                                           swiglu_fused=swiglu_fused)
        assert estimated == pytest.approx(measured, rel=0.10), (hidden, ffn, heads, groups)


def test_lm_head_estimate_scales_with_scored_positions(single_rank):
    """The cross entropy keeps an fp32 softmax per scored position: 4 bytes per vocabulary entry."""
    vocab, batch, seq = 4096, 2, 64
    model = build_encoder_model(preset("tiny", vocab_size=vocab, num_layers=1, seq_length=seq))
    ids = torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    few = torch.zeros(batch, seq)
    few[:, ::4] = 1
    extra = (saved_bytes(model, ids, torch.ones(batch, seq), bf16=False)
             - saved_bytes(model, ids, few, bf16=False)) / (batch * seq * 3 / 4)
    assert extra == pytest.approx(4 * vocab, rel=0.10)


@pytest.mark.parametrize("changes", [{}, {"tie_embeddings": True}, {"add_qkv_bias": True, "qk_layernorm": True}])
def test_stage_parameters_without_model_parallelism_is_the_exact_count(single_rank, changes):
    config = preset("tiny", vocab_size=512, **changes)
    model = build_encoder_model(config)
    assert stage_parameters(config, tensor_parallel=1, pipeline_parallel=1) == parameter_count(config) == sum(
        p.numel() for p in model.parameters())


def _config(tmp_path, tiny_corpus, **sections):
    return run_config_from_dict(_recipe(tiny_corpus, tmp_path, **sections))


def test_estimate_responds_to_each_knob(tmp_path, tiny_corpus):
    base = _config(tmp_path, tiny_corpus)
    one = estimate_memory(base, world_size=1)
    assert one.activations_full_recompute < one.activations_no_recompute == one.activations
    longer = estimate_memory(_config(tmp_path, tiny_corpus, data={"seq_length": 128}), world_size=1)
    assert longer.activations > 1.9 * one.activations
    sharded = _config(tmp_path, tiny_corpus, parallel={"use_distributed_optimizer": True})
    assert estimate_memory(sharded, world_size=2).optimizer_state == pytest.approx(one.optimizer_state / 2, rel=0.01)
    tp2 = estimate_memory(_config(tmp_path, tiny_corpus, parallel={"tensor_model_parallel_size": 2}), world_size=2)
    assert tp2.parameters < 0.6 * one.parameters and tp2.activations < one.activations
    # With two pipeline stages, the first holds two micro-batches in flight (1F1B warm-up).
    pp2 = estimate_memory(_config(tmp_path, tiny_corpus, parallel={"pipeline_model_parallel_size": 2},
                                  data={"micro_batch_size": 2}), world_size=2)
    assert pp2.micro_batches_in_flight == 2


def test_a_run_that_cannot_fit_is_refused_before_allocating(tmp_path, tiny_corpus, capsys):
    """A run that cannot fit: a sequence length far beyond the machine, refused with the estimate and
    the knobs, in --dry-run and before the run builds anything."""
    recipe = _recipe(tiny_corpus, tmp_path, data={"seq_length": 400_000, "micro_batch_size": 8, "global_batch_size": 8},
                     model={"seq_length": 400_000})
    with pytest.raises(UserError, match=r"needs about \d+\.\d GiB per rank but .* usable .*micro_batch_size"):
        pretrain(run_config_from_dict(recipe))
    assert not (tmp_path / "log").exists() and not (tmp_path / "ckpt").exists()  # nothing ran
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert pretrain_encoder.main(["--config", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"memory/rank +params .* GiB per rank", out)
    assert "on this machine: NOT READY, a run here would stop" in out
    assert re.search(r"largest micro-batch within 75 % of that memory, same global batch: "
                     r"([1-7] \(data\.micro_batch_size; 8 in this config\)|none, even 1 exceeds it)", out), out
    path.write_text(yaml.safe_dump(_recipe(tiny_corpus, tmp_path)))
    assert pretrain_encoder.main(["--config", str(path), "--dry-run"]) == 0
    assert "on this machine: fits" in capsys.readouterr().out


H100_80GB_FREE = int(78.5 * 2**30)
"""``torch.cuda.mem_get_info``'s free bytes on an idle H100 80GB HBM3: 79.2 GiB less the CUDA context."""


@pytest.mark.parametrize("size", ["210m", "610m", "1b"])
def test_size_recipes_take_the_largest_micro_batch_that_fits_an_80gb_gpu(size):
    """The rule the size recipes' comments state, computed: the largest micro-batch within 75 % of an
    80 GB H100 on one GPU, same global batch; and a machine with more memory gets a larger one."""
    config = run_config_from_dict(read_recipe(REPO / "examples" / "recipes" / "paper" / f"{size}_mlm_40.yaml"))
    # Among the sizes that split one rank's 18 sequences at 64 ranks (so 8 to 64 ranks split 1,152 evenly).
    chosen = largest_micro_batch(config, world_size=1, usable_bytes=H100_80GB_FREE, sequences_per_rank=18)
    assert chosen == config.data.micro_batch_size
    assert largest_micro_batch(config, world_size=1, usable_bytes=4 * H100_80GB_FREE) > chosen
    assert largest_micro_batch(config, world_size=1, usable_bytes=2**30) is None  # nothing fits 1 GiB
