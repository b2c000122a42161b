"""The effect of Megatron-named settings no other test changes from their default: each is set to
another value and the part it should reach (the layers, Megatron's optimizer and DDP, the data
loader, W&B, the checkpoints kept) shows it (``megatron_flags.MEGATRON_FLAGS_HERE`` names these)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_ext.model.attention import attention_pattern
from megatron_ext.model import build_encoder_model, preset
from megatron_ext.training.recipe import run_config_from_dict
from helpers import tiny_recipe

TINY = preset("tiny", vocab_size=1000)


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, packed_seq_params=attention_pattern(causal=False))


def test_dropouts_reach_the_layers_and_act_in_training_only(single_rank):
    """``--attention-dropout`` / ``--hidden-dropout`` (0 here, Megatron-LM's 0.1): with 0.5, two
    training-mode forwards of one input differ and evaluation-mode ones do not; at 0 neither does."""
    ids = torch.randint(3, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    for field in ("attention_dropout", "hidden_dropout"):
        torch.manual_seed(0)
        model = build_encoder_model(dataclasses.replace(TINY, **{field: 0.5}))
        assert getattr(model.config, field) == 0.5
        model.train()
        assert not torch.equal(_logits(model, ids), _logits(model, ids)), field
        model.eval()
        assert torch.equal(_logits(model, ids), _logits(model, ids)), field
    torch.manual_seed(0)
    model = build_encoder_model(TINY).train()
    assert torch.equal(_logits(model, ids), _logits(model, ids))


def test_init_method_std_sets_the_spread_of_every_matrix(single_rank):
    """``--init-method-std`` 0.05 instead of the default 0.02 (depth-scaled output projections aside)."""
    torch.manual_seed(0)
    model = build_encoder_model(dataclasses.replace(TINY, init_method_std=0.05, depth_scaled_init=False))
    for name, param in model.named_parameters():
        if param.dim() == 2:
            assert param.std().item() == pytest.approx(0.05, rel=0.05), name


def test_adam_and_ddp_settings_reach_megatrons_optimizer_and_ddp(single_rank, tmp_path):
    """``--adam-beta1/2``, ``--adam-eps`` (set away from their defaults) are the betas and eps of
    Megatron's optimizer; ``--overlap-grad-reduce`` / ``--overlap-param-gather`` its DDP's."""
    from megatron_ext.training.megatron_engine import MegatronEngine, megatron_transformer_overrides

    corpus = {"tokenizer": "unused", "data": "unused"}
    config = run_config_from_dict(tiny_recipe(
        corpus, tmp_path, optimizer={"adam_beta1": 0.8, "adam_beta2": 0.99, "adam_eps": 1e-3},
        parallel={"use_distributed_optimizer": True, "overlap_grad_reduce": True, "overlap_param_gather": True}),
        tokenizer_vocab_size=1000)
    torch.manual_seed(0)
    model = build_encoder_model(config.model, transformer_overrides=megatron_transformer_overrides(config))
    engine = MegatronEngine(model, config)
    try:
        groups = engine.optimizer.param_groups
        assert groups and all(g["betas"] == (0.8, 0.99) and g["eps"] == 1e-3 for g in groups)
        ddp = engine.ddp.ddp_config
        assert ddp.overlap_grad_reduce and ddp.overlap_param_gather and ddp.use_distributed_optimizer
    finally:
        engine.close()


def test_wandb_project_and_experiment_name_name_the_wandb_run(tmp_path):
    """``--wandb-project`` and ``--wandb-exp-name`` are the project and name of the W&B run (written
    offline); without a name, the log directory's."""
    from megatron_ext.training.config import LoggingConfig
    from megatron_ext.training.step_log import MetricSinks

    for name, expected in (("my-exp", "my-exp"), (None, "logs")):
        config = LoggingConfig(log_dir=str(tmp_path / expected / "logs" if name else tmp_path / "logs"),
                               wandb_mode="offline", wandb_project="my-project", wandb_exp_name=name)
        sinks = MetricSinks(config, run_config={}, wandb_run_id=None)
        try:
            assert sinks.wandb.project == "my-project" and sinks.wandb.name == expected
        finally:
            sinks.close()
