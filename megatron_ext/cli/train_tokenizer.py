"""Train a byte-level BPE tokenizer for encoders (bos, eos, pad and mask tokens) on a corpus.

    python tools/train_tokenizer.py --input corpus.jsonl.gz --output-dir tokenizers/bpe8k --vocab-size 8192

Writes a Hugging Face tokenizer directory: ``tokenizer.json`` plus ``tokenizer_config.json`` and
``special_tokens_map.json``, so ``transformers.AutoTokenizer.from_pretrained(DIR)`` loads it with
its special tokens set, and ``--tokenizer-model DIR`` works in this project and in Megatron-Core.
Special tokens take the first ids: ``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<mask>`` 3. Encoding with
special tokens gives ``<s> text </s>``. Same input and flags give a byte-identical tokenizer.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from megatron_ext.config_loading import UserError
from megatron_ext.data.readers import INPUT_FORMATS, decode_record, detect_format, expand_inputs, iter_records
from megatron_ext.cli.entry import ArgumentParser, entry_point
from megatron_ext.fileio import publish_dir, staged_dir
from megatron_ext.progress import progress

BOS, PAD, EOS, MASK = "<s>", "<pad>", "</s>", "<mask>"
SPECIAL_TOKENS = (BOS, PAD, EOS, MASK)  # this order fixes their ids: 0, 1, 2, 3


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--input", nargs="+", required=True, help="JSONL(.gz) or plain-text files (one document per line)")
    add("--input-format", choices=INPUT_FORMATS, default="auto", help="default: from the file name")
    add("--json-keys", nargs="+", default=["text"], help="JSON fields holding the text")
    add("--output-dir", required=True, help="tokenizer directory to create")
    add("--vocab-size", type=int, default=8192, help="final vocabulary size, special tokens included")
    add("--min-frequency", type=int, default=2, help="minimum count of a pair to be merged")
    add("--overwrite", action="store_true", help="replace a non-empty --output-dir")
    add("--no-progress", action="store_true", help="no progress report (a bar on a terminal, lines otherwise)")
    return parser


def iter_documents(
    inputs: Sequence[str], *, input_format: str, json_keys: Sequence[str], counter: list[int]
) -> Iterator[str]:
    """Non-empty texts of every input in order (each JSON key of a record is one text); ``counter[0]``
    counts them."""
    for path in expand_inputs(inputs):
        for record in iter_records(path, fmt=input_format, json_keys=json_keys):
            for text in decode_record(record, json_keys).values():
                if text.strip():
                    counter[0] += 1
                    yield text


def train(texts: Iterator[str], *, vocab_size: int, min_frequency: int):
    """A trained byte-level BPE ``tokenizers.Tokenizer`` with :data:`SPECIAL_TOKENS`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    # GPT-2/Llama-3 style: no normalizer, bytes as the alphabet, so any text encodes without <unk>.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        # Its progress bars vanish when stderr is not a terminal (batch-job logs); main reports
        # progress over the documents instead: a bar on a terminal, lines in a log file.
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    ids = {tok: tokenizer.token_to_id(tok) for tok in (BOS, EOS)}
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}", pair=f"{BOS} $A {EOS} $B:1 {EOS}:1", special_tokens=list(ids.items())
    )
    return tokenizer


def write_tokenizer_dir(tokenizer, directory: Path) -> None:
    """tokenizer.json + the transformers config files naming the special-token roles."""
    tokenizer.save(str(directory / "tokenizer.json"))
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "mask_token": MASK}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **special}
    for name, content in (("tokenizer_config.json", config), ("special_tokens_map.json", special)):
        (directory / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")


@entry_point("train_tokenizer.py")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    output = Path(args.output_dir).resolve()
    if output.exists() and not output.is_dir():
        raise UserError(f"--output-dir {str(output)!r} exists and is not a directory")
    if output.is_dir() and any(output.iterdir()) and not args.overwrite:
        raise UserError(f"--output-dir {str(output)!r} is not empty; pass --overwrite to replace it")
    minimum = len(SPECIAL_TOKENS) + 256  # specials + the byte alphabet
    if args.vocab_size <= minimum:
        raise UserError(f"--vocab-size {args.vocab_size} must exceed {minimum} (special tokens + 256 bytes)")
    for path in expand_inputs(args.input):  # every input usable, before reading any
        detect_format(path, args.input_format)

    start = time.perf_counter()
    n_docs = [0]
    texts = iter_documents(args.input, input_format=args.input_format, json_keys=args.json_keys,
                           counter=n_docs)
    # The number of documents is unknown before reading them: without a terminal, a line every
    # 5 minutes, and the count, time and rate once all are read (the merges come after).
    with progress(texts, desc="reading documents", unit="doc", enabled=not args.no_progress) as bar:
        tokenizer = train(bar, vocab_size=args.vocab_size, min_frequency=args.min_frequency)
    if n_docs[0] == 0:
        raise UserError(f"--input {args.input}: no non-empty text under --json-keys {args.json_keys}")

    # Published whole (fileio's one rule): readers never see a half-written tokenizer, and a
    # crash leaves only a hidden temporary directory. A non-empty --output-dir without
    # --overwrite was refused above, before the minutes of training.
    with staged_dir(output) as tmp:
        write_tokenizer_dir(tokenizer, tmp)
        publish_dir(tmp, output, overwrite=args.overwrite, identical_ok=True)

    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    print(
        f"wrote {output}: vocab size {tokenizer.get_vocab_size()}, special token ids {ids}, "
        f"{n_docs[0]} documents read, {time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
