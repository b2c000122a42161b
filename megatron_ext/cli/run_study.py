"""Train a study: plan it, then train its segments on this machine or as SLURM jobs.

    python tools/run_study.py examples/studies/paper_610m.yaml --executor local
    python tools/run_study.py examples/studies/paper_610m.yaml --executor slurm --sbatch-arg=--partition=gpu
    python tools/run_study.py STUDY.yaml --executor slurm --dry-run      # the status and the sbatch commands
    python tools/run_study.py STUDY.yaml --executor local --only 610m_clm_12k  # and the runs it starts from

The plan (tools/plan_study.py) and one recipe per run are written to the study directory
(--study-dir, default runs/studies/<study name>), then the segments are trained in tree order, a
parent before its children. A segment is complete when the newest checkpoint in its run's
checkpoint.save is at its train_iters; rerunning the command skips complete segments and trains
the rest (an interrupted run resumes from its own newest checkpoint). A failed segment blocks its
descendants only. Run it from the directory the study's relative paths (data, output) are
relative to: the trainers run there.

  local  one trainer after another (--nproc-per-node N > 1: torchrun through
         examples/launch/single_node.sh); logs in <study dir>/logs/<run>.log. Ctrl-C or SIGTERM:
         the running trainer saves and stops, then the executor (exit 75; rerun to continue).
  slurm  one job per segment: sbatch examples/launch/slurm.sbatch with RECIPE=<its recipe>, job
         name <study>.<run>, --dependency=afterok:<parent's job> while the parent is not complete
         (--kill-on-invalid-dep=yes: a failed parent cancels its children); sbatch flags: the
         study's `sbatch:`, the size's `sbatch:`, then --sbatch-arg. Job ids in <study dir>/jobs.json.
         A rerun leaves pending and running jobs alone and resubmits failed or cancelled segments
         and the ones below them. --wait: follow the jobs until they end.

--dry-run also prints the study's cost (GPU-hours and wall time per segment, the tree against
every run from scratch, the evaluation, the whole study; megatron_ext/study/cost.py); with
--budget-gpu-hours N a study estimated above N is refused (exit 2) before anything starts. While it
trains, the progress lines give the study's ETA from the same estimate, corrected by the measured
time of the segments already trained.

Then, with the local executor, the study's evaluation: section (when it has one; not with --only
or --train-only): tools/evaluate.py over every run (and each reference model) with
evaluation.workers processes sharing each grid, logs in <study dir>/logs/evaluation/, outputs in
evaluation.output_dir; finished fine-tuning runs are reused on a rerun. Then the report
(tools/study_report.py: tables and the paper's figures) into <evaluation.output_dir>/report/.

With the slurm executor, each grid is a job array of evaluation.workers tasks
(examples/launch/evaluate.sbatch) submitted after the training jobs still queued (afterok), its
ids in <study dir>/evaluation_jobs.json; the report is written by the command that finds every
grid finished (with --wait: this one, once the arrays end).

Exit status: 0 every selected segment complete (slurm without --wait: all submitted) and, where the
evaluation ran, the report written; 1 a segment failed or is blocked, or the evaluation failed (an
evaluation worker's error; slurm --wait: its arrays ended with a grid unfinished); 2 bad input (one
line naming it); 75 stopped on request (rerun to continue).
"""

from __future__ import annotations

import argparse
import sys
import time

from megatron_ext.cli.entry import ArgumentParser, entry_point


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study", help="study file (YAML, see examples/studies/)")
    parser.add_argument("--executor", required=True, choices=["local", "slurm"],
                        help="local: segments one after another here; slurm: one job per segment")
    parser.add_argument("--study-dir", default=None, metavar="DIR",
                        help="plan, recipes, logs and jobs of the study [runs/studies/<study name>]")
    parser.add_argument("--only", nargs="+", default=None, metavar="RUN",
                        help="train these runs (and the runs they start from) only")
    parser.add_argument("--train-only", action="store_true",
                        help="stop once the runs are trained (slurm: submitted); default: then the study's evaluation: "
                             "section and its report)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the status and what would be trained or submitted; "
                             "write and start nothing")
    local = parser.add_argument_group("local executor")
    local.add_argument("--nproc-per-node", type=int, default=1, metavar="N",
                       help="processes per trainer; N > 1: torchrun over N GPUs [1]")
    local.add_argument("--progress-interval", type=float, default=600.0, metavar="SECONDS",
                       help="seconds between lines saying where the running segment is [600]")
    slurm = parser.add_argument_group("slurm executor")
    slurm.add_argument("--sbatch-arg", action="append", default=[], metavar="FLAG",
                       help="an sbatch flag for every job, e.g. --sbatch-arg=--partition=gpu (repeatable; "
                            "after the study's and the size's)")
    slurm.add_argument("--wait", action="store_true", help="follow the study's jobs until they end")
    slurm.add_argument("--poll-interval", type=float, default=30.0, metavar="SECONDS",
                       help="--wait: seconds between looks at the queue [30]")
    from megatron_ext.study.cost import add_cost_flags

    add_cost_flags(parser, study=True)
    return parser


@entry_point("run_study.py")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_ext.study.execute import StudyDir, select_runs, write_plan
    from megatron_ext.study.plan import plan_study
    from megatron_ext.study.spec import read_study

    plan = plan_study(read_study(args.study), args.study)
    study_dir = StudyDir.for_plan(plan, args.study_dir)
    selected = select_runs(plan, args.only)

    def executor():
        if args.executor == "local":
            from megatron_ext.study.local import LocalExecutor, LocalOptions

            return LocalExecutor(plan, study_dir, selected, LocalOptions(
                nproc_per_node=args.nproc_per_node, progress_interval=args.progress_interval))
        from megatron_ext.study.slurm import SlurmExecutor, SlurmOptions

        return SlurmExecutor(plan, study_dir, selected, SlurmOptions(
            sbatch_args=tuple(args.sbatch_arg), wait=args.wait, poll_interval=args.poll_interval))

    from megatron_ext.study.cost import report_study_cost

    if args.executor == "local" and args.gpus is None:  # the local executor's runs use --nproc-per-node GPUs
        args.gpus = args.nproc_per_node
    if args.dry_run:
        code = executor().run(dry_run=True)
        report_study_cost(plan, args)
        return code
    if args.budget_gpu_hours is not None:  # refused before anything is written or started
        report_study_cost(plan, args, show=False)
    with study_dir.lock():  # one executor at a time writes the study directory and trains or submits
        write_plan(plan, study_dir)
        print(f"wrote {study_dir.plan_json} and {len(plan.runs)} recipes", flush=True)
        started = time.perf_counter()
        trainer = executor()
        code = trainer.run(dry_run=False)
        if args.only or args.train_only or plan.study.evaluation is None:
            return code
        if code != 0:
            print("evaluation: not started, the training is not complete (above); the same command finishes it, "
                  "then evaluates", flush=True)
            return code
        if args.executor == "local":
            print(f"training: every run complete ({time.perf_counter() - started:.0f} s)", flush=True)
            from megatron_ext.study.evaluation import evaluate_and_report_locally
            from megatron_ext.training.stop import RESUMABLE_EXIT_CODE

            outcome = evaluate_and_report_locally(plan, log_dir=study_dir.logs / "evaluation")
            return {"done": 0, "failed": 1, "stopped": RESUMABLE_EXIT_CODE}[outcome]
        return _evaluate_on_slurm(plan, study_dir, trainer, args)


def _evaluate_on_slurm(plan, study_dir, trainer, args: argparse.Namespace) -> int:
    """Submit the evaluation arrays after the training jobs still queued; with --wait, follow them
    and write the report; without, write it once every grid is finished (a later run)."""
    from megatron_ext.study.evaluation import SlurmEvaluation

    states = trainer.states()
    unfinished = [run for run, state in states.items() if state.status in ("failed", "blocked", "to do")]
    if unfinished:
        print(f"evaluation: not submitted, {len(unfinished)} segment(s) failed or blocked "
              f"({', '.join(unfinished[:5])}{', ...' if len(unfinished) > 5 else ''})", flush=True)
        return 1
    queued = [trainer.jobs.latest(run).job_id for run, state in states.items()
              if state.status in ("pending", "running")]
    evaluation = SlurmEvaluation(plan=plan, jobs_file=study_dir.root / "evaluation_jobs.json",
                                 logs=study_dir.logs / "evaluation", sbatch_args=tuple(args.sbatch_arg))
    evaluation.submit(after=queued)
    if not args.wait:
        evaluation.report_if_finished()
        return 0
    evaluation.follow(args.poll_interval)
    return 0 if evaluation.report_if_finished() else 1  # the arrays ended without finishing a grid


if __name__ == "__main__":
    sys.exit(main())
