"""Fill in masked words with an exported encoder, using plain Hugging Face transformers.

    python tools/fill_mask.py runs/demo/hf_eurobert "The capital of France is [MASK]."

``[MASK]`` in a sentence stands for the model's own mask token (``<mask>``, ``<|mask|>`` ...).
The model directory is loaded with plain ``transformers`` only (``pipeline("fill-mask")``), which
shows that the export works without this project's code.

Where the export says its last step trained an objective whose prediction is not at the mask
(``trained_objective`` in ``config.json``: MNTP predicts a masked token from the position before
it), the masked token is read from that position instead, and a line says so; a model whose last
step was causal (CLM) is refused in one line: it predicts next tokens, not masked ones.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_ext.cli.entry import ArgumentParser, configure_logging, entry_point
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
    configure_logging()
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
    trained = getattr(fill.model.config, "trained_objective", None) or {}
    if trained.get("causal"):
        raise UserError(f"model_dir {args.model_dir}: its last step trained {trained['name']}, which predicts the next "
                        "token, not a masked one: not a fill-mask model (export a checkpoint of a masked phase)")
    offset = trained.get("prediction_offset", 0)
    if offset:
        print(f"{trained['name']}: each masked token is read from the output {-offset} position(s) before it, where "
              "this objective predicts it")
    mask = fill.tokenizer.mask_token
    for sentence in args.sentences:
        masked = _with_mask(sentence, mask, fill.tokenizer)
        predictions = fill(masked, top_k=args.top_k) if not offset else _predict_away(fill, masked, offset, args.top_k)
        ranked = ", ".join(f"{p['token_str'].strip()!r} {p['score']:.2f}" for p in predictions)
        print(f"{sentence}\n    -> {ranked}")
    return 0


def _predict_away(fill, text: str, offset: int, top_k: int) -> list[dict]:
    """The pipeline's predictions for the mask of ``text``, read from the output ``offset``
    positions away from it (the pipeline reads the mask's own)."""
    import torch

    inputs = fill.tokenizer(text, return_tensors="pt")
    at = (inputs["input_ids"][0] == fill.tokenizer.mask_token_id).nonzero()[0, 0].item() + offset
    if at < 0:
        raise UserError(f"{text!r}: nothing stands before [MASK], where this model predicts it; put a word first")
    with torch.no_grad():
        probabilities = fill.model(**inputs).logits[0, at].float().softmax(-1)
    scores, ids = probabilities.topk(top_k)
    return [{"token_str": fill.tokenizer.decode([i]), "score": s} for s, i in zip(scores.tolist(), ids.tolist())]


if __name__ == "__main__":
    sys.exit(main())
