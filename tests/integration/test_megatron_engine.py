"""The Megatron engine (Megatron-Core DDP, optimizers, schedules) on CPU over gloo: what GPU users
run, under CI. Its step against torch's AdamW, the CPU redirection of Megatron's CUDA calls,
distributed-optimizer checkpoints (resume after a kill, reshard across data- and tensor-parallel
sizes), checkpoints of the removed portable engine, pipeline parallelism, non-finite gradients,
Hugging Face export of its checkpoints."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from distributed import run_ranks
from megatron_ext import hardware, process_group
from megatron_ext import megatron_compat
from megatron_ext.megatron_compat import cuda_on_cpu
from megatron_ext.checkpoint.reader import TOKENIZER_FINGERPRINT, latest_checkpoint
from megatron_ext.checkpoint.writer import save_checkpoint
from megatron_ext.checkpoint.config import nvrx_problem
from megatron_ext.checkpoint.reader import Checkpoint
from megatron_ext.training.recipe import run_config_from_dict
from megatron_ext.training.loop import pretrain
from helpers import assert_export_has_its_logits, tiny_recipe as _recipe

REPO = Path(__file__).resolve().parents[2]


def _layout_worker(rank: int, rendezvous: str, recipe: dict, out: str, world: int, exit_after: int | None) -> None:
    torch.set_num_threads(1)
    config = run_config_from_dict(recipe)
    process_group.init_process_group_and_model_parallel(
        tensor_parallel_size=config.parallel.tensor_model_parallel_size,
        pipeline_parallel_size=config.parallel.pipeline_model_parallel_size,
        seed=config.training.seed, init_method=rendezvous, rank=rank, world_size=world,
    )
    try:
        result = pretrain(config, exit_after_step=exit_after)
    finally:
        process_group.destroy_process_group_and_model_parallel()
    if rank == 0:
        Path(out).write_text(json.dumps({"start": result.start_step, "losses": result.losses}))


def _run(recipe: dict, tmp_path: Path, name: str, world: int = 1, exit_after: int | None = None) -> dict:
    """Train ``recipe`` on ``world`` CPU ranks (stopping after step ``exit_after``); rank 0's
    start step and per-step losses."""
    if world == 1:
        result = pretrain(run_config_from_dict(recipe), exit_after_step=exit_after)
        return {"start": result.start_step, "losses": result.losses}
    out = tmp_path / f"{name}.json"
    scratch = tmp_path / f"ranks_{name}"
    scratch.mkdir()
    run_ranks(_layout_worker, recipe, str(out), world, exit_after, world=world, tmp_path=scratch)
    found = json.loads(out.read_text())
    return {"start": found["start"], "losses": {int(k): v for k, v in found["losses"].items()}}


def _engine_recipe(corpus, run_dir: Path, *, steps: int, parallel: dict | None = None,
                   checkpoint: dict | None = None, **sections) -> dict:
    return _recipe(corpus, run_dir, training={"train_iters": steps, "eval_interval": 0},
                   schedule={"lr": 3e-3, "lr_decay_style": "wsd", "lr_warmup_iters": 1, "lr_wsd_decay_iters": 2},
                   parallel=parallel or {}, checkpoint=checkpoint or {"save": None}, **sections)


def _mlm_micro_batches(seed: int, count: int = 2) -> list:
    from megatron_ext.objectives import MaskingConfig, apply_mlm
    from megatron_ext.training.megatron_engine import MicroBatch

    gen = torch.Generator().manual_seed(seed)
    rows = torch.arange(4).unsqueeze(1)
    return [MicroBatch(apply_mlm(torch.randint(4, 1024, (4, 64), generator=gen), config=MaskingConfig(mask_ratio=0.4),
                                 mask_id=3, vocab_size=1024, special_ids=(0, 1, 2, 3), generator=gen,
                                 maskable=rows < 4 - i), None)  # micro-batch i: i padding rows
            for i in range(count)]


def test_a_step_is_torch_adamw_on_the_mean_loss_of_every_scored_token(tmp_path, tiny_corpus):
    """The engine's arithmetic against plain torch (what parity with the removed portable engine
    showed): Megatron-Core's DDP, gradient-buffer reduction, per-token-loss finalisation, clipping
    and optimizer move the weights as ``torch.optim.AdamW`` does on the mean loss over every scored
    token of the step's micro-batches (micro-batches of different token counts), with no weight
    decay on 1-D parameters and the gradient norm clipped to ``optimizer.clip_grad`` (here active)."""
    from megatron_ext.model import build_encoder_model
    from megatron_ext.training.megatron_engine import (MegatronEngine, masked_loss_sum, megatron_transformer_overrides,
                                               per_token_loss)

    config = run_config_from_dict(_engine_recipe(tiny_corpus, tmp_path, steps=4, optimizer={"clip_grad": 0.5}))
    o = config.optimizer
    process_group.init_process_group_and_model_parallel(init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        models = []
        for _ in range(2):  # the same initialisation twice
            torch.manual_seed(3)
            models.append(build_encoder_model(config.model, transformer_overrides=megatron_transformer_overrides(config)))
        engine, reference = MegatronEngine(models[0], config), models[1]
        params = list(reference.parameters())
        adamw = torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1], "weight_decay": o.weight_decay},
                                   {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0}],
                                  betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)
        for step, lr in enumerate((1e-3, 3e-3, 2e-3)):
            micro = _mlm_micro_batches(step)
            sums = [masked_loss_sum(per_token_loss(reference, m, bf16=False, lm_head_scored_only=True), m) for m in micro]
            assert len({int(n) for _, n in sums}) > 1  # the per-token mean is not the mean of the micro-batch means
            tokens = sum(int(n) for _, n in sums)
            loss = sum(loss_sum for loss_sum, _ in sums) / tokens
            adamw.zero_grad()
            loss.backward()
            norm = float(torch.nn.utils.clip_grad_norm_(params, o.clip_grad))
            for group in adamw.param_groups:
                group["lr"] = lr
            adamw.step()

            outcome = engine.train_step(micro, lr=lr)
            assert outcome.loss == pytest.approx(float(loss), rel=1e-6), step
            assert outcome.grad_norm == pytest.approx(norm, rel=1e-5) and norm > o.clip_grad, step
            for (name, ours), theirs in zip(models[0].named_parameters(), params, strict=True):
                torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6, msg=f"step {step}: {name}")
    finally:
        process_group.destroy_process_group_and_model_parallel()


def test_megatrons_cuda_calls_are_redirected_from_process_group_set_up_to_teardown(tmp_path, monkeypatch):
    """Divergence 7 of ``hardware``: on CPU, from ``init_process_group_and_model_parallel`` until
    ``destroy_process_group_and_model_parallel`` (off for a while inside
    ``cuda_calls_not_redirected``, where Megatron code is refused with the fix), pinned to
    megatron-core 0.19.2; nothing at all on GPU."""
    import torch.distributed as dist
    from torch.overrides import _get_current_function_mode_stack

    original = torch.cuda.current_device
    assert not cuda_on_cpu.cuda_calls_redirected() and not _get_current_function_mode_stack()
    process_group.init_process_group_and_model_parallel(init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        assert cuda_on_cpu.cuda_calls_redirected() is not hardware.on_gpu()
        if not hardware.on_gpu():
            assert torch.zeros(1, device="cuda").device.type == "cpu" and torch.cuda.current_device() == torch.device("cpu")
            assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
            with cuda_on_cpu.cuda_calls_not_redirected():
                assert not cuda_on_cpu.cuda_calls_redirected() and torch.cuda.current_device is original
                assert torch.zeros(1).type() == "torch.FloatTensor" and not _get_current_function_mode_stack()
                with pytest.raises((RuntimeError, AssertionError)):
                    torch.zeros(1, device="cuda")
                with pytest.raises(RuntimeError, match="saving a checkpoint runs Megatron-Core code that calls CUDA.*"
                                                       "init_process_group_and_model_parallel"):
                    save_checkpoint(tmp_path / "ckpt", step=1, model=torch.nn.Linear(1, 1), optimizer=None,
                                         trainer_state={}, run_config={}, model_config={}, tokenizer_reference={}, keep_last=1)
            assert cuda_on_cpu.cuda_calls_redirected() and torch.zeros(1, device="cuda").device.type == "cpu"
    finally:
        process_group.destroy_process_group_and_model_parallel()
    assert not cuda_on_cpu.cuda_calls_redirected() and torch.cuda.current_device is original
    assert not _get_current_function_mode_stack()
    if not hardware.on_gpu():
        monkeypatch.setattr(megatron_compat, "installed_megatron_core_version", lambda: "0.20.0")
        with pytest.raises(RuntimeError, match=r"megatron-core 0.20.0 is installed.*megatron-core==0.19.2"):
            process_group.init_process_group_and_model_parallel(init_method=f"file://{tmp_path}/pg2", rank=0, world_size=1)
        assert not dist.is_initialized() and not cuda_on_cpu.cuda_calls_redirected()  # nothing was started


def _transformer_engine_kernels(calls: list[str]) -> dict[tuple[str, str], object]:
    """What Megatron-Core's modules hold where Transformer Engine imports (each attribute divergence 7
    redirects), as stand-ins that record their call and fail as TE's CUDA kernels do on a machine
    without a GPU (the crash of a CPU run on a machine where TE imports)."""
    def cuda_only(name):
        def kernel(*args, **kwargs):
            calls.append(name)
            raise RuntimeError(f"{name}: CUDA error: no CUDA-capable device is detected")
        return kernel

    class FusedAdam(torch.optim.Optimizer):  # TE's: CUDA kernels only, adam_w_mode keyword
        def __init__(self, params, adam_w_mode=True, **kwargs):
            calls.append("FusedAdam")
            raise RuntimeError("FusedAdam: CUDA error: no CUDA-capable device is detected")

    clip_grads, optimizer = "megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"
    package, distributed = "megatron.core.optimizer", "megatron.core.optimizer.distrib_optimizer"
    return {(clip_grads, "multi_tensor_applier"): cuda_only("clip_grads.multi_tensor_applier"),
            (clip_grads, "l2_norm_impl"): cuda_only("multi_tensor_l2norm"),
            (clip_grads, "multi_tensor_scale_impl"): cuda_only("multi_tensor_scale"),
            (clip_grads, "multi_tensor_scale_tensor_impl"): cuda_only("multi_tensor_scale_tensor"),
            (optimizer, "multi_tensor_applier"): cuda_only("optimizer.multi_tensor_applier"),
            (optimizer, "multi_tensor_scale_impl"): cuda_only("optimizer.multi_tensor_scale"),
            (package, "USING_PYTORCH_OPTIMIZER"): False, (package, "Adam"): FusedAdam,
            (package, "SGD"): cuda_only("FusedSGD"),
            (distributed, "HAVE_APEX_OR_TE"): True, (distributed, "USING_TE_OPTIMIZER"): True,
            (distributed, "USING_APEX_OPTIMIZER"): False, (distributed, "Adam"): FusedAdam}


@pytest.mark.skipif(torch.cuda.is_available(), reason="divergence 7 is CPU-only")
@pytest.mark.parametrize("distributed", [False, True], ids=["plain_optimizer", "distributed_optimizer"])
def test_a_cpu_step_where_transformer_engine_imports_runs_megatrons_torch_kernels(tmp_path, tiny_corpus,
                                                                                   monkeypatch, distributed):
    """Megatron-Core picks TE's (or apex's) CUDA multi-tensor kernels and FusedAdam at
    import whenever TE imports, whatever the tensors' device. With TE's choices installed in
    Megatron's modules (as on a machine where TE imports), a CPU run's steps (each gradient norm
    above optimizer.clip_grad, so the gradients are scaled too) train with the local kernels and
    torch's fused AdamW, never reach TE's, and TE's are back in place after teardown."""
    import importlib

    from megatron_ext.training.optim import megatron_uses_torch_adam

    calls: list[str] = []
    te_kernels = _transformer_engine_kernels(calls)
    assert set(te_kernels) == set(cuda_on_cpu._megatron_torch_kernels())  # the test covers the whole list
    for (module, attribute), kernel in te_kernels.items():
        monkeypatch.setattr(importlib.import_module(module), attribute, kernel)
    seen = {}

    def record_the_optimizer(engine_init):
        def init(self, model, config):
            engine_init(self, model, config)
            seen["torch_adam"] = megatron_uses_torch_adam()
            seen["fused"] = {group["fused"] for part in self.optimizer_state._parts()
                             for group in part.optimizer.param_groups}
        return init

    from megatron_ext.training import megatron_engine
    monkeypatch.setattr(megatron_engine.MegatronEngine, "__init__", record_the_optimizer(megatron_engine.MegatronEngine.__init__))
    recipe = _engine_recipe(tiny_corpus, tmp_path, steps=3, optimizer={"clip_grad": 1e-3},
                            parallel={"use_distributed_optimizer": distributed})
    losses = _run(recipe, tmp_path, "te_imports")["losses"]
    assert calls == [] and sorted(losses) == [1, 2, 3] and all(math.isfinite(v) for v in losses.values())
    assert seen == {"torch_adam": True, "fused": {True}}
    for (module, attribute), kernel in te_kernels.items():  # TE's choices back once the run is over
        assert getattr(importlib.import_module(module), attribute) is kernel, f"{module}.{attribute}"


def test_the_megatron_core_pin_guards_the_kernel_list(tmp_path, monkeypatch):
    """Every attribute divergence 7 replaces is one megatron-core 0.19.2 chooses between Transformer
    Engine, apex and its local implementation at import (its source says so); with another release
    nothing is replaced (the version is refused first)."""
    import importlib
    import inspect

    kernels = cuda_on_cpu._megatron_torch_kernels()
    for module in {module for module, _ in kernels}:
        source = inspect.getsource(importlib.import_module(module))
        assert "from transformer_engine.pytorch.optimizers import" in source and "from apex." in source, module
    for module, attribute in kernels:
        assert hasattr(importlib.import_module(module), attribute), f"{module}.{attribute}"
    if hardware.on_gpu():
        return
    before = {key: getattr(importlib.import_module(key[0]), key[1]) for key in kernels}
    monkeypatch.setattr(megatron_compat, "installed_megatron_core_version", lambda: "0.20.0")
    with pytest.raises(RuntimeError, match=r"megatron-core 0.20.0 is installed.*update MEGATRON_CORE_VERSION"):
        cuda_on_cpu.redirect_cuda_calls()
    assert not cuda_on_cpu.cuda_calls_redirected()
    assert all(getattr(importlib.import_module(module), attribute) is before[(module, attribute)]
               for module, attribute in kernels)


def test_pipeline_parallel_matches_one_stage(tmp_path, tiny_corpus):
    """PP=2 through Megatron's 1F1B schedule (p2p over gloo), 2 micro-batches per step, from the
    same weights as PP=1 (a seed initialises each stage's layers from the start of its stream,
    so both runs load one checkpoint: layer keys are global, so it loads at either size)."""
    _run(_engine_recipe(tiny_corpus, tmp_path / "init", steps=6,
                        checkpoint={"save": str(tmp_path / "init/ckpt")}), tmp_path, "init", exit_after=1)
    start = {"load": str(tmp_path / "init/ckpt"), "finetune": True, "save": None}
    one = _run(_engine_recipe(tiny_corpus, tmp_path / "pp1", steps=6, checkpoint=start), tmp_path, "pp1")["losses"]
    two = _run(_engine_recipe(tiny_corpus, tmp_path / "pp2", steps=6, parallel={"pipeline_model_parallel_size": 2},
                              checkpoint=start), tmp_path, "pp2", world=2)["losses"]
    for step in range(1, 7):
        assert two[step] == pytest.approx(one[step], rel=1e-5), f"step {step}"


def _distopt(corpus, run_dir: Path, *, steps: int, tp: int = 1, optimizer_format: str = "dp_reshardable",
             save_interval: int = 3, async_save: bool = False, async_strategy: str = "mcore") -> dict:
    return _engine_recipe(corpus, run_dir, steps=steps,
                          parallel={"use_distributed_optimizer": True, "tensor_model_parallel_size": tp},
                          checkpoint={"save": str(run_dir / "ckpt"), "save_interval": save_interval,
                                      "optimizer_format": optimizer_format, "keep_last": 5,
                                      "async_save": async_save, "async_strategy": async_strategy})


def test_distributed_optimizer_reshards_across_data_parallel_sizes(tmp_path, tiny_corpus):
    """A DP=2 distributed-optimizer checkpoint (dp_reshardable, the default) resumes at DP=1 and
    reproduces the uninterrupted DP=2 run's losses (same global batch and token means)."""
    straight = _run(_distopt(tiny_corpus, tmp_path / "straight", steps=6), tmp_path, "straight", world=2)
    recipe = _distopt(tiny_corpus, tmp_path / "resharded", steps=6)
    _run(recipe, tmp_path, "dp2_first", world=2, exit_after=3)
    saved = Checkpoint.open(tmp_path / "resharded/ckpt").optimizer_format()
    assert saved["distrib_optim_sharding_type"] == "dp_reshardable" and saved["data_parallel_size"] == 2
    resumed = _run(recipe, tmp_path, "dp1_rest", world=1)
    assert resumed["start"] == 3
    for step in range(4, 7):
        assert resumed["losses"][step] == pytest.approx(straight["losses"][step], rel=1e-5), f"step {step}"


def test_fully_reshardable_resumes_tp2_at_tp1_and_dp_reshardable_refuses(tmp_path, tiny_corpus):
    straight = _run(_distopt(tiny_corpus, tmp_path / "straight", steps=6, tp=2, optimizer_format="fully_reshardable"),
                    tmp_path, "straight", world=2)
    tp2 = _distopt(tiny_corpus, tmp_path / "full", steps=6, tp=2, optimizer_format="fully_reshardable")
    _run(tp2, tmp_path, "tp2_first", world=2, exit_after=3)
    tp1 = _distopt(tiny_corpus, tmp_path / "full", steps=6, tp=1, optimizer_format="fully_reshardable")
    resumed = _run(tp1, tmp_path, "tp1_rest", world=1)
    assert resumed["start"] == 3
    for step in range(4, 7):
        assert resumed["losses"][step] == pytest.approx(straight["losses"][step], rel=1e-4), f"step {step}"

    dp_only = _distopt(tiny_corpus, tmp_path / "dp_only", steps=6, tp=2)
    _run(dp_only, tmp_path, "dp_only_first", world=2, exit_after=3)
    with pytest.raises(ValueError, match=r"dp_reshardable format.*tensor_model_parallel_size=2 -> 1"
                                         r".*optimizer_format: fully_reshardable"):
        pretrain(run_config_from_dict(_distopt(tiny_corpus, tmp_path / "dp_only", steps=6, tp=1)))


def test_resume_refuses_another_optimizer_layout(tmp_path, tiny_corpus):
    recipe = _distopt(tiny_corpus, tmp_path, steps=4)
    pretrain(run_config_from_dict(recipe), exit_after_step=2)
    plain = dict(recipe, parallel={})
    with pytest.raises(ValueError, match=r"use_distributed_optimizer: true.*set it back"):
        pretrain(run_config_from_dict(plain))


class _PortableEngineOptimizerState:
    """What the removed portable engine saved: torch's AdamW state, recorded as ``{"optimizer":
    "torch"}`` (``recorded`` None: a checkpoint from before formats were recorded, whose run config
    names the engine)."""

    def __init__(self, recorded: dict | None):
        self.recorded = recorded

    def format(self) -> dict | None:
        return self.recorded

    def sharded_state_dict(self, model_state: dict, *, saved_format: dict | None = None) -> dict:
        return {"param_groups": [{"step": 2}]}  # (its tensors under optimizer.state.*: not needed here)


@pytest.mark.parametrize("recorded", [{"optimizer": "torch"}, None], ids=["recorded", "before_formats"])
def test_a_portable_engine_checkpoint_is_refused_naming_the_fix_and_its_weights_load(tmp_path, tiny_corpus, recorded):
    from megatron_ext.config_loading import UserError
    from megatron_ext.model import build_encoder_model
    from megatron_ext.tokenizer import build_tokenizer
    from megatron_ext.training.megatron_engine import megatron_transformer_overrides

    recipe = _engine_recipe(tiny_corpus, tmp_path, steps=4, checkpoint={"save": str(tmp_path / "portable")})
    config = run_config_from_dict(recipe)
    saved_config = json.loads(json.dumps(config.to_dict()))
    saved_config["training"]["engine"] = "portable"
    tokenizer = build_tokenizer(config.tokenizer)
    process_group.init_process_group_and_model_parallel(init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        torch.manual_seed(7)
        model = build_encoder_model(config.model, transformer_overrides=megatron_transformer_overrides(config))
        save_checkpoint(tmp_path / "portable", step=2, model=model, optimizer=_PortableEngineOptimizerState(recorded),
                             trainer_state={"consumed_samples": 16}, run_config=saved_config,
                             model_config=saved_config["model"],
                             tokenizer_reference={**tokenizer.reference(), TOKENIZER_FINGERPRINT: tokenizer.fingerprint()},
                             keep_last=1)
    finally:
        process_group.destroy_process_group_and_model_parallel()
    assert Checkpoint.open(tmp_path / "portable").optimizer_format() == {"optimizer": "torch"}

    with pytest.raises(UserError, match=r"cannot resume from checkpoint .*iter_0000002: it holds the optimizer state "
                                         r"of the portable engine \(training.engine: portable\).*checkpoint.load=.*"
                                         r"portable and checkpoint.finetune: true"):
        pretrain(config)
    cpt = _engine_recipe(tiny_corpus, tmp_path / "cpt", steps=4,
                         checkpoint={"load": str(tmp_path / "portable"), "finetune": True, "save": None})
    scratch = _engine_recipe(tiny_corpus, tmp_path / "scratch", steps=4)
    continued = pretrain(run_config_from_dict(cpt))
    assert continued.start_step == 0 and continued.losses[1] != pretrain(run_config_from_dict(scratch)).losses[1]


def test_a_recipe_naming_the_removed_engine_key_is_refused_with_the_fix(tmp_path, tiny_corpus):
    from megatron_ext.config_loading import ConfigError

    for engine in ("portable", "auto", "megatron"):
        recipe = _engine_recipe(tiny_corpus, tmp_path, steps=2)
        recipe["training"]["engine"] = engine
        with pytest.raises(ConfigError, match=r"^training: unknown key\(s\) \['engine'\] \(engine is now nothing: every "
                                              r"run trains with the Megatron engine; delete the key\)"):
            run_config_from_dict(recipe)


def _torchrun(recipe_path: Path, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(REPO / "pretrain_encoder.py"), "--config", str(recipe_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


@pytest.mark.parametrize("async_save,async_strategy", [
    (False, "mcore"), (True, "mcore"),
    pytest.param(True, "nvrx", marks=pytest.mark.skipif(nvrx_problem() is not None, reason=str(nvrx_problem())))],
    ids=["sync_save", "async_save", "async_save_nvrx"])
@pytest.mark.slow  # torchrun runs killed and resumed
def test_distributed_optimizer_killed_mid_save_resumes_exactly(tmp_path, tiny_corpus, async_save, async_strategy):
    """DP=2 with the distributed optimizer: SIGKILL to every rank (and the background writers)
    while the step-6 checkpoint is being written; the step-3 checkpoint stays the newest complete
    one, and the rerun reproduces the uninterrupted run's losses bitwise (CPU arithmetic is
    deterministic). With ``async_save`` training goes on while the writer works: the kill lands
    while a save is in flight; its writer is Megatron's own or NVRx's (``async_strategy``)."""
    straight = _run(_distopt(tiny_corpus, tmp_path / "straight", steps=9, async_save=async_save,
                             async_strategy=async_strategy), tmp_path, "straight", world=2)
    # A tiny model's save takes milliseconds: on a loaded machine the kill may land after it is
    # published; then the attempt is made again in a fresh directory (3 at most).
    for attempt in range(3):
        raw = _distopt(tiny_corpus, tmp_path / f"killed{attempt}", steps=9, async_save=async_save,
                       async_strategy=async_strategy)
        recipe = tmp_path / f"recipe{attempt}.json"
        recipe.write_text(json.dumps(raw))  # JSON is YAML
        save_dir = tmp_path / f"killed{attempt}/ckpt"
        run = _torchrun(recipe, tmp_path / f"killed{attempt}.log")
        deadline = time.time() + 240
        while time.time() < deadline and run.poll() is None:
            if save_dir.is_dir() and any(p.name.startswith("iter_0000006.tmp-") for p in save_dir.iterdir()):
                break
            time.sleep(0.005)
        ranks = psutil.Process(run.pid).children(recursive=True)  # torchrun's workers have sessions of their own
        for process in [psutil.Process(run.pid), *ranks]:
            process.send_signal(signal.SIGKILL)
        run.wait()
        psutil.wait_procs(ranks, timeout=30)
        if not (save_dir / "iter_0000006").exists():
            break
    assert not (save_dir / "iter_0000006").exists(), "the kill came after the save completed, 3 times"
    assert latest_checkpoint(save_dir).name == "iter_0000003"
    resumed = _run(raw, tmp_path, "resumed", world=2)
    assert resumed["start"] == 3
    for step in range(4, 10):
        assert resumed["losses"][step] == straight["losses"][step], f"step {step}"
    assert sorted(p.name for p in save_dir.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000003", "iter_0000006", "iter_0000009"]  # the half-written save was cleaned up


@pytest.mark.skipif(nvrx_problem() is None, reason="nvidia-resiliency-ext can run here")
def test_the_nvrx_writer_without_nvrx_stops_the_run_before_it_starts(tmp_path, tiny_corpus):
    recipe = _distopt(tiny_corpus, tmp_path, steps=4, async_save=True, async_strategy="nvrx")
    with pytest.raises(ValueError, match=r"^checkpoint.async_strategy: nvrx: nvidia-resiliency-ext .*"
                                         r"or set checkpoint.async_strategy: mcore$"):
        pretrain(run_config_from_dict(recipe))
    assert not (tmp_path / "ckpt").exists() and not torch.distributed.is_initialized()


def test_non_finite_gradients_are_skipped_before_megatrons_optimizer(tmp_path, tiny_corpus):
    """A finite loss with a NaN gradient: Megatron's optimizer would step (it skips only under
    fp16 loss scaling); the engine skips first and the parameters stay as they were."""
    from megatron_ext.model import build_encoder_model
    from megatron_ext.objectives import MaskingConfig, apply_mlm
    from megatron_ext.training.megatron_engine import MegatronEngine, MicroBatch, megatron_transformer_overrides

    config = run_config_from_dict(_engine_recipe(tiny_corpus, tmp_path, steps=10))
    process_group.init_process_group_and_model_parallel(init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        model = build_encoder_model(config.model, transformer_overrides=megatron_transformer_overrides(config))
        engine = MegatronEngine(model, config)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(4, 1024, (4, 64), generator=gen)
        batch = apply_mlm(tokens, config=MaskingConfig(mask_ratio=0.4), mask_id=3, vocab_size=1024,
                          special_ids=(0, 1, 2, 3), generator=gen)
        micro = [MicroBatch(batch, None)]
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert not engine.train_step(micro, lr=1e-3).skipped
        assert any(not torch.equal(p, initial[n]) for n, p in model.named_parameters())
        snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
        poison = model.decoder.layers[0].mlp.linear_fc2.weight.register_hook(lambda g: torch.full_like(g, math.nan))
        bad = engine.train_step(micro, lr=1e-3)
        poison.remove()
        assert bad.skipped and math.isfinite(bad.loss)
        for name, param in model.named_parameters():
            assert torch.equal(param, snapshot[name]), name
        assert not engine.train_step(micro, lr=1e-3).skipped
    finally:
        process_group.destroy_process_group_and_model_parallel()


def test_megatron_engine_checkpoint_exports_with_logit_parity(tmp_path, tiny_corpus):
    from megatron_ext.hf import export_checkpoint

    recipe = _distopt(tiny_corpus, tmp_path, steps=3)
    pretrain(run_config_from_dict(recipe))
    checkpoint = latest_checkpoint(tmp_path / "ckpt")
    export_checkpoint(checkpoint, tmp_path / "hf", hf_format="eurobert", log=lambda _: None)
    assert_export_has_its_logits(checkpoint, tmp_path / "hf")

def test_fused_adam_matches_the_unfused_kernel(tmp_path, tiny_corpus):
    """``optimizer.fused`` (default) runs torch's fused AdamW where Megatron runs torch's AdamW (here:
    no TE/apex): the same losses as the loop-of-ops kernel to rounding, and the kernel really changes."""
    from megatron_ext.model import build_encoder_model
    from megatron_ext.training.megatron_engine import MegatronEngine

    losses = {}
    for fused in (True, False):
        recipe = _engine_recipe(tiny_corpus, tmp_path / f"fused{fused}", steps=6, optimizer={"fused": fused})
        losses[fused] = _run(recipe, tmp_path, f"fused{fused}")["losses"]
        config = run_config_from_dict(recipe)
        process_group.init_process_group_and_model_parallel(init_method=f"file://{tmp_path}/pg{fused}", rank=0, world_size=1)
        try:
            built = MegatronEngine(build_encoder_model(config.model), config)
            assert {group["fused"] for group in built.optimizer.optimizer.param_groups} == ({True} if fused else {None})
        finally:
            process_group.destroy_process_group_and_model_parallel()
    for step in range(1, 7):
        assert losses[True][step] == pytest.approx(losses[False][step], rel=1e-4), f"step {step}"


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed_optimizer", "plain_optimizer"])
def test_decay_norms_and_biases_decays_exactly_the_one_dimensional_parameters(tmp_path, tiny_corpus, distributed):
    """AdamW's decay is decoupled: after one step from the same initialisation and batch, the
    switch changes no matrix and moves every norm weight (initialised to 1) by exactly -lr x wd,
    on the distributed optimizer (flat shards) as on the plain one (parameter groups)."""
    from megatron_ext.hf import load_megatron_checkpoint, single_process_model_parallel

    weights, lrs = {}, {}
    for decay_all in (False, True):
        run_dir = tmp_path / f"decay_all_{decay_all}"
        recipe = _recipe(tiny_corpus, run_dir, training={"train_iters": 4, "eval_interval": 0},
                         schedule={"lr": 3e-3, "lr_decay_style": "wsd", "lr_warmup_iters": 0, "lr_wsd_decay_iters": 2},
                         phases=[{"objective": "mlm", "mask_ratio": 0.4, "share": 1.0}],
                         optimizer={"decay_norms_and_biases": decay_all, "weight_decay": 0.5},
                         parallel={"use_distributed_optimizer": distributed})
        _run(recipe, tmp_path, run_dir.name, exit_after=1)
        with single_process_model_parallel():
            weights[decay_all] = {name: value for name, value in load_megatron_checkpoint(run_dir / "ckpt").state_dict().items()
                                  if torch.is_tensor(value)}
        (record,) = [row for line in (run_dir / "log" / "metrics.jsonl").read_text().splitlines()
                     if (row := json.loads(line))["kind"] == "train"]
        lrs[decay_all] = record["lr"]
    assert lrs[False] == lrs[True] > 0
    one_dimensional = [name for name, value in weights[False].items() if value.dim() == 1]
    assert one_dimensional and all(name.endswith("layernorm.weight") or "norm" in name for name in one_dimensional)
    for name, value in weights[False].items():
        if value.dim() == 1:
            torch.testing.assert_close(weights[True][name] - value, torch.full_like(value, -lrs[True] * 0.5),
                                       rtol=0, atol=1e-6, msg=name)
        else:
            assert torch.equal(weights[True][name], value), name


def test_bf16_parameters_with_fp32_main_params(tmp_path, tiny_corpus):
    """``model.params_dtype: bfloat16`` (Megatron-LM's mixed precision: Float16Module, fp32 main
    parameters and gradient buffers): the fp32 run's losses to bf16 rounding, an exact resume, and
    continued pretraining from an fp32 checkpoint that keeps the loaded weights (the optimizer's
    main parameters are refreshed from them)."""
    def recipe(name: str, dtype: str, steps: int, **sections):
        return _engine_recipe(tiny_corpus, tmp_path / name, steps=steps, model={"params_dtype": dtype}, **sections)

    fp32 = _run(recipe("fp32", "float32", 12, checkpoint={"save": str(tmp_path / "fp32_ckpt"), "save_interval": 12}),
                tmp_path, "fp32")["losses"]
    bf16 = _run(recipe("bf16", "bfloat16", 12), tmp_path, "bf16")["losses"]
    for step in range(1, 13):
        assert bf16[step] == pytest.approx(fp32[step], rel=0.02), f"step {step}"
    assert bf16[12] < bf16[1] - 0.4  # it learns

    resumable = recipe("resume", "bfloat16", 8, checkpoint={"save": str(tmp_path / "resume_ckpt"), "save_interval": 4})
    straight = _run(recipe("straight", "bfloat16", 8), tmp_path, "straight")["losses"]
    first = _run(resumable, tmp_path, "first", exit_after=4)["losses"]
    second = _run(resumable, tmp_path, "second")
    assert second["start"] == 4
    assert {**first, **second["losses"]} == straight

    cpt = _run(recipe("cpt", "bfloat16", 4, checkpoint={"load": str(tmp_path / "fp32_ckpt"), "finetune": True},
                      phases=[{"objective": "mlm", "mask_ratio": 0.4, "share": 1.0}]), tmp_path, "cpt")["losses"]
    # Every step starts from the loaded weights (MLM loss ~6.4), none from the initialisation (~6.9).
    assert max(cpt.values()) < fp32[12] + 0.15, (cpt, fp32)


def test_float16_parameters_are_refused(tmp_path, tiny_corpus):
    from megatron_ext.config_loading import ConfigError

    with pytest.raises(ConfigError, match="float16 needs loss scaling"):
        run_config_from_dict(_engine_recipe(tiny_corpus, tmp_path, steps=2, model={"params_dtype": "float16"}))


@pytest.mark.parametrize("fusion", ["bias_activation_fusion", "cross_entropy_loss_fusion"])
def test_megatron_fusions_train_like_the_unfused_model(tmp_path, tiny_corpus, fusion):
    """Megatron's fused SwiGLU and native fused cross entropy (``torch.compile``d, here on CPU):
    the unfused run's losses to fp32 rounding over a CLM and an MLM phase."""
    plain = _run(_engine_recipe(tiny_corpus, tmp_path / "plain", steps=6), tmp_path, "plain")["losses"]
    recipe = _engine_recipe(tiny_corpus, tmp_path / fusion, steps=6)
    recipe["training"][fusion] = True
    fused = _run(recipe, tmp_path, fusion)["losses"]
    for step in range(1, 7):
        assert fused[step] == pytest.approx(plain[step], rel=2e-5), f"step {step}"
    from megatron_ext.model import build_encoder_model
    from megatron_ext.training.megatron_engine import megatron_transformer_overrides

    config = run_config_from_dict(recipe)
    process_group.init_process_group_and_model_parallel(init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:  # the switch reaches the TransformerConfig Megatron's MLP and loss read
        model = build_encoder_model(config.model, transformer_overrides=megatron_transformer_overrides(config))
        assert getattr(model.config, fusion) is True
    finally:
        process_group.destroy_process_group_and_model_parallel()
