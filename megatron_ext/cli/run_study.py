"""Train a study: plan it, then run its segments through a launcher, then evaluate and report.

    python -m megatron_ext.cli.run_study examples/studies/paper_610m.yaml --launcher local
    python -m megatron_ext.cli.run_study examples/studies/paper_610m.yaml --launcher slurm --sbatch-arg=--partition=gpu
    python -m megatron_ext.cli.run_study STUDY.yaml --launcher slurm --dry-run   # the status and the submissions
    python -m megatron_ext.cli.run_study STUDY.yaml --launcher local --only 610m_clm_12k  # and the runs it starts from

(also ``megatron-ext-run-study`` and, in a clone, ``tools/run_study.py``). The plan
(plan_study) and one recipe per run are written to the study directory (--study-dir, default
runs/studies/<study name>), then each segment is a job of the trainer (pretrain_encoder.py --config
<its recipe>), submitted in tree order, a parent before its children, each waiting for its
parent's job. A segment is complete when the newest checkpoint in its run's checkpoint.save is
at its train_iters; rerunning the command skips complete segments and trains the rest (an
interrupted run resumes from its own newest checkpoint). A failed segment blocks its descendants
only. Run it from the directory the study's relative paths (data, output) are relative to: the
jobs run there. Jobs ask for the study's resources: (nodes, gpus_per_node, time; a size's over the
study's), which each launcher maps to its own form, plus that launcher's extra flags.

  local  one job after another on this machine (--nproc-per-node N > 1, else the study's
         gpus_per_node: torchrun through the packaged single_node.sh); logs in
         <study dir>/logs/<run>.log. Ctrl-C or SIGTERM: the running trainer saves and stops, then
         run_study (exit 75; rerun to continue).
  slurm  one batch job per segment (the packaged slurm.sbatch), job name <study>.<run>, waiting
         (afterok) for its parent's job while the parent is not complete; a failed parent cancels
         its children. Flags: the resources, the study's slurm: extras, then --sbatch-arg. Job ids
         in <study dir>/jobs.json. A rerun leaves pending and running jobs alone and resubmits
         failed or cancelled segments and the ones below them. --wait: follow the jobs until they end.

--dry-run also prints the study's cost (GPU-hours and wall time per segment, the tree against
every run from scratch, the evaluation, the whole study; megatron_ext/study/cost.py); with
--budget-gpu-hours N a study estimated above N is refused (exit 2) before anything starts. While it
trains, the progress lines give the study's ETA from the same estimate, corrected by the measured
time of the segments already trained.

Then the study's merges: (when it has any; not with --only): each merged model one CPU job of
python -m megatron_ext.cli.merge_checkpoints after the jobs of its runs still queued, logs in
<study dir>/logs/merges/; a merge is complete when its save holds merge.json and a checkpoint, and
a rerun submits a failed one again (megatron_ext/study/merges.py).

Then the study's evaluation: section (when it has one; not with --only or --train-only): one job
per grid (the study's runs, each reference model) of python -m megatron_ext.cli.evaluate with
evaluation.workers copies sharing it (local: processes here; slurm: a job array), after the
training jobs still queued; logs in <study dir>/logs/evaluation/, outputs in evaluation.output_dir;
finished fine-tuning runs are reused on a rerun. Then the report (study_report: tables and the
paper's figures) into <evaluation.output_dir>/report/, written by the command that finds every grid
finished (slurm: with --wait, this one once the arrays end; without, a later run).

Exit status: 0 every selected segment complete (a launcher not followed: all submitted) and,
where the evaluation ran, the report written; 1 a segment failed or is blocked, or the evaluation
failed (a worker's error, or its jobs ended with a grid unfinished); 2 bad input (one line naming
it); 75 stopped on request (rerun to continue).
"""

from __future__ import annotations

import argparse
import sys
import time

from megatron_ext.cli.entry import ArgumentParser, entry_point


def build_parser() -> argparse.ArgumentParser:
    from megatron_ext.launch import LAUNCHERS, launcher_class

    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study", help="study file (YAML, see examples/studies/)")
    parser.add_argument("--launcher", choices=list(LAUNCHERS), required=True,
                        help="where the jobs run: " + ", ".join(LAUNCHERS))
    parser.add_argument("--study-dir", default=None, metavar="DIR",
                        help="plan, recipes, logs and jobs of the study [runs/studies/<study name>]")
    parser.add_argument("--only", nargs="+", default=None, metavar="RUN",
                        help="train these runs (and the runs they start from) only")
    parser.add_argument("--train-only", action="store_true",
                        help="stop once the runs are trained (or submitted); default: then the study's evaluation: "
                             "section and its report")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the status and what would be started or submitted; write and start nothing")
    for name in LAUNCHERS:
        launcher_class(name).add_arguments(parser.add_argument_group(f"{name} launcher"))
    from megatron_ext.performance.cost import add_cost_flags

    add_cost_flags(parser, study=True)
    return parser


@entry_point("run_study.py")
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from megatron_ext.launch import launcher_class
    from megatron_ext.study.state import StudyDir, select_runs, write_plan
    from megatron_ext.study.plan import plan_study
    from megatron_ext.study.spec import read_study
    from megatron_ext.study.merges import MergeStage
    from megatron_ext.study.tree import TreeScheduler

    plan = plan_study(read_study(args.study), args.study)
    study_dir = StudyDir.for_plan(plan, args.study_dir)
    selected = select_runs(plan, args.only)
    launcher = launcher_class(args.launcher).from_args(args)
    from megatron_ext.study.calibration import report_study_cost
    from megatron_ext.study.cost import seconds_left

    scheduler = TreeScheduler(plan, study_dir, selected, launcher,
                              estimate_seconds=lambda segments: seconds_left(plan, segments, gpus=args.gpus))

    merges = MergeStage(plan, study_dir, launcher) if plan.merges and not args.only else None
    if args.dry_run:
        code = scheduler.run(dry_run=True)
        if merges is not None:
            print("would merge (after the jobs of their runs):", flush=True)
            merges.run(after=scheduler.live_job, dry_run=True)
        report_study_cost(plan, args)
        return code
    if args.budget_gpu_hours is not None:  # refused before anything is written or started
        report_study_cost(plan, args, show=False)
    with study_dir.lock():  # one run_study at a time writes the study directory and trains or submits
        write_plan(plan, study_dir)
        print(f"wrote {study_dir.plan_json} and {len(plan.runs)} recipes", flush=True)
        started = time.perf_counter()
        code = scheduler.run(dry_run=False)
        if merges is not None and code == 0:
            code = merges.run(after=scheduler.live_job)
        if code == 0 and all(state.status == "complete" for state in scheduler.current.values()):
            print(f"training: every run complete ({time.perf_counter() - started:.0f} s)", flush=True)
        if args.only or args.train_only or plan.study.evaluation is None:
            return code
        if code != 0:
            print("evaluation: not started, the training is not complete (above); the same command finishes it, "
                  "then evaluates", flush=True)
            return code
        unfinished = [run for run, state in scheduler.current.items() if state.status in ("failed", "blocked", "to do")]
        if unfinished:
            print(f"evaluation: not submitted, {len(unfinished)} segment(s) failed or blocked "
                  f"({', '.join(unfinished[:5])}{', ...' if len(unfinished) > 5 else ''})", flush=True)
            return 1
        from megatron_ext.study.evaluation import EvaluationStage

        after = scheduler.live_jobs() + (merges.live_jobs() if merges is not None else [])
        return EvaluationStage(plan, study_dir, launcher).run(after=after)


if __name__ == "__main__":
    sys.exit(main())
