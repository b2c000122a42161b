"""The study's report: the paper's tables and figures from a study file and its evaluations.

    python tools/study_report.py examples/studies/paper_610m.yaml --eval-dir runs/eval_paper \\
        --output-dir runs/report_paper_610m
    python tools/study_report.py STUDY.yaml --eval-dir EVAL_A --eval-dir EVAL_B --output-dir REPORT

Evaluated models (tools/evaluate.py --models NAME=PATH) are joined to the study's runs by name:
a run's name (its final checkpoint) or RUN@STEP (one checkpoint); other names are reported as
other models (tables only). Writes into --output-dir: report.md (per-family scores with 95 % CIs,
per-task scores and rankings, the figures, the figures skipped and why, the missing evaluations),
report.json (the same numbers and each figure's points) and figures/*.png: score vs CLM share per
budget, score vs pretraining tokens (MLM and CLM), continued pretraining vs added steps, score vs
fine-tuning LR. The method is in megatron_ext/study/report.py and in report.md.

Exit status: 0 done; 2 bad input (one line naming the file or flag).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_ext.cli.entry import ArgumentParser, entry_point


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study", help="study file (YAML, see examples/studies/)")
    parser.add_argument("--eval-dir", action="extend", nargs="+", type=Path, required=True, metavar="DIR",
                        help="an evaluation's output folder (tools/evaluate.py --output-dir, with summary.json); "
                             "repeat or list several")
    parser.add_argument("--output-dir", type=Path, required=True, metavar="DIR",
                        help="the report folder (replaced whole when it holds an earlier report)")
    return parser


@entry_point("study_report.py")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_ext.study.plan import plan_study
    from megatron_ext.study.report import build_report
    from megatron_ext.study.report_files import write_report
    from megatron_ext.study.spec import read_study

    def log(line: str) -> None:
        print(f"study_report: {line}", flush=True)

    plan = plan_study(read_study(args.study), args.study)
    report = build_report(plan, args.eval_dir, log=log)
    write_report(report, args.output_dir, log=log)
    skipped = [figure.name for figure in report.figures if figure.skipped]
    log(f"wrote {args.output_dir / 'report.md'} ({len(report.figures) - len(skipped)} figure(s)"
        + (f"; skipped: {', '.join(skipped)}" if skipped else "") + f"; {len(report.missing)} missing evaluation(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
