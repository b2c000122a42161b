"""What isolating documents costs the local spec's attention: ms per forward + backward of the core
attention (``model.attention.SDPAttention``) over packed rows of real documents, three ways.

    .venv/bin/python -m benchmarks.document_attention [--micro-batch-size 8] [--seq-length 512] [--repeats 10]

- ``cross_document``: the paper's setting (``data.reset_attention_mask: false``), one SDPA call
  with no mask;
- ``per_document``: what ``data.reset_attention_mask: true`` runs on the local spec, the documents
  of the rows gathered into padded batches by length (``per_document_attention``), no ``s x s`` mask;
- ``explicit_mask``: the route it replaced (the removed ``model.document_mask``), one SDPA call
  with a ``[b, 1, s, s]`` boolean mask built per micro-batch.

The rows are real news text (gensim's Lee corpus) in the demo tokenizer's ids, documents joined by
its EOD as GPTDataset packs them; query heads and groups are the demo recipe's (12 of 64 channels,
4 KV groups). The three take turns in each repeat; medians reported, with each isolated route's
speed as a ratio to the explicit mask (> 1: faster). Times are this process's CPU time
(``time.process_time``) on ``--threads`` threads, 1 by default: on a shared machine under load,
torch's threads spin at each barrier while one of them waits for a core, which charges a route of
many calls (the per-document one) for other processes' load; one thread measures the work itself.
Before timing, the two isolated routes are
checked equal (outputs and input gradients). The mask's construction is included in its time, as
the per-document route's gathering is in its own. Writes ``benchmarks/results/document_attention_<device>.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from megatron_ext import assets
from megatron_ext.model.attention import attention_pattern, explicit_document_mask, per_document_attention
from megatron_ext.tokenizer import TokenizerConfig, build_tokenizer

from benchmarks.results_file import write_record


def packed_rows(tokenizer_model: Path, micro_batch_size: int, seq_length: int) -> tuple[torch.Tensor, int]:
    """Real news documents + EOD, packed end to end into ``[micro_batch_size, seq_length]``; and the EOD id."""
    if not tokenizer_model.exists():
        raise SystemExit(f"--tokenizer {tokenizer_model}: not found; run `make demo-data` for the demo tokenizer")
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_model=str(tokenizer_model)))
    news = assets.member("gensim", "gensim/test/test_data/lee_background.cor")
    texts = [line for line in news.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    ids = [i for document in tokenizer.tokenize_batch(texts) for i in (*document, tokenizer.eod)]
    need = micro_batch_size * seq_length
    ids = (ids * (need // len(ids) + 1))[:need]
    return torch.tensor(ids).view(micro_batch_size, seq_length), tokenizer.eod


def routes(ids: torch.Tensor, eod: int, *, causal: bool, heads: int, groups: int, head_dim: int):
    """The three attentions as closures over the same q, k, v (each returns the output)."""
    b, s = ids.shape
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(s, b, heads, head_dim, generator=generator, requires_grad=True)
    k, v = (torch.randn(s, b, groups, head_dim, generator=generator, requires_grad=True) for _ in range(2))

    def sdpa(mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
        out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), attn_mask=mask,
                                             is_causal=is_causal, enable_gqa=True)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def per_document() -> torch.Tensor:
        pattern = attention_pattern(causal=causal, document_ends=ids == eod)
        return per_document_attention(q, k, v, pattern.documents, causal=causal, enable_gqa=True)

    return (q, k, v), {
        "cross_document": lambda: sdpa(None, causal),
        "per_document": per_document,
        "explicit_mask": lambda: sdpa(~explicit_document_mask(ids == eod, causal=causal), False),
    }


def _forward_backward(route, inputs) -> float:
    for t in inputs:
        t.grad = None
    start = time.process_time()
    route().sum().backward()
    return time.process_time() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10, help="timed forward + backward passes per route")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (see the module docstring)")
    parser.add_argument("--tokenizer", type=Path, default=assets.data_dir() / "demo_tokenizer")
    parser.add_argument("--output", type=Path, help="JSON path (default: results/document_attention_<device>.json)")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    ids, eod = packed_rows(args.tokenizer, args.micro_batch_size, args.seq_length)
    documents = int((ids[:, :-1] == eod).sum()) + ids.shape[0]
    name_device = f"cpu{os.cpu_count()}"
    print(f"core attention fwd+bwd, {args.micro_batch_size} x {args.seq_length} tokens, {documents} documents "
          f"(mean {ids.numel() / documents:.0f} tokens), {args.heads} heads / {args.groups} groups x {args.head_dim}, "
          f"{name_device}, {torch.get_num_threads()} threads, CPU ms, median of {args.repeats}:")
    record = {"device": name_device, "torch_threads": torch.get_num_threads(), "measure": "CPU ms (time.process_time)",
              "shape": [args.micro_batch_size, args.seq_length], "heads": args.heads, "groups": args.groups,
              "head_dim": args.head_dim, "documents": documents, "repeats": args.repeats, "patterns": {}}
    for causal in (False, True):
        inputs, timed = routes(ids, eod, causal=causal, heads=args.heads, groups=args.groups, head_dim=args.head_dim)
        grads = {}
        for name in ("per_document", "explicit_mask"):  # the two isolated routes compute the same
            out = timed[name]()
            grads[name] = (out, *torch.autograd.grad(out.sum(), inputs))
        for got, want in zip(grads["per_document"], grads["explicit_mask"]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        for route in timed.values():  # warm-up
            _forward_backward(route, inputs)
        samples: dict[str, list[float]] = {name: [] for name in timed}
        for _ in range(args.repeats):
            for name, route in timed.items():
                samples[name].append(_forward_backward(route, inputs) * 1e3)
        rows = {name: {"ms": round(statistics.median(values), 2)} for name, values in samples.items()}
        for name in ("per_document", "cross_document"):
            rows[name]["speedup_vs_explicit_mask"] = round(rows["explicit_mask"]["ms"] / rows[name]["ms"], 3)
        pattern = "causal" if causal else "bidirectional"
        record["patterns"][pattern] = rows
        for name, row in rows.items():
            ratio = f"   x{row['speedup_vs_explicit_mask']:.2f} of the explicit mask's speed" if name != "explicit_mask" else ""
            print(f"  {pattern:<13} {name:<15} {row['ms']:9.2f} ms{ratio}")
    write_record("document_attention", name_device, record, args.output)
    return record


if __name__ == "__main__":
    main()
