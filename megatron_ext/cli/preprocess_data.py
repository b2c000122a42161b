"""Tokenize raw corpora into Megatron-Core indexed datasets (``.bin``/``.idx``).

Drop-in for Megatron-LM's ``tools/preprocess_data.py`` where the flags overlap::

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-model path/to/tokenizer_dir --append-eod --workers 8

Also reads JSONL.gz, plain text, Parquet and Hugging Face datasets (see --input-format).
"""

from __future__ import annotations

import argparse
import logging
import sys


from megatron_ext.data.preprocess import PreprocessConfig, preprocess
from megatron_ext.data.readers import INPUT_FORMATS, TEXT_MODES
from megatron_ext.tokenizer import TokenizerConfig
from megatron_ext.cli.entry import ArgumentParser, configure_logging, entry_point


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", nargs="+", required=True,
                       help="input files, globs, directories, HF save_to_disk dirs or hub ids")
    group.add_argument("--input-format", choices=INPUT_FORMATS, default="auto",
                       help="default: inferred from the file name")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="fields to tokenize")
    group.add_argument("--text-mode", choices=TEXT_MODES, default="line",
                       help="plain text: one document per line, per paragraph (lines between blank lines) or per file")
    group.add_argument("--hf-split", default="train", help="split of a Hugging Face dataset")
    group.add_argument("--split-sentences", action="store_true", help="split documents into sentences (nltk Punkt)")
    group.add_argument("--keep-newlines", action="store_true", help="keep newlines between sentences when splitting")
    group.add_argument("--lang", default="english", help="Punkt language for --split-sentences")
    group.add_argument("--skip-invalid-lines", action="store_true",
                       help="skip and count invalid JSON lines instead of stopping at the first")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", default=None,
                       help="HuggingFaceTokenizer, SentencePieceTokenizer or GPT2BPETokenizer; "
                            "inferred from --tokenizer-model / --vocab-file when omitted")
    group.add_argument("--tokenizer-model", default=None, help="HF tokenizer dir / tokenizer.json / hub id, or a .model")
    group.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT-2 BPE merges.txt")
    group.add_argument("--tokenizer-hf-no-include-special-tokens", action="store_true",
                       help="do not let the tokenizer add BOS/CLS-style specials to each text (Megatron flag)")
    group.add_argument("--append-eod", action="store_true", help="append EOD to every document")
    group = parser.add_argument_group("output and runtime")
    group.add_argument("--output-prefix", required=True, help="output path without suffix")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes (output identical for any value)")
    group.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    group.add_argument("--no-progress", action="store_true",
                       help="no progress report (a bar on a terminal, else a line every 10%% or 5 minutes)")
    return parser


def config_from_args(args: argparse.Namespace) -> PreprocessConfig:
    return PreprocessConfig(
        inputs=tuple(args.input),
        output_prefix=args.output_prefix,
        tokenizer=TokenizerConfig(
            tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
            vocab_file=args.vocab_file, merge_file=args.merge_file,
        ),
        json_keys=tuple(args.json_keys),
        input_format=args.input_format,
        text_mode=args.text_mode,
        hf_split=args.hf_split,
        workers=args.workers,
        append_eod=args.append_eod,
        add_special_tokens=not args.tokenizer_hf_no_include_special_tokens,
        split_sentences=args.split_sentences,
        keep_newlines=args.keep_newlines,
        lang=args.lang,
        skip_invalid=args.skip_invalid_lines,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )


@entry_point("preprocess_data.py")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(logging.INFO)
    try:
        summary = preprocess(config_from_args(args))
    except KeyboardInterrupt:  # temporaries are removed on the way out; existing outputs untouched
        print("preprocess_data.py: interrupted; no output written", file=sys.stderr)
        return 130
    print(summary.format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
