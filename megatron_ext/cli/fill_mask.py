"""Fill in masked words with an exported encoder, using plain Hugging Face transformers.

    python tools/fill_mask.py runs/demo/hf_eurobert "The capital of France is [MASK]."

``[MASK]`` in a sentence stands for the model's own mask token (``<mask>``, ``<|mask|>`` ...).
The model directory is loaded with ``pipeline("fill-mask")`` only, which shows that the export
works without this project's code.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_ext.cli.entry import ArgumentParser, entry_point
from megatron_ext.config_loading import UserError

DEFAULT_SENTENCES = (
    "The prime minister said the [MASK] would be announced next week.",
    "He was born in the [MASK] of Paris.",
    "Police said the man had been [MASK] on Tuesday.",
)


def _with_mask(sentence: str, mask: str, tokenizer) -> str:
    """Put the mask token in place of ``[MASK]``.

    Byte-level BPE tokenizers (GPT-2 style, ours) fold the space before a word into the word's
    token; their mask token does not, so " <mask>" would leave a stray space token before the
    mask. There the preceding space goes into the mask.
    """
    spaced = tokenizer(f"a {mask}", add_special_tokens=False)["input_ids"]
    glued = tokenizer(f"a{mask}", add_special_tokens=False)["input_ids"]
    if len(spaced) > len(glued):
        return sentence.replace(" [MASK]", mask, 1).replace("[MASK]", mask, 1)
    return sentence.replace("[MASK]", mask, 1)


@entry_point("fill_mask.py")
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", help="a Hugging Face masked-LM directory (e.g. tools/export_hf_checkpoint.py output)")
    parser.add_argument("sentences", nargs="*", default=list(DEFAULT_SENTENCES), help="sentences with [MASK]")
    parser.add_argument("--top-k", type=int, default=5)
    args = parser.parse_args(argv)
    for sentence in args.sentences:
        if "[MASK]" not in sentence:
            raise UserError(f"{sentence!r} has no [MASK]")
    if not os.path.isdir(args.model_dir) and args.model_dir.startswith(("/", ".", "~")):
        raise UserError(f"model_dir {args.model_dir}: no such directory (expected a Hugging Face masked-LM "
                        "directory, e.g. tools/export_hf_checkpoint.py's output)")
    from transformers import pipeline

    try:
        fill = pipeline("fill-mask", model=args.model_dir, device="cpu")
    except OSError as error:  # transformers' "not a local folder and not a valid model identifier"
        raise UserError(f"model_dir {args.model_dir}: cannot load a fill-mask model "
                        f"({str(error).strip().splitlines()[0]})") from error
    mask = fill.tokenizer.mask_token
    for sentence in args.sentences:
        predictions = fill(_with_mask(sentence, mask, fill.tokenizer), top_k=args.top_k)
        ranked = ", ".join(f"{p['token_str'].strip()!r} {p['score']:.2f}" for p in predictions)
        print(f"{sentence}\n    -> {ranked}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
