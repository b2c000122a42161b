"""Convert a Hugging Face decoder or EuroBERT encoder into a Megatron checkpoint for continued
pretraining (CPT).

    python tools/import_hf_checkpoint.py --hf-model path/to/SmolLM2-135M --output-dir ckpt/smollm2
    python tools/import_hf_checkpoint.py --hf-model Qwen/Qwen3-0.6B --output-dir ckpt/qwen3 \
        --tensor-model-parallel-size 2 --seq-length 2048
    python tools/import_hf_checkpoint.py --hf-model path/to/EuroBERT-210m --output-dir ckpt/eb210m \
        --seq-length 2048

Supported: Llama-layout causal LMs with model_type llama (Llama, SmolLM), mistral, qwen2 (q/k/v
biases) and qwen3 (q/k norm, explicit head_dim), and EuroBertForMaskedLM encoders (eurobert,
e.g. a directory written by tools/export_hf_checkpoint.py or EuroBERT's released models).
Anything else (RoPE scaling, sliding windows shorter than --seq-length, MoE, biases elsewhere,
other activations) is refused by name.

Writes to --output-dir: the checkpoint (iter_0000000, loadable at any tensor-parallel size), the
tokenizer with a mask token and recipe_model.yaml, the model/tokenizer/checkpoint sections of a
CPT recipe. Mask token: an encoder keeps the one it was trained with (config.json mask_token_id);
a decoder keeps the tokenizer's if present, else Llama-3's <|reserved_special_token_0|> if in the
vocab, else a new <|mask|> is added (its embedding starts as the mean of the embeddings).

    # my_cpt.yaml
    base: ckpt/smollm2/recipe_model.yaml
    data: {...}
    phases: [{objective: mlm, mask_ratio: 0.4, share: 1.0}]
    ...
    python pretrain_encoder.py --config my_cpt.yaml --save ckpt/smollm2_cpt
"""

from __future__ import annotations

import argparse
import sys

from megatron_ext.cli.entry import ArgumentParser, entry_point



def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--hf-model", required=True,
        help="model directory (config.json, weights, tokenizer) or hub id (only where the hub is reachable)")
    add("--output-dir", required=True, help="directory to create (checkpoint, tokenizer/, recipe_model.yaml)")
    add("--tokenizer", default=None, help="tokenizer directory or hub id (default: --hf-model)")
    add("--tensor-model-parallel-size", type=int, default=1,
        help="largest TP you will train with: the vocab is padded to a multiple of 128 x TP and the "
             "head counts are checked (the checkpoint itself loads at any TP)")
    add("--seq-length", type=int, default=None,
        help="model.seq_length, the longest input (default: the model's max_position_embeddings)")
    add("--mask-token", default=None,
        help="decoders: mask token to use, existing or new (default: the tokenizer's, else "
             "<|reserved_special_token_0|> if present, else a new <|mask|>); encoders keep their "
             "trained one (config.json mask_token_id)")
    add("--overwrite", action="store_true", help="replace a non-empty --output-dir")
    return parser


@entry_point("import_hf_checkpoint.py")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_ext.hf import importer

    print(f"loading {args.hf_model}", flush=True)
    config = importer.load_hf_config(args.hf_model)
    importer.check_architecture(config, args.seq_length)  # before loading any weights
    tokenizer = importer.load_hf_tokenizer(args.tokenizer or args.hf_model,
                                           flag="--tokenizer" if args.tokenizer else "--hf-model")
    model = importer.load_hf_model(args.hf_model)
    importer.import_hf_model(
        model, tokenizer, args.output_dir, tensor_parallel_size=args.tensor_model_parallel_size,
        seq_length=args.seq_length, mask_token=args.mask_token, overwrite=args.overwrite,
        source=args.hf_model, log=lambda line: print(line, flush=True),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
