"""Training throughput of the encoder vs a Hugging Face baseline, same shapes and batches, one device.

    .venv/bin/python benchmarks/throughput.py                      # GPU: 210m/610m/1b x seq 1024/2048 x bf16/fp8
    .venv/bin/python benchmarks/throughput.py --cpu-tiny           # CPU (CI): the tiny preset, seq 128, fp32
    .venv/bin/python benchmarks/throughput.py --presets 610m --seq-lengths 2048 --precisions bf16

Per (preset, sequence length, precision) both sides train MLM-40 % on the same random-token
batches (the objective and shapes set the speed, not the text), AdamW (0.9, 0.95), clip 1.0, at
the recipes' shape: an optimizer step takes as many micro-batches as one rank gets in the paper
recipe (global batch 1,152 over ``--data-parallel-size`` 64 ranks: 2 / 3 / 6 micro-batches of
9 / 6 / 3 sequences at 210m / 610m / 1b), gradient accumulation on both sides:
- megatron_ext: ``build_encoder_model`` (TE spec when Transformer Engine imports) driven by the
  training engine the trainer uses (``training.engine: auto``: Megatron-Core DDP + optimizer +
  forward-backward schedule on GPU, the portable engine on CPU), bf16 autocast, FP8 via TE;
- Hugging Face: ``transformers.EuroBertForMaskedLM`` (SDPA attention) with its own loss, bf16
  autocast, fused AdamW; ``--hf-compile`` adds ``torch.compile``.
Each side runs warm-up steps, then timed rounds (the median round counts), one after the other on
identical batches. Reported per row: tokens/s, achieved TFLOP/s and MFU (FLOPs convention of
``megatron_ext.training.metrics``, printed; MFU against the dense bf16 peak, also for FP8 rows),
peak GPU memory and step time, and the baseline's tokens/s and memory on the same shape; for each
of ``--variants`` (an optimisation step undone or a tuning choice, as a run-config change) its
tokens/s and how much faster the default is, timed on the same batches in the same run. Writes
``benchmarks/results/throughput_<device>.json`` (a list of rows plus device and versions).
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from megatron_ext import platform  # noqa: E402
from megatron_ext.model import build_encoder_model, parameter_count  # noqa: E402
from megatron_ext.objectives import MaskingConfig, apply_mlm  # noqa: E402
from megatron_ext.training.config import read_recipe, run_config_from_dict  # noqa: E402
from megatron_ext.training.engines import MicroBatch, build_engine, megatron_transformer_overrides  # noqa: E402
from megatron_ext.schedule import resolve_phases  # noqa: E402
from megatron_ext.training.metrics import MFU_CONVENTION, flops_per_token, lm_head_share, peak_flops_per_device  # noqa: E402

SPECIAL_IDS = (0, 1, 2, 3)  # bos, pad, eos, mask of the synthetic vocabulary
MASK_ID = 3

# Optimisation steps as run-config changes from the trainer's defaults: each one asked for with
# --variants is timed on the same batches right after the default configuration, so its effect is
# a ratio from one run (benchmarks/README.md keeps the table of steps).
VARIANTS = {
    "full_lm_head": ({"training": {"lm_head_scored_only": False}}, "LM head + loss at every position"),
    "selective_recompute": ({"training": {"recompute_granularity": "selective"}}, "recompute core attention"),
    "full_recompute": ({"training": {"recompute_granularity": "full"}}, "recompute whole layers"),
    "bf16_params": ({"model": {"params_dtype": "bfloat16"}},
                    "bf16 weights, fp32 main params in Megatron's optimizer (Megatron-LM mixed precision)"),
    "swiglu_fusion": ({"training": {"bias_activation_fusion": True}}, "Megatron's fused SwiGLU (torch.compile)"),
    "cross_entropy_fusion": ({"training": {"cross_entropy_loss_fusion": True}},
                             "Megatron's native fused cross entropy (torch.compile)"),
    "unfused_adam": ({"optimizer": {"fused": False}}, "torch AdamW as Megatron builds it without TE/apex (not fused)"),
}
GPU_ONLY_VARIANTS = ("selective_recompute", "full_recompute")


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
    ``--micro-batches`` where given, else the paper recipe's (``examples/recipes/base``) at
    ``--data-parallel-size`` ranks: global batch / (data-parallel size x micro-batch size)."""
    base = REPO / "examples" / "recipes" / "base" / f"{model_preset}.yaml"
    if not base.is_file():  # the CPU preset: the demo recipe's shape
        return args.micro_batch_size or 8, args.micro_batches or 2
    data = read_recipe(base)["data"]
    micro = args.micro_batch_size or data["micro_batch_size"]
    count = args.micro_batches or max(1, data["global_batch_size"] // (args.data_parallel_size * micro))
    return micro, count


def run_config(args, model_preset: str, seq_length: int, precision: str, variant: str | None = None):
    """The trainer's own config for this shape (the engine reads optimizer, data and precision),
    changed as ``VARIANTS[variant]`` says."""
    micro, count = recipe_shape(args, model_preset)
    backend, _ = platform.attention_backend_fallback("te")
    raw = {
        "model": {"preset": model_preset, "vocab_size": args.vocab_size, "seq_length": seq_length,
                  "attention_backend": backend},
        "tokenizer": {"tokenizer_model": "unused-by-this-benchmark"},
        "data": {"data_path": ["unused-by-this-benchmark"], "seq_length": seq_length,
                 "micro_batch_size": micro, "global_batch_size": micro * count},
        "schedule": {"lr": 1e-4, "lr_decay_style": "constant", "lr_warmup_iters": 0},
        "phases": [{"objective": "mlm", "mask_ratio": 0.4, "share": 1.0}],
        "training": {"train_iters": 1, "bf16": precision != "fp32",
                     "fp8_recipe": args.fp8_recipe if precision == "fp8" else None},
    }
    for section, values in (VARIANTS[variant][0] if variant else {}).items():
        raw[section] = {**raw.get(section, {}), **values}
    return run_config_from_dict(raw)


def _sync() -> None:
    if platform.on_gpu():
        torch.cuda.synchronize()


def _peak_gb() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if platform.on_gpu() else None


def _timed_rounds(step, batch, args) -> tuple[list[float], float | None]:
    """Seconds per step of each round (after warm-up steps) and peak GPU memory in GB."""
    def timed(n: int) -> float:
        batches = [batch() for _ in range(n)]
        _sync()
        start = time.perf_counter()
        for b in batches:
            step(b)
        _sync()
        return (time.perf_counter() - start) / n

    if platform.on_gpu():
        torch.cuda.reset_peak_memory_stats()
    timed(args.warmup)
    times = [timed(args.steps) for _ in range(args.rounds)]
    return times, _peak_gb()


def _ours(config, engine_name: str, batch, args) -> tuple[list[float], float | None]:
    torch.manual_seed(0)
    model = build_encoder_model(config.model, transformer_overrides=megatron_transformer_overrides(config))
    engine = build_engine(engine_name, model.to(platform.device()), config)
    return _timed_rounds(lambda step: engine.train_step([MicroBatch(b, None) for b in step], lr=1e-4), batch, args)


def _hf(config, batch, args) -> tuple[list[float], float | None]:
    device = platform.device()
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

    return _timed_rounds(step, batch, args)


def _release() -> None:
    gc.collect()
    if platform.on_gpu():
        torch.cuda.empty_cache()


def measure(args, model_preset: str, seq_length: int, precision: str) -> dict:
    """One row: our engine, then the baseline, on batches from the same generator seed."""
    device = platform.device()
    config = run_config(args, model_preset, seq_length, precision)
    engine_name = platform.resolve_engine("auto")
    masking = MaskingConfig(mask_ratio=0.4)
    micro, count = recipe_shape(args, model_preset)

    def batches():
        gen = torch.Generator(device=device).manual_seed(0)

        def step_batches():  # one optimizer step: `count` micro-batches
            return [apply_mlm(torch.randint(4, args.vocab_size, (micro, seq_length), generator=gen, device=device),
                              config=masking, mask_id=MASK_ID, vocab_size=args.vocab_size, special_ids=SPECIAL_IDS,
                              generator=gen) for _ in range(count)]
        return step_batches

    ours_times, ours_peak = _ours(config, engine_name, batches(), args)
    _release()
    tokens = count * micro * seq_length  # per optimizer step
    step_time = statistics.median(ours_times)
    variants = {}
    for name in args.variants:
        times, peak_mem = _ours(run_config(args, model_preset, seq_length, precision, name), engine_name, batches(), args)
        _release()
        variants[name] = {"change": VARIANTS[name][1], "tokens_per_s": tokens / statistics.median(times),
                          "peak_mem_gb": peak_mem, "default_speedup": statistics.median(times) / step_time,
                          "rounds_s": times}
    hf_times, hf_peak = _hf(config, batches(), args)
    _release()
    hf_step_time = statistics.median(hf_times)
    (phase,) = resolve_phases(config.phases, config.training.train_iters)
    share = lm_head_share(phase, scored_only=config.training.lm_head_scored_only)
    achieved = tokens / step_time * flops_per_token(config.model, seq_length, lm_head_share=share)
    peak = peak_flops_per_device(platform.device_name()) if platform.on_gpu() else None
    return {
        "model": model_preset, "seq_length": seq_length, "precision": precision,
        "micro_batch_size": micro, "micro_batches_per_step": count, "tokens_per_step": tokens,
        "micro_batch_time_s": step_time / count, "hf_micro_batch_time_s": hf_step_time / count,
        "parameters": parameter_count(config.model),
        "engine": engine_name, "attention_backend": config.model.attention_backend,
        "tokens_per_s": tokens / step_time, "tflops": achieved / 1e12, "mfu": achieved / peak if peak else None,
        "peak_mem_gb": ours_peak, "step_time_s": step_time,
        "hf_tokens_per_s": tokens / hf_step_time, "hf_peak_mem_gb": hf_peak, "hf_step_time_s": hf_step_time,
        "speedup_vs_hf": hf_step_time / step_time, "variants": variants,
        "rounds_s": {"megatron_ext": ours_times, "hf": hf_times},
    }


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
    add("--micro-batches", type=int, default=None,
        help="micro-batches per optimizer step (gradient accumulation, both sides); default: one rank's "
             "share of the recipe's global batch at --data-parallel-size ranks")
    add("--data-parallel-size", type=int, default=64,
        help="the world the recipe shape is taken at (default 64: 8 nodes of 8 GPUs)")
    add("--steps", type=int, default=5, help="timed steps per round and side")
    add("--rounds", type=int, default=3)
    add("--warmup", type=int, default=2, help="untimed steps per side first")
    add("--hf-compile", action="store_true", help="torch.compile the Hugging Face model")
    add("--variants", nargs="*", choices=sorted(VARIANTS), default=["full_lm_head"],
        help="optimisation steps to time against the default configuration, same batches: "
        + "; ".join(f"{k}: {v[1]}" for k, v in VARIANTS.items()))
    add("--output", type=Path, default=None, help="default: benchmarks/results/throughput_<device>.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cpu_tiny:
        args.presets, args.seq_lengths, args.precisions = ["tiny"], [128], ["fp32"]
        args.vocab_size = min(args.vocab_size, 8192)
    gpu_only = [v for v in args.variants if v in GPU_ONLY_VARIANTS]
    if gpu_only and not platform.on_gpu():
        parser.error(f"--variants {' '.join(gpu_only)} need CUDA (Megatron's activation recomputation)")
    if "fp8" in args.precisions:
        platform.check_run_supported(fp8_recipe=args.fp8_recipe, recompute_granularity=None)

    platform.init_process_group_and_model_parallel(seed=1234)
    device_name = platform.device_name() if platform.on_gpu() else f"cpu{torch.get_num_threads()}"
    print(f"{device_name}; FLOPs/token = {MFU_CONVENTION}; MFU against the dense bf16 peak", flush=True)
    rows = []
    try:
        for model_preset in args.presets:
            for seq_length in args.seq_lengths:
                for precision in args.precisions:
                    row = measure(args, model_preset, seq_length, precision)
                    rows.append(row)
                    mfu = "" if row["mfu"] is None else f" | MFU {100 * row['mfu']:.1f}%"
                    mem = "" if row["peak_mem_gb"] is None else f" | {row['peak_mem_gb']:.1f} GB"
                    print(f"{model_preset} seq {seq_length} {precision}, {row['micro_batches_per_step']} x micro-batch "
                          f"{row['micro_batch_size']}/step: {row['tokens_per_s']:,.0f} tok/s | "
                          f"{1e3 * row['step_time_s']:.0f} ms/step, {1e3 * row['micro_batch_time_s']:.0f} ms/micro-batch | "
                          f"{row['tflops']:.1f} TFLOP/s{mfu}{mem} | HF {row['hf_tokens_per_s']:,.0f} tok/s | "
                          f"x{row['speedup_vs_hf']:.2f} vs HF", flush=True)
                    for name, v in row["variants"].items():
                        print(f"    default vs {name} ({v['change']}): x{v['default_speedup']:.2f} "
                              f"({v['tokens_per_s']:,.0f} tok/s)", flush=True)
    finally:
        platform.destroy_process_group_and_model_parallel()
    result = {"benchmark": "throughput", "device": device_name, "flops_convention": MFU_CONVENTION,
              "mfu_peak": "dense bf16 peak of the device (also for fp8 rows)", "versions": platform.software_versions(),
              "settings": {k: v for k, v in vars(args).items() if k != "output"}, "rows": rows}
    slug = re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_").lower()
    out = args.output or REPO / "benchmarks" / "results" / f"throughput_{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
