"""Plan a study: expand a study file to its runs and the tree of training segments they share.

    python tools/plan_study.py examples/studies/paper_610m.yaml --dry-run
    python tools/plan_study.py examples/studies/paper_610m.yaml --plan-json plan.json

A study file (examples/studies/) names base recipes per size, budgets, objectives, biphasic CLM
shares, continued pretraining and seeds. --dry-run prints the segment tree (where each run
starts from, the steps it trains, the checkpoints it keeps for its children), each run's steps
alone and in the tree, and the steps and tokens the tree saves against separate runs. --plan-json
writes the runs (full recipes) and segments as JSON. Reads no data and no tokenizer. Training the
study: tools/run_study.py.

Exit status: 0 done; 2 bad input (one line naming the file and key).
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_ext.cli.entry import ArgumentParser, entry_point


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study", help="study file (YAML, see examples/studies/)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan; train nothing")
    parser.add_argument("--plan-json", default=None, metavar="PATH",
                        help="write the plan (runs and segments) as JSON")
    from megatron_ext.performance.cost import add_cost_flags

    add_cost_flags(parser, study=True)
    return parser


@entry_point("plan_study.py")
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.dry_run and args.plan_json is None:
        parser.error("nothing to do: give --dry-run (print the plan) and/or --plan-json PATH; to train the "
                     "study: tools/run_study.py")
    from megatron_ext.fileio import write_atomic
    from megatron_ext.study.plan import plan_study, plan_to_dict
    from megatron_ext.study.plan_text import format_plan
    from megatron_ext.study.spec import read_study

    plan = plan_study(read_study(args.study), args.study)
    if args.dry_run:
        from megatron_ext.study.calibration import report_study_cost

        print(format_plan(plan))
        report_study_cost(plan, args)
    if args.plan_json is not None:
        write_atomic(args.plan_json, json.dumps(plan_to_dict(plan), indent=1) + "\n")
        print(f"wrote {args.plan_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
