"""Tokenize raw corpora into Megatron-Core indexed datasets (``.bin``/``.idx``).

Drop-in for Megatron-LM's ``tools/preprocess_data.py`` where the flags overlap::

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-model path/to/tokenizer_dir --append-eod --workers 8

Also reads JSONL.gz, plain text, Parquet and Hugging Face datasets (see --input-format).

A corpus too large for one process (docs/data.md, "A corpus of terabytes"): --shard-size cuts it
into shards, each tokenized by one of --workers worker processes started by a launcher (local
processes, or a SLURM job array), resumable shard by shard; the result is a blend of the shards'
prefixes (and with --merge one dataset)::

    python tools/preprocess_data.py --input 'corpus/*.jsonl' --output-prefix data/corpus \
        --tokenizer-model path/to/tokenizer_dir --append-eod --shard-size 1GB --workers 16
    python tools/preprocess_data.py ... --shard-size 1GB --workers 256 --launcher slurm --sbatch-arg=--partition=cpu
    python tools/preprocess_data.py ... --shard-size 1GB --dry-run      # the plan, what is done, the jobs
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


from megatron_ext.config_loading import UserError
from megatron_ext.exit_codes import INTERRUPTED_EXIT_CODE
from megatron_ext.data.preprocess import PreprocessConfig, preprocess
from megatron_ext.data.readers import INPUT_FORMATS, TEXT_MODES
from megatron_ext.launch import LAUNCHERS, Job, JobEvents, JobState, Launcher, launcher_class
from megatron_ext.tokenizer import TokenizerConfig
from megatron_ext.cli.entry import ArgumentParser, configure_logging, entry_point

WORKER = "megatron_ext.cli.preprocess_worker"
"""The program of each worker of a sharded run (and of its finishing job)."""


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
    group = parser.add_argument_group("a corpus in shards (docs/data.md, \"A corpus of terabytes\")")
    group.add_argument("--shard-size", default=None, metavar="SIZE",
                       help="cut the corpus into shards of about SIZE (e.g. 1GB), each tokenized by one of --workers "
                            "worker processes of --launcher, resumable shard by shard; output: a blend file of the "
                            "shards' prefixes")
    group.add_argument("--merge", action="store_true", help="with --shard-size: also merge the shards into one .bin/.idx")
    group.add_argument("--launcher", choices=list(LAUNCHERS), default="local",
                       help="with --shard-size: where the workers run: local processes or a SLURM job array [local]")
    group.add_argument("--dry-run", action="store_true",
                       help="with --shard-size: print the plan, what is done and the jobs; tokenize nothing")
    for name in LAUNCHERS:
        launcher_class(name).add_arguments(parser.add_argument_group(f"{name} launcher (with --shard-size)"))
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
    if args.shard_size is not None:
        return run_sharded(args)
    for flag in ("merge", "dry_run"):
        if getattr(args, flag):
            raise UserError(f"--{flag.replace('_', '-')} goes with --shard-size (a corpus in shards)")
    try:
        summary = preprocess(config_from_args(args))
    except KeyboardInterrupt:  # temporaries are removed on the way out; existing outputs untouched
        print("preprocess_data.py: interrupted; no output written", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    print(summary.format())
    return 0


def shard_jobs(shard_dir, workers: int, logs: Path) -> tuple[Job, Job]:
    """The workers (one job of ``workers`` copies) and the job that writes the blend after them."""
    where = str(shard_dir.root.resolve())
    name = shard_dir.root.name.removesuffix(".shards")
    return (Job(name=f"preprocess.{name}", module=WORKER, args=("--shard-dir", where), log=logs / "worker",
                array_size=workers),
            Job(name=f"preprocess.{name}.finish", module=WORKER, args=("--shard-dir", where, "--finish"),
                log=logs / "finish"))


class _ShardProgressEvents(JobEvents):
    """A line of the corpus's progress (from the markers) at each tick and look at the queue."""

    def __init__(self, shard_dir, plan) -> None:
        from megatron_ext.data.shards import shard_progress

        self.line = lambda: print(f"preprocess: {shard_progress(shard_dir, plan).format()}", flush=True)

    def tick(self, job_id: str) -> None:
        self.line()

    def poll(self) -> None:
        self.line()

    def ended(self, job_id: str, state: JobState) -> None:
        print(f"preprocess: job {job_id} {state.detail or state.status}"
              + (f" (log: {state.log})" if state.log and not state.succeeded else ""), flush=True)


def run_sharded(args: argparse.Namespace) -> int:
    """Plan the corpus, then tokenize its shards not done through the launcher and write the blend."""
    from megatron_ext.data.shards import (
        ShardDir, check_plan, finish, parse_size, plan_corpus, plan_lines, prepare, shard_progress,
    )

    config = config_from_args(args)
    plan = plan_corpus(config, parse_size(args.shard_size), merge=args.merge)
    shard_dir = ShardDir.for_prefix(config.output_prefix)
    launcher: Launcher = launcher_class(args.launcher).from_args(args)
    resumed = check_plan(plan, overwrite=config.overwrite) is not None  # refused here when it changed
    left = len(plan.shards) - (len(shard_dir.markers(plan)) if resumed else 0)
    workers, finisher = shard_jobs(shard_dir, max(1, min(config.workers, left)), shard_dir.root / "logs")
    if args.dry_run:
        print("\n".join(plan_lines(plan, shard_dir, resumed=resumed)))
        print(f"launcher {launcher.name}: {workers.array_size} worker(s) for {left} shard(s) left:\n  "
              f"{launcher.describe(workers, ())}\n  then: {launcher.describe(finisher, ('<workers>',))}")
        return 0
    prepare(plan, overwrite=config.overwrite)
    (shard_dir.root / "logs").mkdir(exist_ok=True)
    if left:
        worker_id = launcher.submit(workers)
        finish_id = launcher.submit(finisher, after=[worker_id])
        print(f"preprocess: {left} of {len(plan.shards)} shard(s) to do: {workers.array_size} worker(s) "
              f"({launcher.name} job {worker_id}), then the blend (job {finish_id}); logs in {shard_dir.root / 'logs'}",
              flush=True)
        if not launcher.follows:
            print("preprocess: submitted; the same command with --dry-run shows the progress, and again without "
                  "finishes what a failed worker left", flush=True)
            return 0
        events = _ShardProgressEvents(shard_dir, plan)
        stopped = launcher.follow([worker_id, finish_id], events)
        events.line()
        state = launcher.states([worker_id, finish_id])
        if stopped is not None or not all(s.succeeded for s in state.values()):
            print("preprocess: not finished" + (f" (stopped by {stopped})" if stopped else "")
                  + "; the same command resumes it: finished shards are kept", file=sys.stderr, flush=True)
            return INTERRUPTED_EXIT_CODE if stopped == "SIGINT" else 1
    else:
        print(f"preprocess: {shard_progress(shard_dir, plan).format()}", flush=True)
    for what, path in finish(shard_dir).items():
        print(f"output {what}  {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
