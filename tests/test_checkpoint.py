"""Checkpoints: exact resume (weights, AdamW state, trainer state), weights-only loads, keep-last,
crash safety, shape checks and error messages (CPU, gloo), and resharding between tensor-parallel
sizes 2 and 1."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core import dist_checkpointing, parallel_state

from distributed import run_ranks
from megatron_ext import platform
from megatron_ext.model import build_encoder_model, gather_vocab_parallel_logits, preset
from megatron_ext.checkpoint.config import CheckpointConfig
from megatron_ext.checkpoint.handle import Checkpoint
from megatron_ext.checkpoint.core import (
    COMPLETE,
    TRACKER,
    latest_checkpoint,
    load_checkpoint,
    read_run_config,
    read_tokenizer_reference,
    save_checkpoint,
)
from megatron_ext.tokenizer import TokenizerConfig
from megatron_ext.training.optim import TorchOptimizerState

TINY = preset("tiny", vocab_size=256)
RUN_CONFIG = {"model": dataclasses.asdict(TINY), "training": {"train_iters": 4}}
TOKENIZER = {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": "botchan_en_bpe_1000.model"}


def build(config=TINY, seed: int = 0):
    torch.manual_seed(seed)
    model = build_encoder_model(config)
    matrices = [p for p in model.parameters() if p.dim() > 1]
    norms = [p for p in model.parameters() if p.dim() == 1]
    optimizer = torch.optim.AdamW(
        [{"params": matrices}, {"params": norms, "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1
    )
    return model, optimizer


def train_step(model, optimizer, seed: int) -> None:
    ids = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    optimizer.zero_grad()
    model(ids, causal=False, labels=ids).mean().backward()
    optimizer.step()


def save(save_dir, step: int, model, optimizer, *, keep_last: int = 2, **trainer_state) -> Path:
    state = {"consumed_samples": 8 * step, "torch_rng_state": torch.get_rng_state(), **trainer_state}
    return save_checkpoint(
        save_dir, step=step, model=model, optimizer=optimizer and TorchOptimizerState(optimizer), trainer_state=state,
        run_config=RUN_CONFIG, tokenizer_reference=TOKENIZER, keep_last=keep_last,
    )


def weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_same_weights(model, expected: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        assert torch.equal(p, expected[name]), name


def assert_same_optimizer(opt_a, model_a, opt_b, model_b) -> None:
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        state_a, state_b = opt_a.state[a], opt_b.state[b]
        assert set(state_a) == set(state_b) == {"step", "exp_avg", "exp_avg_sq"}, name
        for kind in state_a:
            assert torch.equal(state_a[kind], state_b[kind]), (name, kind)
    for group_a, group_b in zip(opt_a.param_groups, opt_b.param_groups, strict=True):
        assert {k: v for k, v in group_a.items() if k != "params"} == {
            k: v for k, v in group_b.items() if k != "params"}


def test_round_trip_resumes_exactly(single_rank, tmp_path):
    model, optimizer = build(seed=0)
    for seed in range(2):
        train_step(model, optimizer, seed)
    rng = torch.get_rng_state()
    generator_state = np.random.default_rng(3).bit_generator.state
    path = save(tmp_path, 2, model, optimizer, numpy_rng=generator_state, wandb_run_id=None)

    assert path == tmp_path / "iter_0000002" and latest_checkpoint(tmp_path) == path
    assert latest_checkpoint(path) == path  # checkpoint.load may name one checkpoint
    assert (tmp_path / TRACKER).read_text().strip() == "2"
    assert read_run_config(tmp_path) == RUN_CONFIG == read_run_config(path)
    assert read_tokenizer_reference(path) == TOKENIZER

    fresh, fresh_optimizer = build(seed=1)
    assert not torch.equal(fresh.output_layer.weight, model.output_layer.weight)
    torch.manual_seed(99)  # the loaded RNG state must not depend on the current one
    state = load_checkpoint(tmp_path, model=fresh, optimizer=TorchOptimizerState(fresh_optimizer))

    assert state["step"] == 2 and state["consumed_samples"] == 16
    assert state["wandb_run_id"] is None and state["numpy_rng"] == generator_state
    assert torch.equal(state["torch_rng_state"], rng)
    assert_same_weights(fresh, weights(model))
    assert_same_optimizer(optimizer, model, fresh_optimizer, fresh)
    train_step(model, optimizer, seed=5)
    train_step(fresh, fresh_optimizer, seed=5)
    assert_same_weights(fresh, weights(model))


def test_weights_only(single_rank, tmp_path):
    model, optimizer = build(seed=0)
    train_step(model, optimizer, 0)
    save(tmp_path / "full", 1, model, optimizer)
    fresh, fresh_optimizer = build(seed=1)
    state = load_checkpoint(tmp_path / "full", model=fresh)  # finetune: weights only
    assert state["step"] == 1
    assert_same_weights(fresh, weights(model))
    assert not fresh_optimizer.state

    save(tmp_path / "weights", 1, model, None)
    with pytest.raises(ValueError, match="holds no optimizer state"):
        load_checkpoint(tmp_path / "weights", model=fresh, optimizer=TorchOptimizerState(fresh_optimizer))
    other, _ = build(seed=2)
    load_checkpoint(tmp_path / "weights", model=other)
    assert_same_weights(other, weights(model))


def test_keep_last_and_same_step_replaced(single_rank, tmp_path):
    model, optimizer = build()
    for step in range(1, 5):
        train_step(model, optimizer, step)
        save(tmp_path, step, model, optimizer, keep_last=2)
    expected = ["iter_0000003", "iter_0000004", TRACKER]
    assert sorted(p.name for p in tmp_path.iterdir()) == expected
    assert latest_checkpoint(tmp_path) == tmp_path / "iter_0000004"

    train_step(model, optimizer, 9)
    save(tmp_path, 4, model, optimizer, keep_last=2)  # e.g. the final save of a resumed run
    assert sorted(p.name for p in tmp_path.iterdir()) == expected
    fresh, _ = build(seed=1)
    load_checkpoint(tmp_path, model=fresh)
    assert_same_weights(fresh, weights(model))


class SimulatedCrash(BaseException):
    """The process dies: nothing after this point of the save runs."""


def test_crash_mid_save_keeps_previous_checkpoint(single_rank, tmp_path, monkeypatch):
    model, optimizer = build()
    train_step(model, optimizer, 0)
    first = save(tmp_path, 1, model, optimizer)
    saved = weights(model)
    train_step(model, optimizer, 1)

    real_save = dist_checkpointing.save

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)  # every shard and Megatron's metadata written ...
        raise SimulatedCrash  # ... then the process dies before the checkpoint is published

    monkeypatch.setattr(dist_checkpointing, "save", save_then_die)
    with pytest.raises(SimulatedCrash):
        save(tmp_path, 2, model, optimizer)
    monkeypatch.undo()

    (half,) = tmp_path.glob("iter_0000002.tmp-*")
    assert (half / "metadata.json").is_file() and not (half / COMPLETE).exists()
    copied = tmp_path / "iter_0000003"  # a checkpoint directory copied without its marker
    copied.mkdir()
    (copied / "metadata.json").write_text((half / "metadata.json").read_text())
    assert latest_checkpoint(tmp_path) == first
    assert (tmp_path / TRACKER).read_text().strip() == "1"
    with pytest.raises(ValueError, match=r"not a complete checkpoint: no checkpoint_complete.json"):
        load_checkpoint(half, model=model)
    fresh, fresh_optimizer = build(seed=1)
    assert load_checkpoint(tmp_path, model=fresh, optimizer=TorchOptimizerState(fresh_optimizer))["step"] == 1
    assert_same_weights(fresh, saved)

    save(tmp_path, 2, model, optimizer)
    assert not list(tmp_path.glob("*.tmp-*"))
    assert latest_checkpoint(tmp_path) == tmp_path / "iter_0000002"


def test_shape_mismatch_lists_tensors(single_rank, tmp_path):
    model, optimizer = build()
    save(tmp_path, 1, model, optimizer)
    bigger, bigger_optimizer = build(preset("tiny", vocab_size=512), seed=1)
    with pytest.raises(ValueError) as error:
        load_checkpoint(tmp_path, model=bigger, optimizer=TorchOptimizerState(bigger_optimizer))
    message = str(error.value)
    assert "(2 tensors differ)" in message
    assert "embedding.word_embeddings.weight: checkpoint (256, 128), model (512, 128)" in message
    assert "output_layer.weight: checkpoint (256, 128), model (512, 128)" in message

    shallower, _ = build(preset("tiny", vocab_size=256, num_layers=2), seed=1)
    with pytest.raises(ValueError, match=r"decoder.layers.mlp.linear_fc2.weight: checkpoint "
                                         r"\(4, 128, 384\), model \(2, 128, 384\)"):
        load_checkpoint(tmp_path, model=shallower)

    # Non-strict (weights only): what fits is loaded, the rest keeps its initialisation.
    embedding = bigger.embedding.word_embeddings.weight.detach().clone()
    load_checkpoint(tmp_path, model=bigger, strict_shapes=False)
    assert torch.equal(bigger.embedding.word_embeddings.weight, embedding)
    expected = weights(model)
    for name, p in bigger.named_parameters():
        if name.startswith("decoder."):
            assert torch.equal(p, expected[name]), name


def test_errors(single_rank, tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load_checkpoint(tmp_path / "missing", model=torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="no complete checkpoint in"):
        load_checkpoint(tmp_path, model=torch.nn.Linear(1, 1))
    assert latest_checkpoint(tmp_path / "missing") is None
    for field, value in (("keep_last", 0), ("save_interval", 0)):
        with pytest.raises(ValueError, match=f"CheckpointConfig.{field}"):
            CheckpointConfig(**{field: value})

    model, optimizer = build()
    with pytest.raises(ValueError, match="weights_only"):
        save(tmp_path / "a", 1, model, optimizer, config=CheckpointConfig())
    with pytest.raises(ValueError, match="run_config must be JSON-serialisable"):
        save_checkpoint(tmp_path / "a", step=1, model=model, optimizer=TorchOptimizerState(optimizer), trainer_state={},
                        run_config={"x": {1, 2}}, tokenizer_reference={}, keep_last=1)
    with pytest.raises(ValueError, match=r"trainer_state\['step'\]=3 differs from step=1"):
        save_checkpoint(tmp_path / "a", step=1, model=model, optimizer=TorchOptimizerState(optimizer),
                        trainer_state={"step": 3}, run_config={}, tokenizer_reference={},
                        keep_last=1)
    assert not (tmp_path / "a").exists()  # refused before anything is written

    train_step(model, optimizer, 0)
    path = save(tmp_path / "b", 1, model, optimizer)
    (shard,) = path.glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ValueError, match="is corrupt or incomplete"):
        load_checkpoint(path, model=model, optimizer=TorchOptimizerState(optimizer))
    (path / COMPLETE).unlink()
    with pytest.raises(ValueError, match="the save did not finish"):
        load_checkpoint(path, model=model)
    with pytest.raises(ValueError, match="no complete checkpoint in"):
        read_run_config(tmp_path / "b")


WORLD = 2


def resharding_worker(rank: int, rendezvous: str, root: str) -> None:
    """TP=2 -> save -> load at TP=1 -> save -> load at TP=2: weights and AdamW state exact."""
    root_dir = Path(root)
    platform.init_process_group_and_model_parallel(
        tensor_parallel_size=2, init_method=rendezvous, rank=rank, world_size=WORLD
    )
    model, optimizer = build(seed=0)
    train_step(model, optimizer, 0)
    ids = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = gather_vocab_parallel_logits(model(ids, causal=False))
    shards = weights(model)
    save(root_dir / "tp2", 1, model, optimizer)

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    whole, whole_optimizer = build(seed=1)
    assert whole.output_layer.weight.shape[0] == TINY.vocab_size
    assert load_checkpoint(root_dir / "tp2", model=whole, optimizer=TorchOptimizerState(whole_optimizer))["step"] == 1
    with torch.no_grad():
        torch.testing.assert_close(whole(ids, causal=False), logits, atol=1e-5, rtol=1e-5)
    assert whole_optimizer.state[whole.output_layer.weight]["exp_avg"].abs().sum() > 0
    save(root_dir / "tp1", 1, whole, whole_optimizer)

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    again, again_optimizer = build(seed=2)
    load_checkpoint(root_dir / "tp1", model=again, optimizer=TorchOptimizerState(again_optimizer))
    assert_same_weights(again, shards)
    assert_same_optimizer(optimizer, model, again_optimizer, again)
    train_step(model, optimizer, 1)
    train_step(again, again_optimizer, 1)
    assert_same_weights(again, weights(model))
    platform.destroy_process_group_and_model_parallel()


def test_reshard_between_tensor_parallel_sizes(tmp_path):
    run_ranks(resharding_worker, str(tmp_path), world=WORLD, tmp_path=tmp_path)


def test_handle_resolves_once_and_reads_what_was_saved(single_rank, tmp_path):
    model, optimizer = build()
    save(tmp_path, 1, model, optimizer)
    train_step(model, optimizer, 1)
    newest = save(tmp_path, 2, model, optimizer)

    checkpoint = Checkpoint.open(tmp_path)  # a save directory names its newest checkpoint
    assert checkpoint == Checkpoint.open(newest) == Checkpoint.latest(tmp_path)
    assert (checkpoint.path, checkpoint.step) == (newest, 2)
    assert checkpoint.model_config() == TINY
    assert checkpoint.tokenizer_config() == TokenizerConfig(**TOKENIZER)
    assert checkpoint.optimizer_format() == {"optimizer": "torch"}
    fresh, _ = build(seed=1)
    assert checkpoint.load(model=fresh)["step"] == 2
    assert_same_weights(fresh, weights(model))

    assert Checkpoint.latest(tmp_path / "missing") is None and Checkpoint.latest(None) is None
    with pytest.raises(ValueError, match="no complete checkpoint at .*missing: not a directory"):
        Checkpoint.open(tmp_path / "missing")
    (newest / COMPLETE).unlink()
    with pytest.raises(ValueError, match="not a complete checkpoint: no checkpoint_complete.json"):
        Checkpoint.open(newest)
    assert Checkpoint.open(tmp_path).step == 1  # the newest COMPLETE one
    run_config = json.loads((tmp_path / "iter_0000001" / "run_config.json").read_text())
    (tmp_path / "iter_0000001" / "run_config.json").write_text(json.dumps({**run_config, "model": {"hidden": 1}}))
    with pytest.raises(ValueError, match=r"iter_0000001/run_config.json model.*hidden"):
        Checkpoint.open(tmp_path).model_config()


class _NormWithExtraState(torch.nn.Module):
    """What Transformer Engine's modules add to a state dict and the local spec's lack: an
    ``_extra_state`` (TE keeps its FP8 scaling history there). Only the method pair matters; the
    class is swapped onto a real local-spec norm, whose weights stay as they are."""

    def get_extra_state(self):
        return getattr(self, "fp8_meta", {"scale_history": torch.zeros(4)})

    def set_extra_state(self, state) -> None:
        self.fp8_meta = state


def _with_extra_state(model):
    norm = model.decoder.final_layernorm
    norm.__class__ = type("NormWithExtraState", (_NormWithExtraState, type(norm)), {})
    return model


def test_checkpoints_cross_between_specs_with_and_without_extra_state(single_rank, tmp_path, caplog):
    """A checkpoint of the local spec loads into a model whose modules carry Transformer Engine's
    ``_extra_state`` (initialised fresh, one warning), weights and optimizer alike, and such a
    model's checkpoint loads into the local spec (its extra entries are not read). The GPU test
    ``test_checkpoints_cross_between_local_and_te_specs`` runs the real TE spec."""
    local, local_optimizer = build(seed=0)
    train_step(local, local_optimizer, seed=1)
    save(tmp_path / "local", 1, local, local_optimizer)

    te_like, te_optimizer = build(seed=5)
    _with_extra_state(te_like)
    with caplog.at_level("WARNING", logger="megatron_ext.checkpoint.core"):
        load_checkpoint(tmp_path / "local", model=te_like, optimizer=TorchOptimizerState(te_optimizer))
    assert "no Transformer Engine state for 1 modules" in caplog.text
    assert not hasattr(te_like.decoder.final_layernorm, "fp8_meta")  # fresh: nothing was set
    loaded = te_like.state_dict()
    for name, value in local.state_dict().items():
        if torch.is_tensor(value):
            assert torch.equal(value, loaded[name]), name
    assert local_optimizer.state_dict()["state"].keys() == te_optimizer.state_dict()["state"].keys()
    for index, saved in local_optimizer.state_dict()["state"].items():
        assert torch.equal(saved["exp_avg"], te_optimizer.state_dict()["state"][index]["exp_avg"])

    te_like.decoder.final_layernorm.fp8_meta = {"scale_history": torch.arange(4.0)}
    save(tmp_path / "te_like", 2, te_like, te_optimizer)
    plain, _ = build(seed=7)
    load_checkpoint(tmp_path / "te_like", model=plain, optimizer=None)
    reloaded = _with_extra_state(build(seed=9)[0])
    load_checkpoint(tmp_path / "te_like", model=reloaded, optimizer=None)  # and back: the state is read
    assert torch.equal(reloaded.decoder.final_layernorm.fp8_meta["scale_history"], torch.arange(4.0))
    assert torch.equal(plain.output_layer.weight, te_like.output_layer.weight)


def test_only_extra_state_may_be_absent_from_a_checkpoint(single_rank, tmp_path):
    """The key-matching rule: an absent ``_extra_state`` object starts fresh; any other absent
    object is refused, its key named."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_ext.checkpoint.core import _fresh_extra_states

    saved = {"decoder.layers.self_attention.linear_qkv._extra_state/shard_0_1": None}
    wanted = {name: ShardedObject(key, None, (1,), (0,)) for name, key in (
        ("decoder.layers.0.self_attention.linear_qkv._extra_state", "decoder.layers.self_attention.linear_qkv._extra_state"),
        ("decoder.final_layernorm._extra_state", "decoder.final_layernorm._extra_state"),
        ("embedding.rng_state", "embedding.rng_state"))}
    assert _fresh_extra_states({k: v for k, v in wanted.items() if k != "embedding.rng_state"}, saved,
                               tmp_path) == ["decoder.final_layernorm._extra_state"]
    with pytest.raises(ValueError, match=r"lacks 1 entries the model needs: embedding\.rng_state/shard_0_1"):
        _fresh_extra_states(wanted, saved, tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not platform.transformer_engine_available(),
                    reason="needs Transformer Engine")
def test_checkpoints_cross_between_local_and_te_specs(tmp_path, tiny_corpus):
    """Resuming with the optimizer across specs (distributed optimizer, dp_reshardable): 3 steps
    with one spec, 3 more with the other, against 6 straight steps of the local spec. The same
    weights, data and masks, so only kernel rounding separates them (bf16: well under 2 % in 6
    steps); optimizer state loaded into the wrong parameters would not stay within it."""
    from helpers import tiny_recipe
    from megatron_ext.training.config import run_config_from_dict
    from megatron_ext.training.loop import pretrain

    def recipe(run: str, backend: str) -> dict:
        return tiny_recipe(tiny_corpus, tmp_path / run, model={"attention_backend": backend},
                           training={"train_iters": 6, "eval_interval": 0, "bf16": True},
                           parallel={"use_distributed_optimizer": True})

    straight = pretrain(run_config_from_dict(recipe("straight", "local"))).losses
    for first, then in (("local", "te"), ("te", "local")):
        run = f"{first}_then_{then}"
        pretrain(run_config_from_dict(recipe(run, first)), exit_after_step=3)
        resumed = pretrain(run_config_from_dict(recipe(run, then)))
        assert resumed.start_step == 3
        for step in (4, 5, 6):
            assert resumed.losses[step] == pytest.approx(straight[step], rel=2e-2), (run, step)
