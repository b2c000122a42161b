"""megatron_ext.launch.slurm_batch: which stop requeues and which cancels (the table in
docs/clusters.md), what the job says when a node failed, this node's address. The whole scripts
under a real SLURM: tests/integration/test_slurm.py."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from megatron_ext.launch import slurm_batch
from megatron_ext.launch.slurm_batch import STOP_TABLE, SchedulerJobState, stop_outcome

DOC = Path(__file__).resolve().parents[2] / "docs" / "clusters.md"

# `scontrol --oneliner show job` lines as SLURM 22.05 printed them on the private test cluster
# (shortened to the fields read): during a run, after a plain scancel, at a time limit, in a preemption.
RUNNING = "JobId=3 JobState=RUNNING Reason=None StartTime=2026-11-28T14:32:10 PreemptTime=None"
SCANCELLED = "JobId=1 JobState=COMPLETING Reason=None StartTime=2026-11-28T14:31:52 PreemptTime=None"
TIMED_OUT = "JobId=2 JobState=COMPLETING Reason=TimeLimit StartTime=2026-11-28T14:32:14 PreemptTime=None"
PREEMPTED = "JobId=3 JobState=RUNNING Reason=None StartTime=2026-11-28T14:32:10 PreemptTime=2026-11-28T14:32:33"
# requeued after that preemption: PreemptTime stays, but it is older than this run's start
RESTARTED = "JobId=3 JobState=RUNNING Reason=None StartTime=2026-11-28T14:35:00 PreemptTime=2026-11-28T14:32:33"

# one example per row of STOP_TABLE, in its order: (job record, what the batch shell got, trainer's reason)
EXAMPLES = [
    (PREEMPTED, set(), "stopped after step 9/300 (signal SIGTERM)"),
    (TIMED_OUT, {"TERM"}, "stopped after step 9/300 (signal SIGTERM)"),
    (SCANCELLED, {"TERM"}, "stopped after step 9/300 (signal SIGTERM)"),
    (RUNNING, {"USR1"}, "stopped after step 9/300 (signal SIGUSR1)"),
    (RUNNING, set(), "stopped after step 9/300 (signal SIGUSR1 on rank 8 (gpu-b02))"),
    (RESTARTED, set(), "stopped after step 9/300 (signal SIGTERM)"),
    (RUNNING, set(), "hang: rank 1 on gpu-b02 last reported step 9 (61 s since its last heartbeat; the "
                     "other ranks are at step 9); rank 0 waited 60 s (training.hang_timeout_minutes=1)"),
    (RUNNING, set(), "stopped after step 9/300 (training.exit_duration_in_mins=5 reached)"),
]


def _doc_table() -> list[tuple[str, ...]]:
    text = DOC.read_text()
    start = text.index("| what happened | what the trainer gets | how the script tells | the job |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append(tuple(cell.strip() for cell in line.strip("|").split(" | ")))
    return rows


def test_the_docs_table_is_the_table_the_script_decides_by():
    assert _doc_table() == list(STOP_TABLE)


@pytest.mark.parametrize("row, example", list(zip(STOP_TABLE, EXAMPLES)), ids=[row[0] for row in STOP_TABLE])
def test_each_row_of_the_table_decides_as_it_says(row, example):
    record, batch_signals, reason = example
    action, _ = stop_outcome(SchedulerJobState.parse(record), batch_signals=batch_signals, trainer_reason=reason)
    assert action == ("cancel" if row[3].startswith("CANCELLED") else "requeue"), (row, action)


def test_scancel_signal_term_batch_cancels_though_the_trainer_got_the_shells_sigusr1():
    """The batch shell passes its SIGTERM on as SIGUSR1: that is no warning."""
    action, _ = stop_outcome(SchedulerJobState.parse(RUNNING), batch_signals={"TERM"},
                             trainer_reason="stopped after step 9/300 (signal SIGUSR1)")
    assert action == "cancel"


def test_a_preemption_of_an_earlier_run_does_not_make_a_later_sigterm_a_preemption():
    assert SchedulerJobState.parse(PREEMPTED).preempted and not SchedulerJobState.parse(RESTARTED).preempted


def test_a_killed_node_is_named_first_and_its_code_is_the_jobs(tmp_path, monkeypatch):
    """The node whose worker a signal killed is the cause; a peer's exit 1 (its collective broke),
    though recorded earlier, follows it."""
    status = tmp_path / ".exit-status-7"
    monkeypatch.setenv(slurm_batch.EXIT_STATUS_ENV, str(status))
    status.write_text("1 RuntimeError: Connection reset by peer\n")  # rank 0's own word: a consequence
    (tmp_path / ".exit-status-7.node-gpu01").write_text("1 100.0 node gpu01: rank 0 (local rank 0) exited with code 1\n")
    (tmp_path / ".exit-status-7.node-gpu02").write_text("137 104.5 node gpu02: rank 1 (local rank 0) killed by SIGKILL\n")
    action, code, message = slurm_batch.outcome(srun_code=137, batch_signals="", status_file=str(status), job_id="7")
    assert (action, code) == ("failed", 137)
    assert message == "node gpu02: rank 1 (local rank 0) killed by SIGKILL; then node gpu01: rank 0 (local rank 0) exited with code 1"
    assert status.read_text() == f"137 {message}\n"
    assert sorted(os.listdir(tmp_path)) == [".exit-status-7"]


def test_a_finished_run_and_a_bad_recipe(tmp_path, monkeypatch):
    status = tmp_path / ".exit-status-8"
    monkeypatch.setenv(slurm_batch.EXIT_STATUS_ENV, str(status))
    status.write_text("0 done at step 300\n")
    assert slurm_batch.outcome(srun_code=0, batch_signals="", status_file=str(status), job_id="8") == \
        ("finished", 0, "done at step 300")
    status.write_text("2 error: recipe.yaml: unknown key no_such_key\n")
    assert slurm_batch.outcome(srun_code=1, batch_signals="", status_file=str(status), job_id="8") == \
        ("failed", 2, "error: recipe.yaml: unknown key no_such_key")


def test_the_address_of_an_interface_and_a_missing_one_refused_by_name():
    assert slurm_batch.node_address("lo") == "127.0.0.1"
    with pytest.raises(SystemExit, match=r"NETWORK_INTERFACE=no-such-if0: no such network interface on .* \(it has .*lo"):
        slurm_batch.node_address("no-such-if0")
    assert re.fullmatch(r"\d+\.\d+\.\d+\.\d+", slurm_batch.node_address(None))


def test_the_batch_step_imports_no_torch_for_the_codes_it_shares_with_the_trainer():
    """The batch script's Python decides before torch could load: it reads the trainer's codes and
    status file from ``exit_codes``, which imports nothing."""
    import subprocess
    import sys

    probe = ("import sys; import megatron_ext.launch.slurm_batch as batch, megatron_ext.exit_codes as codes; "
             "assert batch.RESUMABLE_EXIT_CODE is codes.RESUMABLE_EXIT_CODE == 75; "
             "assert batch.EXIT_STATUS_ENV is codes.EXIT_STATUS_ENV; print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip() == "False"
