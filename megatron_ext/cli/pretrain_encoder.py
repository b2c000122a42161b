"""Pretrain a text encoder on Megatron-Core: MLM, CLM, or biphasic CLM -> MLM.

    python pretrain_encoder.py --config examples/recipes/demo_tiny_biphasic.yaml [--lr 1e-3 ...]
    torchrun --nproc-per-node 8 pretrain_encoder.py --config RECIPE.yaml --tensor-model-parallel-size 2
    python pretrain_encoder.py --config RECIPE.yaml --dry-run --world-size 64   # validate + print the plan
    python pretrain_encoder.py --config RECIPE.yaml --dry-run --world-size 64 --gpu H100 --budget-gpu-hours 5000

--dry-run also prints what the run costs: GPU-hours and wall time on --world-size GPUs of --gpu KIND
(default: this machine's), from a committed throughput measurement, else the kind's peak at an
assumed MFU, with the source of the speed (megatron_ext/performance/cost.py); --budget-gpu-hours N
refuses (exit 2) a run estimated above N.

Every config field has a flag named like Megatron-LM's (see --help); the recipe's values are
the defaults. Resumes automatically from the newest complete checkpoint in --save (or --load).

Exit status: 0 done; 2 bad input (one line naming it; also --save in use by another trainer, or
a damaged checkpoint: the line names the file and the --load-step that resumes past it); 74 the
save directory is full, over quota or read-only (the previous checkpoint stays the newest): free
space, then run the same command; 75 stopped on request after saving (Ctrl-C, SIGTERM/SIGUSR1,
--exit-duration-in-mins, --exit-interval): run the same command to resume; 130 Ctrl-C during
start-up, or a third Ctrl-C (the save in flight is lost, the previous checkpoint is kept);
76 stopped on request with nothing saved (no checkpoint.save); 1 a bug (with its traceback).
MEGATRON_EXT_DEBUG=1 adds the traceback to a bad input's line.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

# First: importing megatron_ext.cli keeps third-party warnings to one per job, before Megatron is
# imported (megatron_ext.cli.entry.THIRD_PARTY_WARNINGS).
from megatron_ext.cli.entry import ArgumentParser, configure_logging, report_user_error

import yaml

from megatron_ext.config_loading import UserError
from megatron_ext.tokenizer import EncoderTokenizer, TokenizerConfig, build_tokenizer

if TYPE_CHECKING:
    from megatron_ext.training.config import RunConfig

# Nothing here imports torch at module level: a process that multiprocessing's spawn starts from
# the trainer (the checkpoint writers' results queue) imports the trainer's main module again, as
# ``__mp_main__`` (this module, or the checkout's ``pretrain_encoder.py`` that calls it), and would
# pay torch's and Megatron's import (seconds of CPU) for nothing.


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    from megatron_ext.cli.megatron_flags import annotate_help, unsupported_flag_message

    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                            explain_unknown=unsupported_flag_message)
    parser.add_argument("--config", required=True, help="YAML recipe (see examples/recipes)")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the plan; no training")
    parser.add_argument("--world-size", type=int, default=None,
                        help="--dry-run: plan for this many processes (default: $WORLD_SIZE or 1)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as YAML")
    from megatron_ext.performance.cost import add_cost_flags
    from megatron_ext.training.recipe import add_override_flags

    add_cost_flags(parser, study=False)
    dests = add_override_flags(parser)
    from megatron_ext.training.recipe import field_defaults

    annotate_help(parser, field_defaults(dests))
    return parser, dests


def load_config(args: argparse.Namespace, dests: dict) -> tuple[RunConfig, EncoderTokenizer | None]:
    """The run config, and its tokenizer when reading the config needed it (``model.vocab_size:
    from_tokenizer``)."""
    from megatron_ext.training.recipe import apply_overrides, read_recipe

    return config_from_recipe(apply_overrides(read_recipe(args.config), args, dests))


def config_from_recipe(raw: dict) -> tuple[RunConfig, EncoderTokenizer | None]:
    """The run config of a recipe (as a dict), and its tokenizer when reading it needed it
    (``model.vocab_size: from_tokenizer``, or a preset whose vocabulary is a placeholder)."""
    from megatron_ext.training.recipe import needs_tokenizer_vocab, run_config_from_dict

    tokenizer = None
    if needs_tokenizer_vocab(raw):
        from megatron_ext.config_loading import build_dataclass

        tokenizer = build_tokenizer(build_dataclass(TokenizerConfig, raw.get("tokenizer") or {}, "tokenizer"))
    return run_config_from_dict(raw, tokenizer_vocab_size=tokenizer and tokenizer.vocab_size), tokenizer


def main(argv: list[str] | None = None) -> int:
    from megatron_ext.training.stop import write_exit_status

    try:
        code, reason = _main(argv)
    except UserError as error:  # a bad recipe, flag, data, checkpoint or path, on any rank
        code, reason = report_user_error("pretrain_encoder.py", error), f"error: {error}"
    except KeyboardInterrupt:  # Ctrl-C before the training loop's handler (start-up): nothing to save yet
        from megatron_ext.exit_codes import INTERRUPTED_EXIT_CODE

        code, reason = INTERRUPTED_EXIT_CODE, "interrupted (Ctrl-C) during start-up, before the first step"
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"pretrain_encoder.py: {reason}; nothing new saved", file=sys.stderr, flush=True)
    except BaseException as error:  # a bug, or SystemExit (--help): recorded, then as it was
        code = error.code if isinstance(error, SystemExit) and isinstance(error.code, int) else 1
        write_exit_status(code, f"{type(error).__name__}: {error}")
        raise
    write_exit_status(code, reason)
    return code


def _main(argv: list[str] | None) -> tuple[int, str]:
    """The exit code and a one-line reason."""
    parser, dests = build_parser()
    args = parser.parse_args(argv)
    configure_logging()
    config, tokenizer = load_config(args, dests)
    if args.print_config:
        print(yaml.safe_dump(config.to_dict(), sort_keys=False))
    if args.dry_run:
        import functools

        from megatron_ext.training.dry_run import format_dry_run, make_plan, phase_flops, save_cadence, source_samples
        from megatron_ext.training.preflight import Caller, preflight

        from megatron_ext.performance.cost import RunPricing, check_budget, format_run_cost, speed_table, split_cost

        world = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
        speeds = speed_table(args)
        # The run's pre-flight for this plan: what refuses a run refuses here (before the plan); what
        # this machine lacks is said in the last lines (NOT READY where this machine runs the plan).
        checks = preflight(config, Caller.DRY_RUN, world_size=world, tokenizer=tokenizer,
                           gpu_kind=speeds.kind if args.gpu else None)
        plan = make_plan(config, world)
        print(format_dry_run(config, plan, source_plan=checks.source_plan))
        from megatron_ext.cli.megatron_flags import megatron_differences

        if differences := megatron_differences(config):  # on purpose, said before a ported script launches
            print("\n".join(["unlike Megatron-LM, on purpose:", *(f"  {difference}" for difference in differences)]))
        print(checks.memory)
        pricing = RunPricing(config=config, flops=functools.partial(phase_flops, config), gpus=world,
                             gpus_per_node=args.gpus_per_node, speeds=speeds)
        cost = pricing.steps(run="the run")
        print(format_run_cost(cost, speeds.kind, speeds.notices))
        if (cadence := save_cadence(config, cost.step_seconds)) is not None:
            print(cadence)
        # Parts of the run priced alone: their steps' cost, the one trainer start-up said apart.
        by_phase = len({(c.seq_length, c.global_batch_size) for c in config.phase_contexts}) > 1  # training.context
        if by_phase:
            for context in config.phase_contexts:
                part = pricing.steps(context.phase.start, context.phase.end, run=f"phases[{context.phase.index}]")
                hours = "unknown" if part.gpu_hours is None else f"{part.steps_gpu_hours:,.3g} GPU-hours"
                print(f"  phases[{context.phase.index}] at {context.seq_length} tokens: {part.flops:.3e} FLOPs, {hours}")
        if checks.source_plan is not None:  # each source's share of the steps' cost
            spans = [(pricing.steps(start, end, run=f"steps [{start}, {end})"), samples)
                     for start, end, samples in source_samples(checks.source_plan)]
            for name, flops, hours in split_cost(spans):
                spent = "unknown" if hours is None else f"{hours:,.3g} GPU-hours"
                print(f"  source {name}: {flops:.3e} FLOPs ({100 * flops / cost.flops:.1f} %), {spent}")
        if (by_phase or checks.source_plan is not None) and cost.startup_gpu_hours is not None:
            print(f"  trainer start-up: {cost.startup_gpu_hours:,.3g} GPU-hours (once; in none of the parts above)")
        check_budget(args.budget_gpu_hours, cost.gpu_hours, [("the run", cost.gpu_hours or 0.0)], "the run",
                     unknown_hint=speeds.unknown_hint)
        print("\n".join(checks.lines))
        return 0, "dry run"
    from megatron_ext.training.loop import pretrain
    from megatron_ext.exit_codes import RESUMABLE_EXIT_CODE, STOPPED_UNSAVED_EXIT_CODE

    result = pretrain(config)
    if result.stopped:  # the loop said where and why (rank 0)
        if not config.checkpoint.save:  # nothing to resume from: a rerun would start over
            return STOPPED_UNSAVED_EXIT_CODE, result.stop_summary + " (nothing saved)"
        return RESUMABLE_EXIT_CODE, result.stop_summary
    if int(os.environ.get("RANK", "0")) == 0:  # every rank returns the same result; rank 0 says it
        print(f"done: steps {result.start_step} -> {result.final_step}; checkpoint {result.checkpoint}")
    return 0, f"done at step {result.final_step}"


if __name__ == "__main__":
    sys.exit(main())
