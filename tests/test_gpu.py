"""The GPU path on a CUDA machine: TE attention modes, bf16 and FP8 biphasic runs, kill and resume,
TE <-> local and GPU <-> CPU checkpoint interchange. Every test carries the ``gpu`` marker and is
skipped without CUDA; ``benchmarks/gpu_check.py`` runs them and records the outcome."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_ext import platform
from megatron_ext.checkpoint import core as ckpt
from megatron_ext.training.config import run_config_from_dict
from megatron_ext.training.loop import pretrain
from helpers import tiny_recipe as _recipe

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.gpu
needs_te = pytest.mark.skipif(not torch.cuda.is_available() or not platform.transformer_engine_available(),
                              reason="needs Transformer Engine")
needs_fp8 = pytest.mark.skipif(not torch.cuda.is_available()
                               or torch.cuda.get_device_capability() < platform.FP8_MIN_COMPUTE_CAPABILITY,
                               reason="needs compute capability >= 8.9")
GPU_MODEL = {"preset": "tiny", "vocab_size": 1024, "attention_backend": "local"}
"""tiny (4 layers, hidden 128, 4/2 heads): every matmul dimension a multiple of 16, as FP8 needs.
The local spec unless the test's subject is Transformer Engine (``_te_model``)."""


def _te_model() -> dict:
    return {**GPU_MODEL, "attention_backend": "te"}


def _gpu_recipe(corpus, run_dir: Path, *, steps: int, model: dict | None = None, **training) -> dict:
    # The schedule scales with the run: 5 % warmup, the last 20 % decay (a 10 + 40-step schedule
    # does not fit a 20-step run).
    return _recipe(corpus, run_dir, model=model or dict(GPU_MODEL),
                   data={"seq_length": 128, "micro_batch_size": 8, "global_batch_size": 16},
                   schedule={"lr": 2e-3, "lr_decay_style": "wsd", "lr_warmup_iters": max(steps // 20, 1),
                             "lr_wsd_decay_iters": max(steps // 5, 1)},
                   training={"train_iters": steps, "eval_interval": steps // 2, "log_interval": 20, "bf16": True,
                             **training},
                   checkpoint={"save": str(run_dir / "ckpt"), "save_interval": steps // 2})


def _phase_drop(result, start: int, end: int, window: int = 10) -> float:
    """Mean loss of the first `window` steps of a phase minus that of its last `window` steps."""
    first = [result.losses[s] for s in range(start + 1, start + 1 + window)]
    last = [result.losses[s] for s in range(end - window + 1, end + 1)]
    return sum(first) / window - sum(last) / window


@pytest.fixture(scope="module")
def model_parallel(tmp_path_factory):
    platform.init_process_group_and_model_parallel(
        init_method=f"file://{tmp_path_factory.mktemp('pg')}/rendezvous", rank=0, world_size=1)
    yield
    platform.destroy_process_group_and_model_parallel()


@needs_te
def test_te_attention_modes_and_agreement_with_local(model_parallel, tmp_path):
    """Causal hides later tokens, bidirectional sees them, and TE agrees with the local spec on the
    same weights (loaded through the dist checkpoint: names mapped) within bf16 tolerance."""
    from megatron_ext.model import build_encoder_model, preset

    torch.manual_seed(0)
    local = build_encoder_model(preset("tiny", vocab_size=1024)).cuda().eval()
    ckpt.save_checkpoint(tmp_path / "local", step=1, model=local, optimizer=None, trainer_state={"step": 1},
                         run_config={}, tokenizer_reference={}, keep_last=1)
    te = build_encoder_model(preset("tiny", vocab_size=1024, attention_backend="te")).cuda().eval()
    ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path / "local"), model=te, optimizer=None)
    ids = torch.randint(3, 1024, (2, 64), device="cuda")
    later = ids.clone()
    later[:, 40] = (later[:, 40] + 7) % 1024
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for causal in (True, False):
            a, b = te(ids, causal=causal), te(later, causal=causal)
            changed = (a - b).abs().amax(-1) > 1e-3
            assert changed[:, 40:].all()
            assert changed[:, :40].any() != causal  # causal: earlier positions unchanged
            torch.testing.assert_close(a.float(), local(ids, causal=causal).float(), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("fp8_recipe", [None, pytest.param("delayed", marks=[needs_te, needs_fp8]),
                                        pytest.param("tensorwise", marks=[needs_te, needs_fp8])])
def test_biphasic_run_falls_in_both_phases(tmp_path, tiny_corpus, fp8_recipe):
    """200 steps (CLM 100, MLM-40 100) with the megatron engine and the distributed optimizer; bf16
    on the local spec (TE when FP8 is the subject)."""
    model = _te_model() if fp8_recipe else None
    config = run_config_from_dict(_gpu_recipe(tiny_corpus, tmp_path, steps=200, model=model, fp8_recipe=fp8_recipe) | {
        "parallel": {"use_distributed_optimizer": True, "overlap_grad_reduce": True}})
    result = pretrain(config)
    assert result.final_step == 200 and result.skipped_steps == 0
    assert _phase_drop(result, 0, 100) > 0.5 and _phase_drop(result, 100, 200) > 0.3
    out = Path(os.environ.get("GPU_CHECK_OUT", tmp_path))
    (out / f"biphasic_{fp8_recipe or 'bf16'}.json").write_text(json.dumps(
        {"losses": result.losses, "valid": result.valid}, indent=1))


def test_bf16_parameters_and_fusions_train_like_the_default(tmp_path, tiny_corpus):
    """The issue-15 switches together on GPU (bf16 parameters with fp32 main params, Megatron's
    fused SwiGLU and cross entropy, fused AdamW, distributed optimizer): both phases fall, and the
    last steps' mean loss stays within 3 % of the default (fp32 weights, bf16 autocast) run."""
    parallel = {"parallel": {"use_distributed_optimizer": True}}
    results = {}
    for name, model, training in (
        ("default", dict(GPU_MODEL), {}),
        ("switches", {**GPU_MODEL, "params_dtype": "bfloat16"},
         {"bias_activation_fusion": True, "cross_entropy_loss_fusion": True}),
    ):
        raw = _gpu_recipe(tiny_corpus, tmp_path / name, steps=200, model=model, **training) | parallel
        results[name] = pretrain(run_config_from_dict(raw))
    switched = results["switches"]
    assert switched.skipped_steps == 0
    assert _phase_drop(switched, 0, 100) > 0.5 and _phase_drop(switched, 100, 200) > 0.3
    last = {name: sum(r.losses[s] for s in range(191, 201)) / 10 for name, r in results.items()}
    assert last["switches"] == pytest.approx(last["default"], rel=0.03), last


def test_scored_positions_lm_head_matches_the_full_head_under_bf16(model_parallel, tmp_path, tiny_corpus):
    """The LM head at the masked positions only gives the full head's loss under bf16 autocast on
    GPU. (Skipping non-finite gradients before Megatron's optimizer is tested on CPU:
    tests/test_megatron_engine.py.)"""
    from megatron_ext.model import build_encoder_model
    from megatron_ext.objectives import MaskingConfig, apply_mlm
    from megatron_ext.training.engines import MicroBatch, megatron_transformer_overrides, per_token_loss

    config = run_config_from_dict(_gpu_recipe(tiny_corpus, tmp_path, steps=10))
    torch.manual_seed(0)
    model = build_encoder_model(config.model, transformer_overrides=megatron_transformer_overrides(config)).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(4, 1024, (8, 128), device="cuda", generator=gen)
    batch = apply_mlm(tokens, config=MaskingConfig(mask_ratio=0.4), mask_id=3, vocab_size=1024,
                      special_ids=(0, 1, 2, 3), generator=gen)
    with torch.no_grad():
        scored, full = (float((per_token_loss(model, MicroBatch(batch, None), bf16=True, lm_head_scored_only=flag)
                               * batch.loss_mask).sum()) for flag in (True, False))
    assert scored == pytest.approx(full, rel=1e-2)


def test_kill_and_resume(tmp_path, tiny_corpus):
    """SIGKILL after the first checkpoint (distributed optimizer, dp_reshardable), then resume to the
    end from that checkpoint."""
    recipe = tmp_path / "recipe.json"
    raw = _gpu_recipe(tiny_corpus, tmp_path, steps=200) | {"parallel": {"use_distributed_optimizer": True}}
    raw["model"]["attention_backend"] = "te" if platform.transformer_engine_available() else "local"
    recipe.write_text(json.dumps(raw))  # JSON is YAML
    command = [sys.executable, str(REPO / "pretrain_encoder.py"), "--config", str(recipe)]
    run = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while ckpt.latest_checkpoint(tmp_path / "ckpt") is None and time.time() < deadline and run.poll() is None:
        time.sleep(0.2)
    run.send_signal(signal.SIGKILL)
    run.wait()
    first = ckpt.latest_checkpoint(tmp_path / "ckpt")
    assert first is not None and first.name == "iter_0000100"
    resumed = pretrain(run_config_from_dict(raw))
    assert resumed.start_step == 100 and resumed.final_step == 200
    assert all(math.isfinite(v) for v in resumed.losses.values())


def test_gpu_checkpoint_loads_on_cpu(tmp_path, tiny_corpus):
    """Weights saved by a GPU run give the same fp32 logits when loaded by a CPU-only process."""
    raw = _gpu_recipe(tiny_corpus, tmp_path, steps=20, bf16=False)
    raw["model"]["attention_backend"] = "local"
    result = pretrain(run_config_from_dict(raw))
    ids = torch.randint(3, 1024, (1, 32), generator=torch.Generator().manual_seed(0))
    script = (
        "import sys, torch; sys.path.insert(0, sys.argv[1]);"
        "from megatron_ext.hf import load_megatron_checkpoint, single_process_model_parallel;"
        "ids = torch.load(sys.argv[3]);"
        "ctx = single_process_model_parallel();"
        "ctx.__enter__();"
        "m = load_megatron_checkpoint(sys.argv[2]);"
        "torch.save(m(ids, causal=False).detach(), sys.argv[4])"
    )
    torch.save(ids, tmp_path / "ids.pt")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([sys.executable, "-c", script, str(REPO), result.checkpoint, str(tmp_path / "ids.pt"),
                    str(tmp_path / "cpu_logits.pt")], check=True, env=env, cwd=REPO)
    from megatron_ext.hf import load_megatron_checkpoint, single_process_model_parallel

    with single_process_model_parallel(), torch.no_grad():
        gpu = load_megatron_checkpoint(result.checkpoint).cuda()
        gpu_logits = gpu(ids.cuda(), causal=False).cpu()
    torch.testing.assert_close(torch.load(tmp_path / "cpu_logits.pt"), gpu_logits, atol=1e-3, rtol=1e-3)
