"""Export a Megatron checkpoint (pretrain_encoder.py or import_hf_checkpoint.py) to Hugging Face.

    python tools/export_hf_checkpoint.py --checkpoint runs/demo/checkpoints --output-dir hf/demo
    python tools/export_hf_checkpoint.py --checkpoint ckpt/clm/iter_0042000 --output-dir hf/clm \
        --format llama --dtype bfloat16

--format eurobert (default): EuroBertForMaskedLM (transformers >= 5, no remote code), the
tokenizer with its mask token, and sentence-transformers files (mean pooling), so both
AutoModelForMaskedLM.from_pretrained(DIR) and SentenceTransformer(DIR) load it. --format llama
(or mistral, qwen2, qwen3): that causal LM, e.g. for a CLM-phase checkpoint.

The architecture comes from the run config saved with the checkpoint, the tokenizer from its
tokenizer reference (or --tokenizer). The checkpoint is read at tensor-parallel size 1 in this
one process whatever TP it was saved at (Megatron's dist checkpoints reshard on load). The
export is written to a temporary directory and renamed into place; re-exporting the same
model into the same directory changes nothing, a directory holding another model needs --overwrite.
"""

from __future__ import annotations

import argparse
import sys

from megatron_ext.cli.entry import ArgumentParser, entry_point


FORMAT_CHOICES = ("eurobert", "llama", "mistral", "qwen2", "qwen3")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--checkpoint", required=True, help="a checkpoint directory, or a save directory (its newest)")
    add("--output-dir", required=True, help="Hugging Face model directory to write")
    add("--format", choices=FORMAT_CHOICES, default="eurobert",
        help="eurobert: bidirectional encoder (default); llama/mistral/qwen2/qwen3: causal LM")
    add("--dtype", choices=("float32", "bfloat16"), default="float32", help="dtype of the written weights")
    add("--tokenizer", default=None,
        help="HF tokenizer directory (default: the one referenced by the checkpoint)")
    add("--overwrite", action="store_true", help="replace an existing export of a different model")
    return parser


@entry_point("export_hf_checkpoint.py")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_ext.hf import export_checkpoint

    export_checkpoint(args.checkpoint, args.output_dir, hf_format=args.format, dtype=args.dtype,
                      tokenizer=args.tokenizer, overwrite=args.overwrite, log=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
