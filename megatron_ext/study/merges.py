"""The study's merge stage: each planned merge (``plan.PlannedMerge``) as one CPU job of
``python -m megatron_ext.cli.merge_checkpoints``, after the jobs of its runs still queued.

A merge is complete when its save directory holds ``merge.json`` and a complete checkpoint (the tool
writes both into a staging folder it publishes whole, so a merge that stopped leaves nothing). Rerun,
the stage skips complete merges and those whose newest job is still pending or running (launchers
whose jobs outlive it keep them in ``<study dir>/merge_jobs.json``), and submits the others again:
like a failed segment, a failed merge is retried by the same command.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from megatron_ext.checkpoint.merge import PROVENANCE
from megatron_ext.checkpoint.reader import Checkpoint
from megatron_ext.fileio import write_atomic
from megatron_ext.launch import Job, JobEvents, JobState, Launcher
from megatron_ext.study.plan import PlannedMerge, StudyPlan
from megatron_ext.study.state import StudyDir, log_tail, say
from megatron_ext.study.tree import stored_id

MERGE = "megatron_ext.cli.merge_checkpoints"
"""The merge's module: what every merge job runs."""


def merge_complete(merge: PlannedMerge) -> bool:
    """Whether ``merge``'s save directory holds its provenance and a complete checkpoint."""
    save = Path(merge.save)
    return (save / PROVENANCE).is_file() and Checkpoint.latest(save) is not None


class MergeStage(JobEvents):
    """The study's merges through ``launcher`` (module docstring)."""

    def __init__(self, plan: StudyPlan, study_dir: StudyDir, launcher: Launcher, *,
                 out: Callable[[str], None] = say):
        self.plan = plan
        self.launcher = launcher
        self.out = out
        self.logs = study_dir.logs / "merges"
        self.jobs_file = study_dir.root / "merge_jobs.json"
        """Merge name -> its newest job (launchers whose jobs outlive them)."""
        self.merges = {merge.name: merge for merge in plan.merges}
        self.job_ids: dict[str, str] = {}
        self.failed: list[str] = []

    def job(self, merge: PlannedMerge) -> Job:
        # One process on CPU (the tool holds the parents' weights in host memory): the study's
        # resources without GPUs.
        return Job(name=f"{self.plan.study.name}.merge.{merge.name}", module=MERGE, args=tuple(merge.args()),
                   log=self.logs / merge.name,
                   resources=dataclasses.replace(self.plan.study.resources, nodes=1, gpus_per_node=0))

    def _stored(self) -> dict[str, str]:
        if not self.launcher.persistent or not self.jobs_file.is_file():
            return {}
        return {name: str(job_id) for name, job_id in json.loads(self.jobs_file.read_text()).items()}

    def live_jobs(self) -> list[str]:
        """The merge jobs still pending or running (at submission)."""
        return list(self.job_ids.values())

    def run(self, *, after: Callable[[str], str | None], dry_run: bool = False) -> int:
        """Submit each merge neither complete nor queued, after the queued jobs of its runs
        (``after``: a run's job while it is pending or running, else None); with a launcher that
        follows, follow them. 0: every merge complete (or submitted); 1: a merge failed; 75: stopped
        on a signal."""
        stored = self._stored()
        states = self.launcher.states(list(stored.values())) if stored else {}
        queued = {name: job_id for name, job_id in stored.items() if name in self.merges and states[job_id].live}
        self.job_ids = dict(queued)
        for merge in self.merges.values():
            if merge_complete(merge):
                self.out(f"merge {merge.name}: complete ({merge.save})")
                continue
            if merge.name in queued:
                self.out(f"merge {merge.name}: job {queued[merge.name]} is queued")
                continue
            waits = [job_id for run in dict.fromkeys((*merge.parents, merge.base_run)) if run is not None
                     and (job_id := after(run)) is not None]
            if dry_run:
                self.out(f"  {self.launcher.describe(self.job(merge), waits)}")
                continue
            self.logs.mkdir(parents=True, exist_ok=True)
            job_id = self.launcher.submit(self.job(merge), waits)
            self.job_ids[merge.name] = job_id
            if self.launcher.persistent:
                stored[merge.name] = job_id
                write_atomic(self.jobs_file, json.dumps({k: stored_id(v) for k, v in stored.items()}, indent=1) + "\n")
                self.out(f"submitted merge {merge.name}: job {job_id}" + (f", after job(s) {', '.join(waits)}"
                                                                          if waits else ""))
        if dry_run or not self.launcher.follows or not self.job_ids:
            return 0
        stopped = self.launcher.follow(list(self.job_ids.values()), self)
        if stopped is not None:
            from megatron_ext.exit_codes import RESUMABLE_EXIT_CODE

            self.out(f"merges: stopped on {stopped}; the same command runs them again")
            return RESUMABLE_EXIT_CODE
        return 1 if self.failed or not all(merge_complete(m) for m in self.merges.values()) else 0

    def _merge(self, job_id: str) -> PlannedMerge:
        return self.merges[next(name for name, j in self.job_ids.items() if j == job_id)]

    def started(self, job_id: str) -> None:
        merge = self._merge(job_id)
        self.out(f"merge {merge.name}: {merge.spec.method} of {', '.join(merge.parents)} -> {merge.save}")

    def stopping(self, job_id: str, signal_name: str) -> None:
        self.out(f"{signal_name} received: the merge in flight stops (it leaves no output; rerun to merge)")

    def ended(self, job_id: str, state: JobState) -> None:
        merge = self._merge(job_id)
        if state.succeeded and merge_complete(merge):
            self.out(f"merge {merge.name}: complete")
        elif not state.stopped:
            self.failed.append(merge.name)
            log = state.log or self.launcher.log_file(self.job(merge), job_id)
            self.out(f"merge {merge.name}: FAILED ({state.detail}); log {log}:\n{log_tail(log)}")
