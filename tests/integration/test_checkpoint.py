"""Checkpoints: exact resume (weights, the Megatron engine's AdamW state, trainer state), weights-only
loads, keep-last, crash safety, shape checks and error messages (CPU, gloo), each asynchronous
writer (``checkpoint.async_strategy``), and resharding between tensor-parallel sizes 2 and 1."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core import dist_checkpointing, parallel_state

from distributed import run_ranks
from megatron_ext.model.attention import attention_pattern
from megatron_ext import hardware, process_group
from megatron_ext.model import build_encoder_model, gather_vocab_parallel_logits, preset
from megatron_ext.objectives import MaskingConfig, apply_mlm
from megatron_ext.checkpoint import reader, writer
from megatron_ext.checkpoint.config import NVRX_MIN_VERSION, CheckpointConfig, check_nvrx_async_writer, nvrx_problem
from megatron_ext.checkpoint.reader import COMPLETE, Checkpoint, latest_checkpoint
from megatron_ext.checkpoint.writer import TRACKER, CheckpointSaver, save_checkpoint
from megatron_ext.tokenizer import TokenizerConfig
from megatron_ext.training.recipe import run_config_from_dict
from megatron_ext.training.megatron_engine import MegatronEngine, MicroBatch, megatron_transformer_overrides

TINY = preset("tiny", vocab_size=256)
RUN_CONFIG = {"model": dataclasses.asdict(TINY), "training": {"train_iters": 4}}
TOKENIZER = {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": "botchan_en_bpe_1000.model"}
SEQ, MICRO = 16, 2


def run_config(model=TINY):
    """The run config the engine reads (optimizer, batch shape); its data is never read."""
    raw = {"model": {"preset": "tiny", "vocab_size": model.vocab_size}, "tokenizer": {"tokenizer_model": "unused"},
           "data": {"data_path": ["unused"], "seq_length": SEQ, "micro_batch_size": MICRO,
                    "global_batch_size": MICRO},
           "schedule": {"lr": 1e-2, "lr_decay_style": "constant", "lr_warmup_iters": 0},
           "phases": [{"objective": "mlm", "mask_ratio": 0.4, "share": 1.0}], "training": {"train_iters": 10}}
    return dataclasses.replace(run_config_from_dict(raw), model=model)


def build_model(config=TINY, seed: int = 0):
    torch.manual_seed(seed)
    return build_encoder_model(config, transformer_overrides=megatron_transformer_overrides(run_config(config)))


def build(config=TINY, seed: int = 0) -> MegatronEngine:
    """The model and the trainer's engine around it (Megatron-Core DDP and AdamW)."""
    return MegatronEngine(build_model(config, seed), run_config(config))


def train_step(engine: MegatronEngine, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, TINY.vocab_size, (MICRO, SEQ), generator=gen)
    batch = apply_mlm(tokens, config=MaskingConfig(mask_ratio=0.4), mask_id=3, vocab_size=TINY.vocab_size,
                      special_ids=(0, 1, 2, 3), generator=gen)
    assert not engine.train_step([MicroBatch(batch, None)], lr=1e-2).skipped


def save(save_dir, step: int, engine: MegatronEngine, *, weights_only: bool = False, keep_last: int = 2,
         **trainer_state) -> Path:
    state = {"consumed_samples": 8 * step, "torch_rng_state": torch.get_rng_state(), **trainer_state}
    return save_checkpoint(
        save_dir, step=step, model=engine.checkpoint_model, optimizer=None if weights_only else engine.optimizer_state,
        trainer_state=state, run_config=RUN_CONFIG, model_config=RUN_CONFIG["model"], tokenizer_reference=TOKENIZER,
        keep_last=keep_last,
    )


def load(location, target, **kwargs) -> dict:
    """Load into an engine (weights and optimizer state) or a bare model (weights only)."""
    if isinstance(target, MegatronEngine):
        return Checkpoint.open(location).load(model=target.checkpoint_model, optimizer=target.optimizer_state,
                                              **kwargs)
    return Checkpoint.open(location).load(model=target, **kwargs)


def weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_same_weights(model, expected: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        assert torch.equal(p, expected[name]), name


def optimizer_state(engine: MegatronEngine) -> dict:
    """The AdamW state of each named parameter, and the parameter groups' settings."""
    adam = engine.optimizer.optimizer
    per_param = {name: {kind: value.clone() for kind, value in adam.state[p].items()}
                 for name, p in engine.checkpoint_model.named_parameters()}
    groups = [{k: v for k, v in group.items() if k != "params"} for group in adam.param_groups]
    return {"params": per_param, "groups": groups}


def assert_same_optimizer(engine: MegatronEngine, expected: dict) -> None:
    found = optimizer_state(engine)
    for name, state in expected["params"].items():
        assert set(state) == set(found["params"][name]) == {"step", "exp_avg", "exp_avg_sq"}, name
        for kind in state:
            assert torch.equal(state[kind], found["params"][name][kind]), (name, kind)
    assert found["groups"] == expected["groups"]


def test_round_trip_resumes_exactly(single_rank, tmp_path):
    engine = build(seed=0)
    for seed in range(2):
        train_step(engine, seed)
    rng = torch.get_rng_state()
    generator_state = np.random.default_rng(3).bit_generator.state
    path = save(tmp_path, 2, engine, numpy_rng=generator_state, wandb_run_id=None)

    assert path == tmp_path / "iter_0000002" and latest_checkpoint(tmp_path) == path
    assert latest_checkpoint(path) == path  # checkpoint.load may name one checkpoint
    assert (tmp_path / TRACKER).read_text().strip() == "2"
    assert Checkpoint.open(tmp_path).run_config() == RUN_CONFIG == Checkpoint.open(path).run_config()
    assert Checkpoint.open(path).tokenizer_config() == TokenizerConfig(**TOKENIZER)

    fresh = build(seed=1)
    model = engine.checkpoint_model
    assert not torch.equal(fresh.checkpoint_model.output_layer.weight, model.output_layer.weight)
    torch.manual_seed(99)  # the loaded RNG state must not depend on the current one
    state = load(tmp_path, fresh)

    assert state["step"] == 2 and state["consumed_samples"] == 16
    assert state["wandb_run_id"] is None and state["numpy_rng"] == generator_state
    assert torch.equal(state["torch_rng_state"], rng)
    assert_same_weights(fresh.checkpoint_model, weights(model))
    assert_same_optimizer(fresh, optimizer_state(engine))
    train_step(engine, seed=5)
    train_step(fresh, seed=5)
    assert_same_weights(fresh.checkpoint_model, weights(model))


def test_weights_only(single_rank, tmp_path):
    engine = build(seed=0)
    train_step(engine, 0)
    save(tmp_path / "full", 1, engine)
    fresh = build(seed=1)
    state = load(tmp_path / "full", fresh.checkpoint_model)  # finetune: weights only
    assert state["step"] == 1
    assert_same_weights(fresh.checkpoint_model, weights(engine.checkpoint_model))
    assert not fresh.optimizer.optimizer.state

    save(tmp_path / "weights", 1, engine, weights_only=True)
    with pytest.raises(ValueError, match="holds no optimizer state"):
        load(tmp_path / "weights", fresh)
    other = build_model(seed=2)
    load(tmp_path / "weights", other)
    assert_same_weights(other, weights(engine.checkpoint_model))


def test_keep_last_and_same_step_replaced(single_rank, tmp_path):
    engine = build()
    for step in range(1, 5):
        train_step(engine, step)
        save(tmp_path, step, engine, keep_last=2)
    expected = ["iter_0000003", "iter_0000004", TRACKER]
    assert sorted(p.name for p in tmp_path.iterdir()) == expected
    assert latest_checkpoint(tmp_path) == tmp_path / "iter_0000004"

    train_step(engine, 9)
    save(tmp_path, 4, engine, keep_last=2)  # e.g. the final save of a resumed run
    assert sorted(p.name for p in tmp_path.iterdir()) == expected
    fresh = build_model(seed=1)
    load(tmp_path, fresh)
    assert_same_weights(fresh, weights(engine.checkpoint_model))


class SimulatedCrash(BaseException):
    """The process dies: nothing after this point of the save runs."""


def test_crash_mid_save_keeps_previous_checkpoint(single_rank, tmp_path, monkeypatch):
    engine = build()
    train_step(engine, 0)
    first = save(tmp_path, 1, engine)
    saved = weights(engine.checkpoint_model)
    train_step(engine, 1)

    real_save = dist_checkpointing.save

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)  # every shard and Megatron's metadata written ...
        raise SimulatedCrash  # ... then the process dies before the checkpoint is published

    monkeypatch.setattr(dist_checkpointing, "save", save_then_die)
    with pytest.raises(SimulatedCrash):
        save(tmp_path, 2, engine)
    monkeypatch.undo()

    (half,) = tmp_path.glob("iter_0000002.tmp-*")
    assert (half / "metadata.json").is_file() and not (half / COMPLETE).exists()
    copied = tmp_path / "iter_0000003"  # a checkpoint directory copied without its marker
    copied.mkdir()
    (copied / "metadata.json").write_text((half / "metadata.json").read_text())
    assert latest_checkpoint(tmp_path) == first
    assert (tmp_path / TRACKER).read_text().strip() == "1"
    with pytest.raises(ValueError, match=r"not a complete checkpoint: no checkpoint_complete.json"):
        load(half, engine.checkpoint_model)
    fresh = build(seed=1)
    assert load(tmp_path, fresh)["step"] == 1
    assert_same_weights(fresh.checkpoint_model, saved)

    save(tmp_path, 2, engine)
    assert not list(tmp_path.glob("*.tmp-*"))
    assert latest_checkpoint(tmp_path) == tmp_path / "iter_0000002"


def test_shape_mismatch_lists_tensors(single_rank, tmp_path):
    engine = build()
    save(tmp_path, 1, engine)
    bigger = build(preset("tiny", vocab_size=512), seed=1)
    with pytest.raises(ValueError) as error:
        load(tmp_path, bigger)
    message = str(error.value)
    assert "(2 tensors differ)" in message
    assert "embedding.word_embeddings.weight: checkpoint (256, 128), model (512, 128)" in message
    assert "output_layer.weight: checkpoint (256, 128), model (512, 128)" in message

    shallower = build_model(preset("tiny", vocab_size=256, num_layers=2), seed=1)
    with pytest.raises(ValueError, match=r"decoder.layers.mlp.linear_fc2.weight: checkpoint "
                                         r"\(4, 128, 384\), model \(2, 128, 384\)"):
        load(tmp_path, shallower)

    # Non-strict (weights only): what fits is loaded, the rest keeps its initialisation.
    bigger = bigger.checkpoint_model
    embedding = bigger.embedding.word_embeddings.weight.detach().clone()
    load(tmp_path, bigger, strict_shapes=False)
    assert torch.equal(bigger.embedding.word_embeddings.weight, embedding)
    expected = weights(engine.checkpoint_model)
    for name, p in bigger.named_parameters():
        if name.startswith("decoder."):
            assert torch.equal(p, expected[name]), name


def test_errors(single_rank, tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load(tmp_path / "missing", torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="no complete checkpoint in"):
        load(tmp_path, torch.nn.Linear(1, 1))
    assert latest_checkpoint(tmp_path / "missing") is None
    for field, value, message in (("keep_last", -1, r"checkpoint.keep_last must be >= 1, or 0 to keep every"),
                                  ("save_interval", 0, "CheckpointConfig.save_interval")):
        with pytest.raises(ValueError, match=message):
            CheckpointConfig(**{field: value})
    assert CheckpointConfig(keep_last=0).keep_last == 0  # every checkpoint kept, as Megatron-LM does

    engine = build()
    model = engine.checkpoint_model
    with pytest.raises(ValueError, match="weights_only"):
        save(tmp_path / "a", 1, engine, config=CheckpointConfig())
    with pytest.raises(ValueError, match="run_config must be JSON-serialisable"):
        save_checkpoint(tmp_path / "a", step=1, model=model, optimizer=engine.optimizer_state, trainer_state={},
                        run_config={"x": {1, 2}}, model_config={}, tokenizer_reference={}, keep_last=1)
    with pytest.raises(ValueError, match=r"trainer_state\['step'\]=3 differs from step=1"):
        save_checkpoint(tmp_path / "a", step=1, model=model, optimizer=engine.optimizer_state,
                        trainer_state={"step": 3}, run_config={}, model_config={}, tokenizer_reference={},
                        keep_last=1)
    assert not (tmp_path / "a").exists()  # refused before anything is written

    train_step(engine, 0)
    path = save(tmp_path / "b", 1, engine)
    (shard,) = path.glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"is damaged: {shard.name} has \d+ bytes, \d+ recorded; no other"):
        load(path, engine)
    (path / COMPLETE).unlink()
    with pytest.raises(ValueError, match="the save did not finish"):
        load(path, model)
    with pytest.raises(ValueError, match="no complete checkpoint in"):
        Checkpoint.open(tmp_path / "b")


NVRX_UNUSABLE = nvrx_problem()
"""Why NVIDIA's resiliency package cannot write asynchronous saves here (None: it can). Not in
requirements.txt: PyPI offers 0.4.1 and megatron-core 0.19.2 takes >= 0.6.0 (docs/gpu.md)."""


@pytest.mark.skipif(NVRX_UNUSABLE is not None, reason=str(NVRX_UNUSABLE))
def test_an_nvrx_async_save_holds_the_state_of_its_step_while_training_goes_on(single_rank, tmp_path):
    """NVRx's writer (``checkpoint.async_strategy: nvrx``; Megatron's own is checked by the killed
    and resumed runs of test_megatron_engine and test_edges): two steps are trained while the forked
    writer writes; the checkpoint holds the weights and AdamW state of the step it was asked for."""
    async_strategy = "nvrx"
    engine = build(seed=0)
    train_step(engine, 0)
    at_save, optimizer_at_save = weights(engine.checkpoint_model), optimizer_state(engine)
    with CheckpointSaver(async_save=True, async_strategy=async_strategy) as saver:
        with engine.checkpointing():
            saver.save(tmp_path, step=1, model=engine.checkpoint_model, optimizer=engine.optimizer_state,
                       trainer_state={}, run_config=RUN_CONFIG, model_config=RUN_CONFIG["model"],
                       tokenizer_reference=TOKENIZER, keep_last=1)
        for seed in (1, 2):  # the parameters change under the writer
            train_step(engine, seed)
            saver.poll()
    fresh = build(seed=1)
    assert load(tmp_path, fresh)["step"] == 1
    assert_same_weights(fresh.checkpoint_model, at_save)
    assert_same_optimizer(fresh, optimizer_at_save)


def test_the_nvrx_writer_is_refused_in_one_line_where_it_cannot_run(monkeypatch):
    """``checkpoint.async_strategy: nvrx`` without ``async_save`` is a config error; without NVRx, or
    with one older than Megatron takes, the run stops before anything is built (``pretrain`` checks
    before the process group), in one line."""
    import importlib.metadata

    from megatron.core.dist_checkpointing.strategies.nvrx import NVRX_MIN_VERSION as MEGATRONS

    assert NVRX_MIN_VERSION == MEGATRONS
    with pytest.raises(ValueError, match=r"^checkpoint.async_strategy: nvrx chooses the writer of asynchronous saves"):
        CheckpointConfig(async_strategy="nvrx")
    CheckpointConfig(async_strategy="nvrx", async_save=True)  # what the machine has is checked at run start
    installed = {"nvidia-resiliency-ext": None}
    real_version = importlib.metadata.version

    def version(name: str) -> str:
        if name != "nvidia-resiliency-ext":
            return real_version(name)
        if installed[name] is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    for found, expected in ((None, "nvidia-resiliency-ext is not installed"),
                            ("0.4.1", "nvidia-resiliency-ext 0.4.1 is installed and megatron-core 0.19.2 needs >= 0.6.0; "
                                      "below that Megatron fails at import")):
        installed["nvidia-resiliency-ext"] = found
        with pytest.raises(ValueError, match=rf"^checkpoint.async_strategy: nvrx: {expected}") as error:
            check_nvrx_async_writer()
        assert "\n" not in str(error.value) and str(error.value).endswith("or set checkpoint.async_strategy: mcore")
    installed["nvidia-resiliency-ext"] = NVRX_MIN_VERSION
    assert nvrx_problem() is None


@pytest.mark.skipif(NVRX_UNUSABLE is None, reason="nvidia-resiliency-ext can run here")
def test_without_nvrx_the_saver_refuses_it_and_leaves_nothing_running(single_rank):
    users = writer._results_queue._users
    with pytest.raises(ValueError, match="^checkpoint.async_strategy: nvrx: nvidia-resiliency-ext"):
        CheckpointSaver(async_save=True, async_strategy="nvrx")
    assert writer._results_queue._users == users  # refused before the results queue's manager started


WORLD = 2


def resharding_worker(rank: int, rendezvous: str, root: str) -> None:
    """TP=2 -> save -> load at TP=1 -> save -> load at TP=2: weights and AdamW state exact, and the
    next step the same as the saving engine's."""
    root_dir = Path(root)
    process_group.init_process_group_and_model_parallel(
        tensor_parallel_size=2, init_method=rendezvous, rank=rank, world_size=WORLD
    )
    engine = build(seed=0)
    train_step(engine, 0)
    ids = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        bidirectional = attention_pattern(causal=False)
        logits = gather_vocab_parallel_logits(engine.checkpoint_model(ids, packed_seq_params=bidirectional))
    shards, saved_optimizer = weights(engine.checkpoint_model), optimizer_state(engine)
    save(root_dir / "tp2", 1, engine)
    train_step(engine, 1)
    after_next_step = weights(engine.checkpoint_model)

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    whole = build(seed=1)
    assert whole.checkpoint_model.output_layer.weight.shape[0] == TINY.vocab_size
    assert load(root_dir / "tp2", whole)["step"] == 1
    with torch.no_grad():
        torch.testing.assert_close(whole.checkpoint_model(ids, packed_seq_params=bidirectional), logits,
                                   atol=1e-5, rtol=1e-5)
    assert optimizer_state(whole)["params"]["output_layer.weight"]["exp_avg"].abs().sum() > 0
    save(root_dir / "tp1", 1, whole)

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    again = build(seed=2)
    load(root_dir / "tp1", again)
    assert_same_weights(again.checkpoint_model, shards)
    assert_same_optimizer(again, saved_optimizer)
    train_step(again, 1)
    assert_same_weights(again.checkpoint_model, after_next_step)
    process_group.destroy_process_group_and_model_parallel()


def test_reshard_between_tensor_parallel_sizes(tmp_path):
    run_ranks(resharding_worker, str(tmp_path), world=WORLD, tmp_path=tmp_path)


def test_a_resolved_checkpoint_resolves_once_and_reads_what_was_saved(single_rank, tmp_path, monkeypatch):
    engine = build()
    save(tmp_path, 1, engine)
    train_step(engine, 1)
    newest = save(tmp_path, 2, engine)

    checkpoint = Checkpoint.open(tmp_path)  # a save directory names its newest checkpoint
    assert checkpoint == Checkpoint.open(newest) == Checkpoint.latest(tmp_path)
    assert (checkpoint.path, checkpoint.step) == (newest, 2)
    assert checkpoint.model_config() == TINY
    assert checkpoint.tokenizer_config() == TokenizerConfig(**TOKENIZER)
    assert checkpoint.optimizer_format()["optimizer"] == "megatron"
    fresh = build_model(seed=1)
    assert checkpoint.load(model=fresh)["step"] == 2
    assert_same_weights(fresh, weights(engine.checkpoint_model))

    # Resolved once: no read goes back to the save directory (a newer checkpoint appearing there
    # changes nothing for this handle).
    def resolving_again(*args, **kwargs):
        raise AssertionError("resolved again")

    monkeypatch.setattr(Checkpoint, "open", resolving_again)
    monkeypatch.setattr(reader, "latest_checkpoint", resolving_again)
    monkeypatch.setattr(reader, "complete_checkpoints", resolving_again)
    assert (checkpoint.step, checkpoint.run_config(), checkpoint.model_config(), checkpoint.tokenizer_config(),
            checkpoint.tokenizer_fingerprint(), checkpoint.optimizer_format()["optimizer"]) == (
        2, RUN_CONFIG, TINY, TokenizerConfig(**TOKENIZER), None, "megatron")
    assert checkpoint.load(model=build(seed=3).checkpoint_model)["step"] == 2
    monkeypatch.undo()

    assert Checkpoint.latest(tmp_path / "missing") is None and Checkpoint.latest(None) is None
    with pytest.raises(ValueError, match="no complete checkpoint at .*missing: not a directory"):
        Checkpoint.open(tmp_path / "missing")
    (newest / COMPLETE).unlink()
    with pytest.raises(ValueError, match="not a complete checkpoint: no checkpoint_complete.json"):
        Checkpoint.open(newest)
    assert Checkpoint.open(tmp_path).step == 1  # the newest COMPLETE one
    saved_model = json.loads((tmp_path / "iter_0000001" / "model_config.json").read_text())
    assert Checkpoint.open(tmp_path).model_config() == TINY and Checkpoint.open(tmp_path).run_config() == RUN_CONFIG
    # A key an earlier version wrote is refused, naming where it went (config_loading.MOVED_KEYS).
    old_model = {("attention_backend" if k == "transformer_impl" else k): v for k, v in saved_model.items()}
    (tmp_path / "iter_0000001" / "model_config.json").write_text(json.dumps(old_model))
    with pytest.raises(ValueError, match=r"model_config.json model: unknown key\(s\) \['attention_backend'\] "
                                         r"\(attention_backend is now model.transformer_impl\)"):
        Checkpoint.open(tmp_path).model_config()
    (tmp_path / "iter_0000001" / "model_config.json").write_text(json.dumps({"hidden": 1}))
    with pytest.raises(ValueError, match=r"iter_0000001/model_config.json model.*hidden"):
        Checkpoint.open(tmp_path).model_config()
    # Saved by an earlier version (no model_config.json): the run config's model section, unless the
    # run's phases changed the RoPE base, which that section would misstate.
    (tmp_path / "iter_0000001" / "model_config.json").unlink()
    marker = json.loads((tmp_path / "iter_0000001" / COMPLETE).read_text())
    del marker["files"]["model_config.json"]
    (tmp_path / "iter_0000001" / COMPLETE).write_text(json.dumps(marker))
    assert Checkpoint.open(tmp_path).model_config() == TINY
    run_config = json.loads((tmp_path / "iter_0000001" / "run_config.json").read_text())
    (tmp_path / "iter_0000001" / "run_config.json").write_text(json.dumps(
        {**run_config, "phases": [{"objective": "mlm", "share": 1.0, "rope_base": 160000.0}]}))
    with pytest.raises(ValueError, match=r"no model_config.json .* phases change the RoPE base \(rope_base\)"):
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
    local = build(seed=0)
    train_step(local, seed=1)
    save(tmp_path / "local", 1, local)

    te_like = MegatronEngine(_with_extra_state(build_model(seed=5)), run_config())
    with caplog.at_level("WARNING", logger="megatron_ext.checkpoint.reader"):
        load(tmp_path / "local", te_like)
    assert "no Transformer Engine state for 1 modules" in caplog.text
    te_model = te_like.checkpoint_model
    assert not hasattr(te_model.decoder.final_layernorm, "fp8_meta")  # fresh: nothing was set
    loaded = te_model.state_dict()
    for name, value in local.checkpoint_model.state_dict().items():
        if torch.is_tensor(value):
            assert torch.equal(value, loaded[name]), name
    assert_same_optimizer(te_like, optimizer_state(local))

    te_model.decoder.final_layernorm.fp8_meta = {"scale_history": torch.arange(4.0)}
    save(tmp_path / "te_like", 2, te_like)
    plain = build_model(seed=7)
    load(tmp_path / "te_like", plain)
    reloaded = _with_extra_state(build_model(seed=9))
    load(tmp_path / "te_like", reloaded)  # and back: the state is read
    assert torch.equal(reloaded.decoder.final_layernorm.fp8_meta["scale_history"], torch.arange(4.0))
    assert torch.equal(plain.output_layer.weight, te_model.output_layer.weight)


def test_only_extra_state_may_be_absent_from_a_checkpoint(single_rank, tmp_path):
    """The key-matching rule: an absent ``_extra_state`` object starts fresh; any other absent
    object is refused, its key named."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_ext.checkpoint.reader import _fresh_extra_states

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
@pytest.mark.skipif(not torch.cuda.is_available() or not hardware.transformer_engine_available(),
                    reason="needs Transformer Engine")
def test_checkpoints_cross_between_local_and_te_specs(tmp_path, tiny_corpus):
    """Resuming with the optimizer across specs (distributed optimizer, dp_reshardable): 3 steps
    with one spec, 3 more with the other, against 6 straight steps of the local spec. The same
    weights, data and masks, so only kernel rounding separates them (bf16: well under 2 % in 6
    steps); optimizer state loaded into the wrong parameters would not stay within it."""
    from helpers import tiny_recipe
    from megatron_ext.training.recipe import run_config_from_dict
    from megatron_ext.training.loop import pretrain

    def recipe(run: str, backend: str) -> dict:
        return tiny_recipe(tiny_corpus, tmp_path / run, model={"transformer_impl": backend},
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


def _writer_loop(queue) -> None:
    """A persistent writer's loop as Megatron's and NVRx's run it: work until "DONE" arrives."""
    while queue.get() != "DONE":
        pass


@pytest.mark.parametrize("abort", [False, True], ids=["finish_then_stop", "abort"])
def test_a_persistent_writer_is_asked_to_finish_or_killed(abort):
    """The GPU's persistent writer (Megatron's or NVRx's) is stopped through one function: asked to
    finish what was queued ("DONE": it exits by itself), or killed at once on abort."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    worker = context.Process(target=_writer_loop, args=(queue,))
    worker.start()
    queue.put("a save")
    writer._stop_writer_process(worker, queue, abort=abort)
    assert not worker.is_alive()
    assert worker.exitcode == (-9 if abort else 0)
