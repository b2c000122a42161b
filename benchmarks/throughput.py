"""Training throughput of the encoder vs a Hugging Face baseline, same shapes and batches, one device.

    .venv/bin/python -m benchmarks.throughput                      # GPU: 210m/610m/1b x seq 1024/2048 x bf16/fp8
    .venv/bin/python -m benchmarks.throughput --cpu-tiny           # CPU (CI): the tiny preset, seq 128, fp32
    .venv/bin/python -m benchmarks.throughput --presets 610m --seq-lengths 2048 --precisions bf16

Per (preset, sequence length, precision) both sides train MLM-40 on the same random-token
sequences (the objective and shapes set the speed, not the text), AdamW (0.9, 0.95), clip 1.0, at
the recipes' shape: an optimizer step takes the sequences one rank gets in the paper recipe (global
batch 1,152 over ``--data-parallel-size`` 64 ranks: 18), in the recipe's micro-batches (1 x 18,
2 x 9 and 2 x 9 at 210m / 610m / 1b; ``micro_batch_N`` variants time the recipes' earlier sizes), the
baseline in the largest measured to fit an 80 GB GPU (``HF_MICRO_BATCH_80GB``), gradient accumulation
on both sides:
- megatron_ext: the size recipe's configuration (``examples/recipes/base/<size>.yaml``: spec, bf16
  parameters, fusions, LM head, distributed optimizer; ``RECIPE_SETTINGS``), with what the machine
  cannot run turned off as a training run would (``training.loop.runnable_here``): ``build_encoder_model``
  driven by the trainer's engine (``training.megatron_engine.MegatronEngine``: Megatron-Core DDP + optimizer +
  forward-backward schedule, on GPU and CPU), bf16 autocast, FP8 via TE;
- Hugging Face: ``transformers.EuroBertForMaskedLM`` (SDPA attention) with its own loss, bf16
  autocast, fused AdamW; ``--hf-compile`` adds ``torch.compile``.
Each side (ours, each of ``--variants``, the baseline) runs alone in a process of its own, one after
the other on identical batches (same generator seed): nothing of one side is resident while another
runs, so each fits or runs out of memory on its own (a side that runs out of memory is reported as
such, the others still are), and each side's peak memory is its own: ``torch.cuda.max_memory_allocated``
on GPU, the process's peak RSS on CPU (``resource.getrusage``; it includes Python and the libraries),
labelled ``peak_mem_measure``. The process that starts them allocates nothing on the device. Each side
runs warm-up steps, then timed rounds (the median round counts). Each of our sides times the
optimizer's update apart, so a row reports its step twice, each named (``STEP_CHARGES``): as one GPU
alone pays it (the whole unsharded Adam update charged to one rank's micro-batches: the figure of the
visits before 2026-11-28) and as a rank of a ``--data-parallel-size``-rank run of the recipe pays it
(the distributed optimizer's 1/ranks share of the update; its collectives not counted). On a GPU each
side also records the SM clock and power draw while timed (``nvidia-smi``), the cuDNN version and the
attention kernel (TE's choice, or PyTorch SDPA's). Reported per row: tokens/s, achieved
TFLOP/s and MFU (FLOPs convention of ``megatron_ext.performance.flops``, printed; MFU against the dense
bf16 peak, also for FP8 rows), peak memory and step time, and the baseline's tokens/s and peak memory
on the same shape; for each of ``--variants`` (an optimisation step of the recipe undone, or a tuning
choice, as a run-config change) its tokens/s, peak memory and how much faster the default is, timed
on the same batches in the same run (a variant that changes nothing on this machine is reported as
such, not timed); each side's wall time (start-up, build, warm-up, timed, profile, teardown), to
plan a GPU visit (``--steps``/``--rounds``/``--warmup`` and ``--no-baseline`` shorten a row). ``--profile DIR`` adds, per row, one profiled optimizer step of our engine
after the timed rounds: the top ops and kernels by self device time (CUDA time on GPU, CPU time on
CPU) as torch.profiler's table (``DIR/profile_<preset>_seq<S>_<precision>.txt``) and as JSON (same
name, ``.json``). Writes ``benchmarks/results/throughput_<device>.json`` (a list of rows plus device
and versions).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_ext import hardware, process_group
from megatron_ext.model import build_encoder_model, parameter_count
from megatron_ext.objectives import MaskingConfig, apply_mlm
from megatron_ext.training import cuda_graphs
from megatron_ext.training.recipe import read_recipe, run_config_from_dict
from megatron_ext.training.megatron_engine import MegatronEngine, MicroBatch, megatron_transformer_overrides
from megatron_ext.training.loop import runnable_here
from megatron_ext.performance.devices import peak_flops_per_device
from megatron_ext.performance.flops import MFU_CONVENTION, flops_per_token, mean_lm_head_share
from megatron_ext.training.memory_fit import estimate_memory

REPO = Path(__file__).resolve().parent.parent

SPECIAL_IDS = (0, 1, 2, 3)  # bos, pad, eos, mask of the synthetic vocabulary
MASK_ID = 3
EOD_ID = 2
MEAN_DOCUMENT_TOKENS = 1000
"""The synthetic sequences end a document at each token with probability 1/1000 (geometric lengths,
mean ~1,000 tokens: an assumed web-text mean, ~2 documents per 2,048-token row); only the
``isolated_documents`` side attends within them, every side reads the same tokens."""

# The default side runs the size's recipe (examples/recipes/base/<size>.yaml): its spec, parameter
# dtype, fusions, LM head and optimizer layout, as RECIPE_SETTINGS lists them. Each variant asked for
# with --variants is a run-config change timed on the same batches right after the default: most
# undo one optimisation step of the recipe (no_*, local_spec, fp32_params, full_lm_head), a few try
# one it does not take (recomputation, the fused cross entropy, the unfused Adam), so its effect is a
# ratio from one run (benchmarks/README.md keeps the table of steps).
RECIPE_SETTINGS = {
    "model": ("transformer_impl", "params_dtype"),
    "training": ("bias_activation_fusion", "cross_entropy_loss_fusion", "rope_fusion", "gradient_accumulation_fusion",
                 "lm_head_scored_only"),
    "parallel": ("use_distributed_optimizer", "overlap_grad_reduce"),
}
"""What the default side takes from the size's recipe (the rest of the step is fixed here: MLM-40,
one rank, the recipe's micro-batch shape, ``--precisions``)."""
VARIANTS = {
    "no_rope_fusion": ({"training": {"rope_fusion": False}}, "RoPE unfused (Megatron's cat/mul chain)"),
    "no_grad_accum_fusion": ({"training": {"gradient_accumulation_fusion": False}},
                             "weight gradients added to main_grad outside the wgrad GEMM"),
    # Each layer implementation alone and with CUDA graphs, whichever the recipe runs: what could flip
    # its default (benchmarks/recipe_defaults.py reads these sides). A variant that is the default, or
    # another variant, on this machine is not timed twice.
    "local_spec": ({"model": {"transformer_impl": "local"}},
                   "the local spec: PyTorch SDPA attention, torch RMSNorm, Megatron's linears"),
    "local_spec_cuda_graphs": ({"model": {"transformer_impl": "local"}, "training": {"cuda_graphs": "megatron"}},
                               "the local spec with CUDA graphs of its layers"),
    "te_spec": ({"model": {"transformer_impl": "te"}, "training": {"gradient_accumulation_fusion": True}},
                "the Transformer Engine spec (with wgrad-accumulation fusion)"),
    "te_spec_cuda_graphs": ({"model": {"transformer_impl": "te"},
                             "training": {"gradient_accumulation_fusion": True, "cuda_graphs": "megatron"}},
                            "the Transformer Engine spec with CUDA graphs of its layers"),
    "fp32_params": ({"model": {"params_dtype": "float32"}}, "fp32 weights under bf16 autocast (no Float16Module)"),
    "no_swiglu_fusion": ({"training": {"bias_activation_fusion": False}}, "torch's SwiGLU (not Megatron's fused one)"),
    "full_lm_head": ({"training": {"lm_head_scored_only": False}}, "LM head + loss at every position"),
    "selective_recompute": ({"training": {"recompute_granularity": "selective"}}, "recompute core attention"),
    "full_recompute": ({"training": {"recompute_granularity": "full"}}, "recompute whole layers"),
    "cross_entropy_fusion": ({"training": {"cross_entropy_loss_fusion": True}},
                             "Megatron's native fused cross entropy (torch.compile)"),
    "cross_entropy_te": ({"training": {"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "te"}},
                         "Transformer Engine's fused cross entropy (Triton; TE >= 2.20)"),
    "unfused_adam": ({"optimizer": {"fused": False}}, "torch AdamW as Megatron builds it without TE/apex (not fused)"),
    "cuda_graphs": ({"training": {"cuda_graphs": "megatron"}},
                    "CUDA graphs of the transformer layers (Megatron's local CudaGraphManager; captured in warm-up)"),
    # The micro-batches the size recipes had before they grew to fit the GPU (same tokens per step, more micro-batches).
    "isolated_documents": ({"data": {"reset_attention_mask": True}},
                           "documents attend only within themselves (data.reset_attention_mask: THD on the TE spec)"),
    "micro_batch_3": ({"data": {"micro_batch_size": 3}}, "3 sequences per micro-batch (the 1b recipe's before)"),
    "micro_batch_6": ({"data": {"micro_batch_size": 6}}, "6 sequences per micro-batch (the 610m recipe's before)"),
    "micro_batch_9": ({"data": {"micro_batch_size": 9}}, "9 sequences per micro-batch (the 210m recipe's before)"),
    # Fewer, larger micro-batches amortise the host's cost per layer call (TE's modules: 200-400 us each).
    "micro_batch_18": ({"data": {"micro_batch_size": 18}}, "one micro-batch of 18 sequences (a rank's whole step)"),
}
GPU_ONLY_VARIANTS = ("selective_recompute", "full_recompute", "cuda_graphs", "te_spec_cuda_graphs", "local_spec_cuda_graphs")


def same_runs(default: dict, variants: dict[str, dict]) -> dict[str, str | None]:
    """For each variant (in order), what it would run the same as on this machine: ``"default"``, an
    earlier variant's name, or ``None`` (a run of its own). Settings as :func:`describe` gives them."""
    twins: dict[str, str | None] = {}
    for name, settings in variants.items():
        if settings == default:
            twins[name] = "default"
        else:
            twins[name] = next((other for other, twin in twins.items()
                                if twin is None and variants[other] == settings), None)
    return twins


def hf_model(config):
    from transformers import EuroBertConfig, EuroBertForMaskedLM

    hf_config = EuroBertConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups, max_position_embeddings=config.seq_length,
        rope_theta=config.rotary_base, rms_norm_eps=config.norm_epsilon, tie_word_embeddings=config.tie_embeddings,
        mask_token_id=MASK_ID, pad_token_id=1, bos_token_id=0, eos_token_id=2, attn_implementation="sdpa",
    )
    return EuroBertForMaskedLM(hf_config)


def recipe_shape(args, model_preset: str) -> tuple[int, int]:
    """(micro-batch size, micro-batches per step) of one rank: ``--micro-batch-size`` /
    ``--micro-batches`` where given, else the size base recipe's (``examples/recipes/base``) at
    ``--data-parallel-size`` ranks (one for the tiny demo size): global batch / (ranks x micro-batch
    size)."""
    data = read_recipe(REPO / "examples" / "recipes" / "base" / f"{model_preset}.yaml")["data"]
    ranks = 1 if model_preset == "tiny" else args.data_parallel_size  # the tiny (demo) recipe is one CPU process
    micro = args.micro_batch_size or data["micro_batch_size"]
    count = args.micro_batches or max(1, data["global_batch_size"] // (ranks * micro))
    return micro, count


HF_MICRO_BATCH_80GB = {"210m": 9, "610m": 6, "1b": 3}
"""The Hugging Face baseline's micro-batch at seq 2,048 on one 80 GB GPU: the largest measured to fit
that divides one rank's 18 sequences (benchmarks/results/gpu_visits/: 1b at 3 peaks at 41.9 GB and
at 4 at 50.5 GB, ~8.6 GB a sequence, so 6 would leave no room and 8 ran out of memory on an H100;
610m at 6 peaks at 50.8 GB; 210m at 9 is the smallest model's share of the same budget). The
baseline is timed as its user would run it, at a micro-batch that fits, on the same sequences."""


def side_shape(args, model_preset: str, side: str) -> tuple[int, int]:
    """(micro-batch size, micro-batches per step) a side runs: the recipe's shape, a ``micro_batch_N``
    variant's size or the baseline's (``HF_MICRO_BATCH_80GB``, ``--hf-micro-batch-size``) over the same
    sequences per step (the size must divide them)."""
    micro, count = recipe_shape(args, model_preset)
    sequences = micro * count
    if side == "hf":  # as asked, else ours up to the largest measured to fit
        side_micro = args.hf_micro_batch_size or min(micro, HF_MICRO_BATCH_80GB.get(model_preset, micro))
    elif side in VARIANTS:
        side_micro = VARIANTS[side][0].get("data", {}).get("micro_batch_size", micro)
    else:
        side_micro = micro
    if sequences % side_micro:
        raise SystemExit(f"throughput.py: error: {side}: a micro-batch of {side_micro} does not divide the "
                         f"{sequences} sequences of a {model_preset} step")
    return side_micro, sequences // side_micro


def recipe_settings(model_preset: str) -> dict[str, dict]:
    """The ``RECIPE_SETTINGS`` the size's base recipe sets (the trainer's defaults for the others)."""
    recipe = read_recipe(REPO / "examples" / "recipes" / "base" / f"{model_preset}.yaml")
    return {section: {k: recipe[section][k] for k in keys if k in recipe.get(section, {})}
            for section, keys in RECIPE_SETTINGS.items()}


def run_config(args, model_preset: str, seq_length: int, precision: str, variant: str | None = None):
    """The trainer's own config for this shape (the engine reads optimizer, data and precision):
    the size recipe's ``RECIPE_SETTINGS``, changed as ``VARIANTS[variant]`` says, with what this
    machine cannot run turned off as a training run would (``training.loop.runnable_here``, not
    announced here: ``describe`` records what each side ran)."""
    micro, count = side_shape(args, model_preset, variant or "megatron_ext")
    recipe = recipe_settings(model_preset)
    raw = {
        "model": {**recipe["model"], "preset": model_preset, "vocab_size": args.vocab_size, "seq_length": seq_length},
        "tokenizer": {"tokenizer_model": "unused-by-this-benchmark"},
        "data": {"data_path": ["unused-by-this-benchmark"], "seq_length": seq_length,
                 "micro_batch_size": micro, "global_batch_size": micro * count},
        "schedule": {"lr": 1e-4, "lr_decay_style": "constant", "lr_warmup_iters": 0},
        "phases": [{"objective": "mlm", "mask_ratio": 0.4, "share": 1.0}],
        "training": {**recipe["training"], "train_iters": 1, "bf16": precision != "fp32",
                     "fp8_format": "hybrid" if precision == "fp8" else None,  # Megatron's switch of FP8
                     "fp8_recipe": args.fp8_recipe if precision == "fp8" else None},
        "parallel": recipe["parallel"],
    }
    if precision == "fp32":  # an fp32 row is fp32 throughout: no bf16 weights either
        raw["model"]["params_dtype"] = "float32"
    if precision == "fp8":  # FP8 matmuls are TE layers, whatever the recipe's bf16 default (as a user must ask)
        raw["model"]["transformer_impl"] = "te"
    for section, values in (VARIANTS[variant][0] if variant else {}).items():
        if section == "data":  # a micro-batch variant's shape is side_shape's, above
            values = {key: value for key, value in values.items() if key != "micro_batch_size"}
        raw[section] = {**raw.get(section, {}), **values}
    return runnable_here(run_config_from_dict(raw), announce=False)


def describe(config) -> dict:
    """What a side runs, after this machine's fallbacks: spec, precision, fusions, LM head, optimizer."""
    t, p = config.training, config.parallel
    return {"micro_batch_size": config.data.micro_batch_size,
            "transformer_impl": config.model.transformer_impl, "params_dtype": config.model.params_dtype,
            "bf16_autocast": t.bf16, "fp8_recipe": t.fp8_recipe,
            **{name: getattr(t, name) for name in RECIPE_SETTINGS["training"]},
            "recompute_granularity": t.recompute_granularity, "cuda_graphs": t.cuda_graphs,
            "deterministic": t.deterministic, "fused_adam": config.optimizer.fused,
            "reset_attention_mask": config.data.reset_attention_mask,
            "cross_entropy_fusion_impl": t.cross_entropy_fusion_impl,
            **{name: getattr(p, name) for name in RECIPE_SETTINGS["parallel"]}}


def _sync() -> None:
    if hardware.on_gpu():
        torch.cuda.synchronize()


PEAK_MEMORY_MEASURE = {
    "gpu": "torch.cuda.max_memory_allocated of the side's own process",
    "cpu": "peak resident set size of the side's own process (resource.getrusage ru_maxrss: Python, torch and "
           "the libraries included, not only tensors)",
}


def _peak_memory_gb() -> float:
    """This process's peak memory in GB: what the caching allocator handed out on GPU, the peak RSS
    on CPU (the only peak a CPU process has; it counts the interpreter and libraries too)."""
    if hardware.on_gpu():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024) / 2**30  # bytes on macOS, KiB on Linux


class DeviceSampler:
    """The GPU's SM clock (MHz) and power draw (W) sampled every ``interval_s`` by ``nvidia-smi`` while a
    side's timed rounds run: a throttled or power-capped GPU explains a slower visit. Every 2 s: a
    sample starts a process, and a host-bound step must not pay for many (8 x 2 timed 1B steps are
    ~9 s: four or five samples). Nothing on CPU or where ``nvidia-smi`` is missing (``summary()`` says so)."""

    QUERY = ("clocks.sm", "clocks.max.sm", "power.draw", "power.limit")

    def __init__(self, interval_s: float = 2.0):
        import shutil
        import threading

        self.interval_s = interval_s
        self.samples: list[dict[str, float]] = []
        self.why_none = (None if hardware.on_gpu() and shutil.which("nvidia-smi") else
                         "no CUDA GPU" if not hardware.on_gpu() else "nvidia-smi not found")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._device = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"

    def _sample(self) -> dict[str, float] | None:
        try:
            out = subprocess.run(["nvidia-smi", f"--id={self._device}", f"--query-gpu={','.join(self.QUERY)}",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5)
            values = [float(v) for v in out.stdout.strip().splitlines()[0].split(",")]
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None
        return dict(zip(("sm_clock_mhz", "max_sm_clock_mhz", "power_w", "power_limit_w"), values))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if (sample := self._sample()) is not None:
                self.samples.append(sample)

    def __enter__(self) -> "DeviceSampler":
        if self.why_none is None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def summary(self) -> dict:
        """Median and minimum SM clock, median and maximum power over the samples, and their count."""
        if not self.samples:
            return {"samples": 0, "why_none": self.why_none or "no sample read (the rounds were shorter than "
                                                                 f"{self.interval_s} s, or nvidia-smi failed)"}
        clocks = [x["sm_clock_mhz"] for x in self.samples]
        power = [x["power_w"] for x in self.samples]
        return {"samples": len(self.samples), "sm_clock_mhz_median": statistics.median(clocks),
                "sm_clock_mhz_min": min(clocks), "max_sm_clock_mhz": self.samples[0]["max_sm_clock_mhz"],
                "power_w_median": statistics.median(power), "power_w_max": max(power),
                "power_limit_w": self.samples[0]["power_limit_w"]}


def attention_backend(config) -> dict:
    """The attention kernel a side ran: with the TE spec, what Transformer Engine chose at its last
    call (its module-level ``_attention_backends``: flash, fused (cuDNN, with its backend number) or
    unfused); with the local spec, PyTorch's SDPA and which of its kernels are enabled."""
    if config.model.transformer_impl == "te":
        try:
            from transformer_engine.pytorch.attention.dot_product_attention import _attention_backends as chosen
        except ImportError as error:
            return {"spec": "te", "error": f"cannot read TE's choice: {error}"}
        return {"spec": "te", **{key: str(chosen.get(key)) for key in (
            "use_flash_attention", "flash_attention_backend", "use_fused_attention", "fused_attention_backend",
            "use_unfused_attention")}}
    cuda = torch.backends.cuda
    return {"spec": config.model.transformer_impl, "kernel": "torch SDPA",
            **({"flash_sdp": cuda.flash_sdp_enabled(), "cudnn_sdp": cuda.cudnn_sdp_enabled(),
                "mem_efficient_sdp": cuda.mem_efficient_sdp_enabled()} if hardware.on_gpu() else {})}


def _timed_rounds(step, batch, args, wall: dict) -> list[float]:
    """Seconds per step of each round, after warm-up steps; ``wall`` gets the seconds the warm-up
    and the timed rounds took (batch making included)."""
    def timed(n: int) -> float:
        batches = [batch() for _ in range(n)]
        _sync()
        start = time.perf_counter()
        for b in batches:
            step(b)
        _sync()
        return (time.perf_counter() - start) / n

    start = time.perf_counter()
    if args.warmup:
        timed(args.warmup)
    wall["warmup"] = time.perf_counter() - start
    start = time.perf_counter()
    rounds = [timed(args.steps) for _ in range(args.rounds)]
    wall["timed"] = time.perf_counter() - start
    return rounds


def profile_step(step, batch, out_dir: Path, stem: str, *, top: int = 40) -> dict:
    """One optimizer step under torch.profiler (after the timed rounds, so warmed up); writes the
    ``top`` ops and kernels by self device time (CUDA time on GPU, CPU time on CPU) to
    ``<stem>.txt`` (torch's table) and ``<stem>.json``; returns both paths."""
    from torch.profiler import ProfilerActivity, profile

    gpu = hardware.on_gpu()
    b = batch()
    _sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as prof:
        start = time.perf_counter()
        step(b)
        _sync()
        wall = time.perf_counter() - start
    # Self time: a kernel's (or op's) own time, so nothing is counted twice (a matmul op's time is
    # its kernels' time); on GPU the kernels lead this list.
    key = "self_device_time_total" if gpu else "self_cpu_time_total"
    averages = prof.key_averages()
    total = sum(getattr(e, key) for e in averages) or 1.0
    ops = sorted(averages, key=lambda e: getattr(e, key), reverse=True)[:top]
    record = {
        "device": hardware.device_name() or "cpu", "time": "CUDA (device) time" if gpu else "CPU time",
        "sort_by": key, "step_wall_s": wall, "total_self_time_us": total,
        "ops": [{"name": e.key, "calls": e.count, "self_time_us": getattr(e, key),
                 "self_share": getattr(e, key) / total,
                 "total_time_us": e.device_time_total if gpu else e.cpu_time_total} for e in ops],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    table, as_json = out_dir / f"{stem}.txt", out_dir / f"{stem}.json"
    table.write_text(f"one optimizer step of megatron_ext ({stem}), wall {1e3 * wall:.1f} ms; top {top} by "
                     f"{key}\n\n" + averages.table(sort_by=key, row_limit=top) + "\n")
    as_json.write_text(json.dumps(record, indent=2) + "\n")
    return {"table": str(table), "json": str(as_json)}


def _ours(config, batch, args, profile_stem: str | None, wall: dict) -> dict:
    start = time.perf_counter()
    cuda_graphs.prepare_rng(config)  # graph-safe RNG tracker for the cuda_graphs variant (nothing otherwise)
    torch.manual_seed(0)
    model = build_encoder_model(config.model, transformer_overrides=megatron_transformer_overrides(config))
    engine = MegatronEngine(model.to(hardware.device()), config)
    _sync()
    wall["build"] = time.perf_counter() - start

    def step(micro_batches):
        engine.train_step([MicroBatch(b, None) for b in micro_batches], lr=1e-4)

    # The optimizer's update (gradient clipping and Adam over every parameter) timed apart, so that a
    # row can charge it as a rank of a data-parallel run pays it (``run_shape``). The engine already
    # waits for the device before it (its finite-gradient check reads a sum), so the sync added here
    # costs the step nothing it did not pay.
    optimizer_s: list[float] = []
    update = engine.optimizer.step

    def timed_update(*a, **kw):
        _sync()
        start = time.perf_counter()
        out = update(*a, **kw)
        _sync()
        optimizer_s.append(time.perf_counter() - start)
        return out

    engine.optimizer.step = timed_update
    try:  # with cuda_graphs the first warm-up step captures the graphs (--warmup >= 1 keeps it untimed)
        with DeviceSampler() as device_samples:
            result = {"rounds_s": _timed_rounds(step, batch, args, wall)}
        result["device_samples"] = device_samples.summary()
        timed = optimizer_s[-args.steps * args.rounds:]
        result["optimizer_rounds_s"] = [statistics.mean(timed[i * args.steps:(i + 1) * args.steps])
                                        for i in range(args.rounds)] if len(timed) == args.steps * args.rounds else None
        result["attention_backend"] = attention_backend(config)
        if profile_stem is not None:
            start = time.perf_counter()
            result["profile"] = profile_step(step, batch, Path(args.profile), profile_stem)
            wall["profile"] = time.perf_counter() - start
    finally:
        engine.close()
    return result


def _hf(config, batch, args, wall: dict) -> dict:
    start = time.perf_counter()
    device = hardware.device()
    torch.manual_seed(0)
    hf = hf_model(config.model).to(device)
    optimizer = torch.optim.AdamW(hf.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1,
                                  fused=True)
    forward = torch.compile(hf) if args.hf_compile else hf

    def step(micro_batches):  # gradient accumulation as a transformers user writes it
        optimizer.zero_grad(set_to_none=True)
        for b in micro_batches:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.training.bf16):
                loss = forward(input_ids=b.input_ids, labels=b.labels).loss
            (loss / len(micro_batches)).backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        optimizer.step()

    _sync()
    wall["build"] = time.perf_counter() - start
    with DeviceSampler() as device_samples:
        rounds = _timed_rounds(step, batch, args, wall)
    return {"rounds_s": rounds, "device_samples": device_samples.summary()}


def _batches(args, model_preset: str, seq_length: int, side: str):
    """A maker of one optimizer step's micro-batches; each side builds the step's sequences from the
    same generator seed and splits them into its own micro-batches (``side_shape``), so every side of a
    row trains on identical sequences."""
    device = hardware.device()
    micro, count = side_shape(args, model_preset, side)
    masking = MaskingConfig(mask_ratio=0.4)
    gen = torch.Generator(device=device).manual_seed(0)
    isolated = VARIANTS.get(side, ({},))[0].get("data", {}).get("reset_attention_mask", False)

    def step_batches():  # one optimizer step: `count` micro-batches
        tokens = torch.randint(4, args.vocab_size, (micro * count, seq_length), generator=gen, device=device)
        ends = torch.rand(tokens.shape, generator=gen, device=device) < 1 / MEAN_DOCUMENT_TOKENS
        step = apply_mlm(tokens.masked_fill(ends, EOD_ID), config=masking, mask_id=MASK_ID,
                         vocab_size=args.vocab_size, special_ids=SPECIAL_IDS, generator=gen,
                         document_ends=ends if isolated else None)
        documents = ends.split(micro) if isolated else [None] * count
        return [dataclasses.replace(step, input_ids=ids, labels=labels, loss_mask=mask, document_ends=document_ends)
                for ids, labels, mask, document_ends
                in zip(*(t.split(micro) for t in (step.input_ids, step.labels, step.loss_mask)), documents)]
    return step_batches


def run_side(spec: dict) -> dict:
    """Measure one side of one row in this process (``--run-side``): ``spec["side"]`` is
    ``megatron_ext``, ``hf``, a variant name, or ``probe`` (what the machine is, checked before
    anything is timed). Returns rounds and this process's peak memory, or an ``error`` when the
    side does not fit in memory."""
    # Start-up: from the parent's spawning this process to here (interpreter, torch, Megatron, TE).
    wall = {"startup": time.time() - spec["spawned_at"]} if "spawned_at" in spec else {}
    args = argparse.Namespace(**spec["args"])
    side = spec["side"]
    if side == "probe":
        if "fp8" in args.precisions:
            hardware.check_run_supported(fp8_recipe=args.fp8_recipe, recompute_granularity=None)
        return {"device": hardware.device_name() or f"cpu{torch.get_num_threads()}",
                "versions": hardware.software_versions(), "wall_s": wall}
    preset, seq_length, precision = spec["model"], spec["seq_length"], spec["precision"]
    config = run_config(args, preset, seq_length, precision, None if side in ("megatron_ext", "hf") else side)
    if hardware.on_gpu():
        torch.cuda.reset_peak_memory_stats()
    ours = side != "hf"
    if ours:  # the engine needs Megatron's parallel state; the baseline needs nothing of it
        process_group.init_process_group_and_model_parallel(seed=1234)
    try:
        if side == "hf":
            result = _hf(config, _batches(args, preset, seq_length, side), args, wall)
        else:
            stem = f"profile_{preset}_seq{seq_length}_{precision}" if side == "megatron_ext" and args.profile else None
            result = _ours(config, _batches(args, preset, seq_length, side), args, stem, wall)
    except torch.OutOfMemoryError as error:  # a measurement too: this side does not fit at this shape
        result = {"error": f"out of memory: {str(error).splitlines()[0]}"}
    finally:
        if ours:
            process_group.destroy_process_group_and_model_parallel()
    (phase,) = config.resolved_phases
    share = mean_lm_head_share(phase, seq_length=seq_length, scored_only=config.training.lm_head_scored_only)
    # The trainer's dry-run estimate for this configuration, next to the measured peak (its target: within 10 %).
    estimated = estimate_memory(config, world_size=1).total / 2**30 if ours else None
    result["cudnn"] = torch.backends.cudnn.version() if hardware.on_gpu() else None
    return {**result, "peak_mem_gb": _peak_memory_gb(), "estimated_mem_gb": estimated, "engine": "megatron",
            "wall_s": wall, "settings": describe(config) if ours else None,
            "transformer_impl": config.model.transformer_impl, "parameters": parameter_count(config.model),
            "flops_per_token": flops_per_token(config.model, seq_length, lm_head_share=share)}


# A torchrun launch's rendezvous variables would make every side's process join the parent's
# process group; each side is a lone process with its own file-store rendezvous instead.
_LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def measure_alone(args, side: str, model_preset: str | None = None, seq_length: int | None = None,
                  precision: str | None = None) -> dict:
    """``run_side`` in a process of its own, so that nothing of another side (weights, gradients,
    optimizer state, the caching allocator's blocks) is resident while this side runs and its
    peak memory is its own. Raises with the process's output when it fails (other than by running
    out of memory, which the side reports)."""
    with tempfile.TemporaryDirectory(prefix="throughput_side_") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        spawned_at = time.time()
        spec_path.write_text(json.dumps({"side": side, "model": model_preset, "seq_length": seq_length,
                                         "precision": precision, "args": settings, "spawned_at": spawned_at}))
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
        run = subprocess.run([sys.executable, "-m", "benchmarks.throughput", "--run-side", str(spec_path),
                              "--side-result", str(result_path)], cwd=REPO, env=env, capture_output=True, text=True)
        if run.returncode != 0 or not result_path.is_file():
            output = (run.stdout + run.stderr).strip()
            message = (f"throughput side {side!r} ({model_preset} seq {seq_length} {precision}) exited with "
                       f"{run.returncode}; its last output:\n{output[-6000:]}")
            if side == "probe":
                raise RuntimeError(message)
            # A side that crashes is a finding of the row (e.g. a setting broken on this GPU), not the
            # end of the benchmark: the other sides are still measured.
            print(message, file=sys.stderr, flush=True)
            lines = [ln for ln in output.splitlines() if ln.strip()]
            error = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
            return {"error": f"crashed (exit {run.returncode}): {error.strip()[:300]}", "peak_mem_gb": None,
                    "estimated_mem_gb": None, "wall_s": {"total": time.time() - spawned_at}}
        result = json.loads(result_path.read_text())
        wall = result.setdefault("wall_s", {})
        wall["total"] = time.time() - spawned_at
        wall["teardown"] = max(0.0, wall["total"] - sum(v for k, v in wall.items() if k != "total"))
        return result


STEP_CHARGES = {
    "one_gpu": "one GPU alone: the whole Adam update (unsharded) charged to this rank's micro-batches",
    "run": "one rank of a run of the recipe at --data-parallel-size ranks: with the distributed optimizer, its "
           "1/ranks share of the update (timed apart here, divided); the reduce-scatter and all-gather that "
           "replace DDP's all-reduce are not counted",
}
"""How a row's two step times charge the optimizer's update (both are reported, each named)."""


def run_step_time(step_time: float | None, optimizer_time: float | None, *, ranks: int,
                  distributed_optimizer: bool) -> float | None:
    """The step as a rank of a ``ranks``-way data-parallel run of the recipe pays it
    (``STEP_CHARGES["run"]``): the forward and backward as timed, plus the rank's share of the update.
    Without the distributed optimizer every rank runs the whole update: the one-GPU time."""
    if step_time is None or optimizer_time is None:
        return None
    share = optimizer_time / ranks if distributed_optimizer else optimizer_time
    return step_time - optimizer_time + share


def measure(args, model_preset: str, seq_length: int, precision: str,
            on_side: Callable[[dict], None] | None = None) -> dict:
    """One row: our engine, each variant, then the baseline, each alone in its own process, on
    batches from the same generator seed. ``on_side`` gets a record of each side as soon as it is
    measured (a run cut short keeps what it measured)."""
    micro, count = recipe_shape(args, model_preset)
    tokens = count * micro * seq_length  # per optimizer step

    def speed(side: dict) -> tuple[float | None, float | None]:
        if "error" in side:
            return None, None
        step_time = statistics.median(side["rounds_s"])
        return step_time, tokens / step_time

    ranks = 1 if model_preset == "tiny" else args.data_parallel_size  # as recipe_shape takes the world

    def at_run_shape(side: dict) -> tuple[float | None, float | None, float | None]:
        """(optimizer seconds per step, the run's step time, its tokens/s) of one of our sides."""
        if "error" in side or not side.get("optimizer_rounds_s"):
            return None, None, None
        optimizer = statistics.median(side["optimizer_rounds_s"])
        settings = side.get("settings") or {}
        run_time = run_step_time(statistics.median(side["rounds_s"]), optimizer, ranks=ranks,
                                 distributed_optimizer=bool(settings.get("use_distributed_optimizer")))
        return optimizer, run_time, tokens / run_time

    def measured(name: str, side: dict) -> dict:
        if on_side is not None:
            step_time, side_speed = speed(side)
            optimizer, run_time, run_speed = at_run_shape(side) if name != "hf" else (None, None, None)
            on_side({"row": f"{model_preset} seq {seq_length} {precision}", "side": name,
                     "tokens_per_s": side_speed, "step_time_s": step_time, "optimizer_time_s": optimizer,
                     "run_step_time_s": run_time, "run_tokens_per_s": run_speed, "run_ranks": ranks,
                     "device_samples": side.get("device_samples"), "attention_backend": side.get("attention_backend"),
                     "cudnn": side.get("cudnn"), "peak_mem_gb": side.get("peak_mem_gb"),
                     "estimated_mem_gb": side.get("estimated_mem_gb"), "error": side.get("error"),
                     "wall_s": (side.get("wall_s") or {}).get("total"), "settings": side.get("settings"),
                     "flops_per_token": side.get("flops_per_token"), "device": args.device_name})
        return side

    default_settings = describe(run_config(args, model_preset, seq_length, precision))
    ours = measured("megatron_ext", measure_alone(args, "megatron_ext", model_preset, seq_length, precision))
    step_time, tokens_per_s = speed(ours)
    variants = {}
    twins = same_runs(default_settings, {name: describe(run_config(args, model_preset, seq_length, precision, name))
                                         for name in args.variants})
    for name in args.variants:
        if twins[name] == "default":
            # What it undoes is off here already (a fallback, or not in this size's recipe): no side to time.
            variants[name] = {"change": VARIANTS[name][1], "same_as_default": True, "tokens_per_s": None,
                              "peak_mem_gb": None, "default_speedup": None, "rounds_s": None, "error": None,
                              "wall_s": None}
            continue
        if twins[name] is not None:  # e.g. cuda_graphs and te_spec_cuda_graphs when the recipe runs the TE spec
            variants[name] = {**variants[twins[name]], "change": VARIANTS[name][1], "same_as": twins[name], "wall_s": None}
            continue
        side = measured(name, measure_alone(args, name, model_preset, seq_length, precision))
        v_time, v_speed = speed(side)
        variants[name] = {"change": VARIANTS[name][1], "same_as_default": False, "tokens_per_s": v_speed,
                          "run_tokens_per_s": at_run_shape(side)[2], "device_samples": side.get("device_samples"),
                          "attention_backend": side.get("attention_backend"),
                          "peak_mem_gb": side["peak_mem_gb"], "estimated_mem_gb": side.get("estimated_mem_gb"),
                          "default_speedup": v_time / step_time if v_time and step_time else None,
                          "rounds_s": side.get("rounds_s"), "error": side.get("error"), "wall_s": side["wall_s"],
                          "settings": side.get("settings")}
    hf = (measured("hf", measure_alone(args, "hf", model_preset, seq_length, precision)) if args.baseline
          else {"error": "not run (--no-baseline)", "peak_mem_gb": None, "wall_s": None})
    hf_step_time, hf_tokens_per_s = speed(hf)
    hf_shape = side_shape(args, model_preset, "hf")
    achieved = tokens_per_s * ours["flops_per_token"] if tokens_per_s else None
    peak = peak_flops_per_device(args.device_name) if hardware.on_gpu() else None
    optimizer_time, run_time, run_tokens_per_s = at_run_shape(ours)
    run_achieved = run_tokens_per_s * ours["flops_per_token"] if run_tokens_per_s else None
    return {
        "model": model_preset, "seq_length": seq_length, "precision": precision,
        "micro_batch_size": micro, "micro_batches_per_step": count, "tokens_per_step": tokens,
        "micro_batch_time_s": step_time / count if step_time else None,
        "hf_micro_batch_size": hf_shape[0], "hf_micro_batches_per_step": hf_shape[1],
        "hf_micro_batch_time_s": hf_step_time / hf_shape[1] if hf_step_time else None,
        "parameters": ours["parameters"], "engine": ours["engine"], "transformer_impl": ours["transformer_impl"],
        "tokens_per_s": tokens_per_s, "tflops": achieved / 1e12 if achieved else None,
        "mfu": achieved / peak if achieved and peak else None, "step_charge": STEP_CHARGES["one_gpu"],
        "optimizer_time_s": optimizer_time, "run_ranks": ranks, "run_step_charge": STEP_CHARGES["run"],
        "run_step_time_s": run_time, "run_tokens_per_s": run_tokens_per_s,
        "run_mfu": run_achieved / peak if run_achieved and peak else None,
        "device_samples": ours.get("device_samples"), "hf_device_samples": hf.get("device_samples"),
        "attention_backend": ours.get("attention_backend"), "cudnn": ours.get("cudnn"),
        "peak_mem_gb": ours["peak_mem_gb"], "estimated_mem_gb": ours.get("estimated_mem_gb"), "step_time_s": step_time,
        "hf_tokens_per_s": hf_tokens_per_s, "hf_peak_mem_gb": hf["peak_mem_gb"], "hf_step_time_s": hf_step_time,
        "peak_mem_measure": PEAK_MEMORY_MEASURE["gpu" if hardware.on_gpu() else "cpu"],
        "speedup_vs_hf": hf_step_time / step_time if step_time and hf_step_time else None,
        "errors": {name: side["error"] for name, side in (("megatron_ext", ours), ("hf", hf)) if "error" in side},
        "variants": variants, "profile": ours.get("profile"), "settings": ours.get("settings"),
        "rounds_s": {"megatron_ext": ours.get("rounds_s"), "hf": hf.get("rounds_s")},
        "wall_s": {"megatron_ext": ours["wall_s"], "hf": hf["wall_s"],
                   **{name: v["wall_s"] for name, v in variants.items() if v["wall_s"] is not None}},
    }


def _format_row(row: dict) -> list[str]:
    """The printed lines of a row: speed and peak memory of each side side by side, the ratio,
    then the variants."""
    def speed(value):
        return "out of memory" if value is None else f"{value:,.0f} tok/s"

    gpu = row["peak_mem_measure"] == PEAK_MEMORY_MEASURE["gpu"]
    mem_label = "peak GPU mem" if gpu else "peak RSS"
    head = (f"{row['model']} seq {row['seq_length']} {row['precision']}, {row['micro_batches_per_step']} x "
            f"micro-batch {row['micro_batch_size']}/step: ")
    if row["tokens_per_s"] is None:
        ours = f"megatron_ext {row['errors']['megatron_ext']}"
    else:
        mfu = "" if row["mfu"] is None else f" | MFU {100 * row['mfu']:.1f}%"
        ours = (f"{speed(row['tokens_per_s'])} | {1e3 * row['step_time_s']:.0f} ms/step, "
                f"{1e3 * row['micro_batch_time_s']:.0f} ms/micro-batch | {row['tflops']:.1f} TFLOP/s{mfu}")
    if row["hf_peak_mem_gb"] is None:  # --no-baseline
        hf = "HF not run"
    else:
        ratio = "" if row["speedup_vs_hf"] is None else f" | x{row['speedup_vs_hf']:.2f} vs HF"
        shape = ("" if row["hf_micro_batch_size"] == row["micro_batch_size"]
                 else f" ({row['hf_micro_batches_per_step']} x micro-batch {row['hf_micro_batch_size']})")
        hf = f"HF{shape} {speed(row['hf_tokens_per_s'])}, {mem_label} {row['hf_peak_mem_gb']:.2f} GB{ratio}"
    lines = [f"{head}{ours} | {mem_label} {row['peak_mem_gb']:.2f} GB | {hf}"]
    if row.get("run_tokens_per_s"):
        mfu = "" if row.get("run_mfu") is None else f", MFU {100 * row['run_mfu']:.1f}%"
        lines.append(f"    as a rank of a {row['run_ranks']}-rank run pays it: {row['run_tokens_per_s']:,.0f} tok/s"
                     f"{mfu} ({1e3 * row['run_step_time_s']:.0f} ms/step; the optimizer's update "
                     f"{1e3 * row['optimizer_time_s']:.1f} ms on one GPU)")
    samples = row.get("device_samples") or {}
    if samples.get("samples"):
        lines.append(f"    GPU while timed: SM clock {samples['sm_clock_mhz_median']:.0f} MHz median (min "
                     f"{samples['sm_clock_mhz_min']:.0f}, max {samples['max_sm_clock_mhz']:.0f}), power "
                     f"{samples['power_w_median']:.0f} W median of {samples['power_limit_w']:.0f} W; cuDNN {row.get('cudnn')}; "
                     f"attention {row.get('attention_backend')}")
    if row.get("settings"):
        on = [k for k, v in row["settings"].items() if v is True]
        lines.append(f"    default ({row['settings']['transformer_impl']} spec, {row['settings']['params_dtype']} "
                     f"parameters): {', '.join(on) or 'no switches on'}")
    for name, v in row["variants"].items():
        if v.get("same_as_default"):
            lines.append(f"    default vs {name} ({v['change']}): not timed, the default runs the same here")
        elif v["tokens_per_s"] is None:
            lines.append(f"    default vs {name} ({v['change']}): {v['error']}")
        else:
            ratio = "" if v["default_speedup"] is None else f"x{v['default_speedup']:.2f} "
            lines.append(f"    default vs {name} ({v['change']}): {ratio}({v['tokens_per_s']:,.0f} tok/s, "
                         f"{mem_label} {v['peak_mem_gb']:.2f} GB)")
    if row["profile"]:
        lines.append(f"    profile of one optimizer step: {row['profile']['table']}")
    phases = ("startup", "build", "warmup", "timed", "profile", "teardown")
    walls = [f"{side} " + "/".join(f"{wall.get(k, 0.0):.1f}" for k in phases) + f" = {wall['total']:.1f}"
             for side, wall in row["wall_s"].items() if wall]
    lines.append(f"    wall s per side ({'/'.join(phases)} = total): " + "; ".join(walls)
                 + f"; row {sum(w['total'] for w in row['wall_s'].values() if w):.1f}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--cpu-tiny", action="store_true", help="CI mode: --presets tiny --seq-lengths 128 --precisions fp32")
    add("--presets", nargs="+", default=["210m", "610m", "1b"])
    add("--seq-lengths", nargs="+", type=int, default=[1024, 2048])
    add("--precisions", nargs="+", choices=("fp32", "bf16", "fp8"), default=["bf16", "fp8"])
    add("--fp8-recipe", choices=("delayed", "tensorwise"), default="delayed")
    add("--vocab-size", type=int, default=128_256, help="the paper's Llama-3 vocabulary")
    add("--micro-batch-size", type=int, default=None, help="default: the paper recipe's for the preset")
    add("--hf-micro-batch-size", type=int, default=None,
        help="the Hugging Face baseline's micro-batch (same sequences per step); default: the recipe's, at most "
             "the largest measured to fit an 80 GB GPU (HF_MICRO_BATCH_80GB)")
    add("--micro-batches", type=int, default=None,
        help="micro-batches per optimizer step (gradient accumulation, both sides); default: one rank's "
             "share of the recipe's global batch at --data-parallel-size ranks")
    add("--data-parallel-size", type=int, default=64,
        help="the world the recipe shape is taken at (default 64: 8 nodes of 8 GPUs)")
    add("--steps", type=int, default=5, help="timed steps per round and side")
    add("--rounds", type=int, default=3)
    add("--warmup", type=int, default=2,
        help="untimed steps per side first (every side the same; fewer start a side sooner, but the first "
             "steps carry torch.compile and TE's one-off set-up)")
    add("--hf-compile", action="store_true", help="torch.compile the Hugging Face model")
    add("--baseline", action=argparse.BooleanOptionalAction, default=True,
        help="time the Hugging Face baseline (--no-baseline: our default and its variants only, one process "
             "less per row)")
    add("--variants", nargs="*", choices=sorted(VARIANTS), default=["full_lm_head"],
        help="run-config changes to time against the default (the size recipe's configuration), same batches; "
             "a variant that changes nothing on this machine is reported, not timed: "
        + "; ".join(f"{k}: {v[1]}" for k, v in VARIANTS.items()))
    add("--profile", type=Path, default=None, metavar="DIR",
        help="after the timed rounds, profile one optimizer step of megatron_ext per row (torch.profiler) and "
             "write the top ops and kernels by self device time (CUDA time on GPU, CPU time on CPU) to "
             "DIR/profile_<preset>_seq<S>_<precision>.txt (table) and .json")
    add("--output", type=Path, default=None, help="default: benchmarks/results/throughput_<device>.json")
    # Internal: one side of one row in this process (see measure_alone).
    add("--run-side", type=Path, default=None, help=argparse.SUPPRESS)
    add("--side-result", type=Path, default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.run_side is not None:
        args.side_result.write_text(json.dumps(run_side(json.loads(args.run_side.read_text()))))
        return 0
    if args.cpu_tiny:
        args.presets, args.seq_lengths, args.precisions = ["tiny"], [128], ["fp32"]
        args.vocab_size = min(args.vocab_size, 8192)
    gpu_only = [v for v in args.variants if v in GPU_ONLY_VARIANTS]
    if gpu_only and not hardware.on_gpu():
        parser.error(f"--variants {' '.join(gpu_only)} need CUDA (Megatron's activation recomputation, CUDA graphs)")

    # This process only starts the sides and reads their results: it allocates nothing on the
    # device (not even a CUDA context), so each side's process has the device to itself.
    args.device_name = None
    started = time.time()
    probe = measure_alone(args, "probe")  # FP8 support is checked there, before anything is timed
    args.device_name = probe["device"]
    print(f"{args.device_name}; FLOPs/token = {MFU_CONVENTION}; MFU against the dense bf16 peak; each side (ours, "
          f"each variant, HF) measured alone in its own process", flush=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "_", args.device_name).strip("_").lower()
    out = args.output or REPO / "benchmarks" / "results" / f"throughput_{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    sides_log = out.with_suffix(".sides.jsonl")
    sides_log.write_text("")

    def on_side(record: dict) -> None:
        with open(sides_log, "a") as log:
            log.write(json.dumps(record) + "\n")
        speed = "-" if record["tokens_per_s"] is None else f"{record['tokens_per_s']:,.0f} tok/s"
        print(f"  measured {record['row']} / {record['side']}: {speed}"
              + (f" ({record['error']})" if record["error"] else "")
              + (f" in {record['wall_s']:.0f} s" if record["wall_s"] else ""), flush=True)

    rows = []
    for model_preset in args.presets:
        for seq_length in args.seq_lengths:
            for precision in args.precisions:
                row = measure(args, model_preset, seq_length, precision, on_side)
                rows.append(row)
                print("\n".join(_format_row(row)), flush=True)
    result = {"benchmark": "throughput", "device": args.device_name, "flops_convention": MFU_CONVENTION,
              "mfu_peak": "dense bf16 peak of the device (also for fp8 rows)", "versions": probe["versions"],
              "peak_mem_measure": PEAK_MEMORY_MEASURE["gpu" if hardware.on_gpu() else "cpu"],
              "settings": {k: v for k, v in vars(args).items() if k not in ("output", "run_side", "side_result")},
              "rows": rows, "wall_s": {"probe": probe["wall_s"]["total"], "total": time.time() - started}}
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {out}; wall time {result['wall_s']['total']:.0f} s (probe {result['wall_s']['probe']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
