"""Training-step throughput of the encoder on Megatron-Core vs a plain Hugging Face loop, same shape.

    .venv/bin/python benchmarks/train_step.py [--preset tiny] [--seq-length 256] [--micro-batch-size 8]

Both sides train the same architecture (EuroBERT = Llama-like encoder, untied head) with MLM-40 %
on the same batches (random token ids over the tokenizer-free vocab of the preset; the objective
and shapes are what matters for speed), AdamW, grad clipping, fp32 on CPU / bf16 autocast on GPU:
- megatron_ext: ``build_encoder_model`` + ``apply_mlm`` + the portable training engine's step
  (gradient reduction, clipping, AdamW: ``megatron_ext.training.engines.PortableEngine``);
- Hugging Face: ``transformers.EuroBertForMaskedLM`` (SDPA attention) with its own loss.
Steps alternate between the two in rounds, so machine noise hits both alike. Writes
``benchmarks/results/train_step_<device>.json`` with ``ratio`` = ours / HF tokens per second.
"""

from __future__ import annotations

import argparse
import json
import platform as host
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from megatron_ext import platform  # noqa: E402
from megatron_ext.model import build_encoder_model, parameter_count, preset  # noqa: E402
from megatron_ext.objectives import MaskingConfig, apply_mlm  # noqa: E402
from megatron_ext.training.config import OptimizerConfig  # noqa: E402
from megatron_ext.training.engines import MicroBatch, PortableEngine  # noqa: E402


def hf_model(config):
    from transformers import EuroBertConfig, EuroBertForMaskedLM

    hf_config = EuroBertConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups, max_position_embeddings=config.seq_length,
        rope_theta=config.rotary_base, rms_norm_eps=config.norm_epsilon, tie_word_embeddings=config.tie_embeddings,
        mask_token_id=3, pad_token_id=1, bos_token_id=0, eos_token_id=2, attn_implementation="sdpa",
    )
    return EuroBertForMaskedLM(hf_config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round and side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)

    platform.init_process_group_and_model_parallel(seed=1234)
    device = platform.device()
    bf16 = platform.on_gpu()
    config = preset(args.preset, vocab_size=args.vocab_size, seq_length=args.seq_length)
    torch.manual_seed(0)
    ours = build_encoder_model(config).to(device)
    hf = hf_model(config).to(device)
    opt_config = OptimizerConfig()
    engine = PortableEngine(ours, opt_config, bf16=bf16)
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)
    masking = MaskingConfig(mask_ratio=0.4)
    gen = torch.Generator(device=device).manual_seed(0)
    specials = (0, 1, 2, 3)

    def batch():
        tokens = torch.randint(4, args.vocab_size, (args.micro_batch_size, args.seq_length), generator=gen, device=device)
        return apply_mlm(tokens, config=masking, mask_id=3, vocab_size=args.vocab_size, special_ids=specials, generator=gen)

    def step_ours(b):
        engine.train_step([MicroBatch(b, None)], lr=1e-4)

    def step_hf(b):
        hf_opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = hf(input_ids=b.input_ids, labels=b.labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), opt_config.clip_grad)
        hf_opt.step()

    def timed(step_fn, batches):
        if platform.on_gpu():
            torch.cuda.synchronize()
        start = time.perf_counter()
        for b in batches:
            step_fn(b)
        if platform.on_gpu():
            torch.cuda.synchronize()
        return len(batches) * args.micro_batch_size * args.seq_length / (time.perf_counter() - start)

    warm = [batch() for _ in range(2)]
    timed(step_ours, warm)
    timed(step_hf, warm)
    ours_rates, hf_rates = [], []
    for _ in range(args.rounds):
        batches = [batch() for _ in range(args.steps)]
        ours_rates.append(timed(step_ours, batches))
        hf_rates.append(timed(step_hf, batches))
    ours_tps, hf_tps = statistics.median(ours_rates), statistics.median(hf_rates)
    device_name = torch.cuda.get_device_name() if platform.on_gpu() else f"cpu{torch.get_num_threads()}"
    result = {
        "benchmark": "train_step",
        "device": device_name,
        "shape": {"preset": args.preset, "vocab_size": args.vocab_size, "seq_length": args.seq_length,
                  "micro_batch_size": args.micro_batch_size, "parameters": parameter_count(config)},
        "objective": "mlm-40%, AdamW, clip 1.0, " + ("bf16 autocast" if bf16 else "fp32"),
        "megatron_ext_tokens_per_s": ours_tps,
        "hf_eurobert_tokens_per_s": hf_tps,
        "ratio": ours_tps / hf_tps,
        "rounds": {"megatron_ext": ours_rates, "hf": hf_rates},
        "versions": {"torch": torch.__version__, "python": host.python_version()},
    }
    print(f"{device_name}: megatron_ext {ours_tps:,.0f} tok/s | HF EuroBERT {hf_tps:,.0f} tok/s | ratio {ours_tps / hf_tps:.2f}")
    out = Path(args.output or REPO / "benchmarks" / "results" / f"train_step_{device_name.replace(' ', '_')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    platform.destroy_process_group_and_model_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
