"""From what model size FP8 pays: one transformer layer's four GEMMs, bf16 against FP8, per size.

    .venv/bin/python -m benchmarks.fp8_gemm                      # GPU with Transformer Engine
    .venv/bin/python -m benchmarks.fp8_gemm --cpu-tiny           # CI: the same code, torch bf16 linears, tiny

FP8 was 0.82x of bf16 at 1B on an H100 (2026-11-24): at hidden 1,728 the GEMMs may be too small
for FP8's cast, amax and transpose work to pay. This times, for each size, the forward and backward
of a layer's GEMMs as Transformer Engine runs them in the TE spec (``te.pytorch.Linear``, bf16
parameters): QKV (hidden -> query heads + 2 KV groups), the attention output projection, FC1
(hidden -> 2 x FFN, SwiGLU) and FC2 (FFN -> hidden), on ``--tokens`` tokens (the 1B recipe's
micro-batch: 9 x 2,048). Sizes: the paper's three (210M, 610M, 1B) and three larger Llama-shaped
layers, to see where the ratio crosses 1. Precisions side by side, as ratios to bf16: bf16, FP8
with delayed scaling, FP8 with current (tensorwise) scaling. Attention, norms and the LM head are
left out on purpose: this isolates what FP8 changes. Times are CUDA-event medians over
``--steps`` after ``--warmup``, the steps alternating a step's first and second micro-batch (TE
casts the FP8 weights on the first only). Writes ``benchmarks/results/fp8_gemm_<device>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from pathlib import Path

import torch

from megatron_ext import hardware
from megatron_ext.config_loading import UserError
from megatron_ext.model.config import PRESETS

from benchmarks.results_file import write_record


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerShape:
    """The GEMM dimensions of one transformer layer."""

    name: str
    hidden: int
    ffn: int
    heads: int
    groups: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def gemms(self) -> list[tuple[str, int, int]]:
        """``(name, in_features, out_features)`` of the layer's four linears."""
        qkv = (self.heads + 2 * self.groups) * self.head_dim
        return [("qkv", self.hidden, qkv), ("proj", self.heads * self.head_dim, self.hidden),
                ("fc1", self.hidden, 2 * self.ffn), ("fc2", self.ffn, self.hidden)]

    def flops(self, tokens: int) -> float:
        """Forward + backward (input and weight gradients): 3 GEMMs of 2 x tokens x in x out each."""
        return sum(3 * 2 * tokens * fan_in * fan_out for _, fan_in, fan_out in self.gemms())


def _preset_shape(name: str) -> LayerShape:
    config = PRESETS[name]
    return LayerShape(name=name, hidden=config.hidden_size, ffn=config.ffn_hidden_size,
                      heads=config.num_attention_heads, groups=config.num_query_groups)


SHAPES = [_preset_shape(name) for name in ("210m", "610m", "1b")] + [
    LayerShape(name="hidden 2048 (Llama-3.2 1B)", hidden=2048, ffn=8192, heads=32, groups=8),
    LayerShape(name="hidden 4096 (Llama-3 8B)", hidden=4096, ffn=14336, heads=32, groups=8),
    LayerShape(name="hidden 8192 (Llama-3 70B)", hidden=8192, ffn=28672, heads=64, groups=8),
]
TINY_SHAPES = [LayerShape(name="tiny", hidden=128, ffn=384, heads=4, groups=2),
               LayerShape(name="tiny x2", hidden=256, ffn=768, heads=4, groups=2)]
PRECISIONS = ("bf16", "fp8_delayed", "fp8_tensorwise")


def _fp8_context(precision: str):
    """Transformer Engine's autocast for ``precision`` (Megatron's recipes for these names)."""
    import contextlib

    if precision == "bf16":
        return contextlib.nullcontext()
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    if precision == "fp8_delayed":  # Megatron's TEDelayedScaling at its defaults (history 1, most recent)
        fp8_recipe = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=1,
                                           amax_compute_algo="most_recent")
    else:
        fp8_recipe = recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID)
    return te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe)


def _layers(shape: LayerShape, device: torch.device, *, cpu_tiny: bool) -> list[torch.nn.Module]:
    if cpu_tiny:
        return [torch.nn.Linear(i, o, bias=False, device=device, dtype=torch.bfloat16) for _, i, o in shape.gemms()]
    import transformer_engine.pytorch as te

    return [te.Linear(i, o, bias=False, params_dtype=torch.bfloat16, device=device) for _, i, o in shape.gemms()]


def time_layer(shape: LayerShape, precision: str, *, tokens: int, warmup: int, steps: int, cpu_tiny: bool) -> float:
    """Median seconds of one forward + backward through the layer's four GEMMs."""
    device = torch.device("cpu" if cpu_tiny else "cuda")
    dtype = torch.bfloat16
    layers = _layers(shape, device, cpu_tiny=cpu_tiny)
    inputs = [torch.randn(tokens, fan_in, device=device, dtype=dtype, requires_grad=True)
              for _, fan_in, _ in shape.gemms()]
    grads = [torch.randn(tokens, fan_out, device=device, dtype=dtype) for _, _, fan_out in shape.gemms()]

    def step(first_micro_batch: bool) -> None:
        # TE casts a weight to FP8 on a step's first micro-batch and reuses it (Megatron's schedules
        # pass is_first_microbatch): timed as the 1B recipe's 2 micro-batches per step.
        kwargs = {} if cpu_tiny else {"is_first_microbatch": first_micro_batch}
        with _fp8_context(precision):
            outputs = [layer(x, **kwargs) for layer, x in zip(layers, inputs)]
        torch.autograd.backward(outputs, grads)

    samples = []
    for i in range(warmup + steps):
        if cpu_tiny:
            start = time.perf_counter()
            step(i % 2 == 0)
            elapsed = time.perf_counter() - start
        else:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step(i % 2 == 0)
            end.record()
            end.synchronize()
            elapsed = begin.elapsed_time(end) / 1e3
        if i >= warmup:
            samples.append(elapsed)
    return statistics.median(samples)


def unavailable(precision: str, *, cpu_tiny: bool) -> str | None:
    """Why ``precision`` cannot be timed here, or None (the trainer's own FP8 check on a GPU)."""
    if precision == "bf16":
        return None
    if cpu_tiny:
        return "FP8 needs a CUDA GPU"
    try:
        hardware.check_run_supported(fp8_recipe="delayed", recompute_granularity=None)
    except UserError as err:
        return str(err)
    return None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=9 * 2048, help="rows of each GEMM (micro-batch x sequence)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed passes (even: whole steps of 2)")
    parser.add_argument("--cpu-tiny", action="store_true", help="torch bf16 linears at tiny sizes on CPU (CI)")
    parser.add_argument("--output", type=Path, help="JSON path (default: results/fp8_gemm_<device>.json)")
    args = parser.parse_args(argv)
    if not args.cpu_tiny and not hardware.on_gpu():
        parser.error("needs a CUDA GPU (or --cpu-tiny)")
    if not args.cpu_tiny and not hardware.transformer_engine_available():
        parser.error("needs Transformer Engine (the layers are te.pytorch.Linear)")
    tokens = 64 if args.cpu_tiny else args.tokens
    device = f"cpu{os.cpu_count()}" if args.cpu_tiny else torch.cuda.get_device_name()
    rows = []
    print(f"one layer's 4 GEMMs, forward + backward, {tokens:,} tokens, on {device}; ratio = bf16 time / this time")
    for shape in TINY_SHAPES if args.cpu_tiny else SHAPES:
        row = {"shape": dataclasses.asdict(shape), "tflop": round(shape.flops(tokens) / 1e12, 4), "sides": {}}
        for precision in PRECISIONS:
            reason = unavailable(precision, cpu_tiny=args.cpu_tiny)
            if reason is not None:
                row["sides"][precision] = {"skipped": reason}
                continue
            seconds = time_layer(shape, precision, tokens=tokens, warmup=args.warmup, steps=args.steps,
                                 cpu_tiny=args.cpu_tiny)
            row["sides"][precision] = {"ms": round(seconds * 1e3, 3),
                                       "tflops": round(shape.flops(tokens) / seconds / 1e12, 1)}
        base = row["sides"]["bf16"]["ms"]
        for side in row["sides"].values():
            if "ms" in side:
                side["speedup_vs_bf16"] = round(base / side["ms"], 3)
        rows.append(row)
        print(f"  {shape.name:<28} " + "  ".join(
            f"{p} {s['ms']:.2f} ms ({s['tflops']} TFLOP/s, x{s['speedup_vs_bf16']:.2f})" if "ms" in s
            else f"{p} skipped ({s['skipped']})" for p, s in row["sides"].items()), flush=True)
    record = {"device": device, "tokens": tokens, "warmup": args.warmup, "steps": args.steps, "rows": rows}
    crossing = next((r["shape"]["name"] for r in rows
                     if r["sides"].get("fp8_delayed", {}).get("speedup_vs_bf16", 0) >= 1.2), None)
    record["fp8_delayed_pays_from"] = crossing  # the first size where FP8 pays (>= 1.2x bf16), or None
    print(f"FP8 (delayed) >= 1.2x bf16 from: {crossing or 'no size measured'}")
    write_record("fp8_gemm", device, record, args.output)
    return record


if __name__ == "__main__":
    main()
