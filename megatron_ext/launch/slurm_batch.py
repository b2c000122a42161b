"""The Python half of ``scripts/slurm.sbatch``: each node's torchrun agent, the address the nodes
meet at, and what the job does once the trainer has ended (requeue, cancel or fail, and why).

    python -m megatron_ext.launch.slurm_batch address            # this node's address (NETWORK_INTERFACE)
    srun ... python -m megatron_ext.launch.slurm_batch agent TORCHRUN_ARGS...   # on every node
    python -m megatron_ext.launch.slurm_batch outcome --srun-code N [--batch-signals "USR1 TERM"]

One decision for the whole job: a node whose workers stopped resumably (exit code 75, their part of
the checkpoint written) exits 0, so ``srun --kill-on-bad-exit`` does not kill a node still saving,
and a torchrun agent that loses the rendezvous store after the store's node exited (pytorch#67742)
exits 0 too once global rank 0 has recorded the resumable stop. That record (the exit-status file,
``exit_codes.EXIT_STATUS_ENV``) is the truth the batch script acts on. A node that fails
records its name, exit code and the failing rank's message beside it (``<status file>.node-<node>``),
and :func:`outcome` names the node that failed first in the job's last line and in the status file.

Which stop requeues and which cancels (:data:`STOP_TABLE`, the table in docs/clusters.md): SLURM
sends SIGTERM for a time limit, a preemption and a plain ``scancel`` alike, so the job's record
(``scontrol show job``: JobState, Reason, PreemptTime) and whether a SIGUSR1 came tell them apart.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from megatron_ext.exit_codes import EXIT_STATUS_ENV, RESUMABLE_EXIT_CODE
from megatron_ext.fileio import write_atomic
from megatron_ext.processes import node_name

INTERFACE_ENV = "NETWORK_INTERFACE"
"""The network interface the nodes talk over (e.g. ``ib0``): NCCL's and gloo's sockets
(``NCCL_SOCKET_IFNAME``, ``GLOO_SOCKET_IFNAME``), the rendezvous address and each node's
``--local-addr`` all use it. Unset: the address the node's host name resolves to (``hostname
--ip-address``, as torchtitan's SLURM script does)."""


# -- addresses ---------------------------------------------------------------------------------------

def node_address(interface: str | None = None) -> str:
    """This node's IPv4 address on ``interface`` (refused in one line if it has none), or that of its
    host name when ``interface`` is None."""
    if interface:
        import psutil

        addresses = psutil.net_if_addrs()
        if interface not in addresses:
            raise SystemExit(f"{INTERFACE_ENV}={interface}: no such network interface on {node_name()} "
                             f"(it has {', '.join(sorted(addresses))})")
        for address in addresses[interface]:
            if address.family == socket.AF_INET:
                return address.address
        raise SystemExit(f"{INTERFACE_ENV}={interface}: the interface has no IPv4 address on {node_name()}")
    return socket.gethostbyname(socket.gethostname())


# -- the agent on each node --------------------------------------------------------------------------

def _status_file() -> str | None:
    return os.environ.get(EXIT_STATUS_ENV) or None


def _job_status() -> tuple[int | None, str]:
    """Global rank 0's recorded exit code and reason (None: nothing recorded)."""
    path = _status_file()
    try:
        with open(path or "") as f:
            code, _, reason = f.readline().strip().partition(" ")
        return int(code), reason
    except (OSError, ValueError):
        return None, ""


def _record_node_failure(code: int, message: str, when: float) -> None:
    """``<status file>.node-<node>``: ``<code> <time> <message>``, read by :func:`outcome`."""
    path = _status_file()
    if not path:
        return
    write_atomic(f"{path}.node-{node_name()}", f"{code} {when:.3f} {message}\n")


def _exit_code(worker_code: int) -> int:
    """A worker's status as a shell reports it (killed by signal N: 128 + N)."""
    return 128 - worker_code if worker_code < 0 else worker_code


def _describe(rank: int, failure) -> str:
    code = failure.exitcode
    if code < 0:
        with_signal = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        what = f"killed by {with_signal}"
    else:
        message = failure.message if isinstance(failure.message, str) else ""
        message = " ".join(message.split())[:300] if message and "To enable traceback" not in message else ""
        what = f"exited with code {code}" + (f" ({message})" if message else "")
    return f"rank {rank} (local rank {failure.local_rank}) {what}"


def agent(argv: list[str]) -> int:
    """torchrun on this node, its exit made one decision for the job (module docstring).

    The agent ignores SIGTERM and SIGUSR1 and keeps waiting for the workers (SLURM signals every
    process of the step, the workers included; torchrun's default would die on SIGUSR1, or answer
    SIGTERM by killing the workers 30 s later); the workers and what they start before the trainer
    installs its handlers inherit the ignored signals, so only the trainer acts on them."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    node = node_name()
    if not any(arg.split("=")[0] in ("--local-addr", "--local_addr") for arg in argv):
        # torchrun's default is the host's FQDN, which workers on other nodes may not resolve or reach.
        argv = ["--local-addr", node_address(os.environ.get(INTERFACE_ENV) or None), *argv]
    try:
        torchrun(argv)
        return 0
    except ChildFailedError as error:
        failures = error.failures  # global rank: ProcessFailure
        codes = {failure.exitcode for failure in failures.values()}
        # Workers torchrun ends once the first has exited (they ignore its SIGTERM: SIGKILL after the
        # shutdown timeout) are still saving or closing the same stop: they do not make it a failure.
        if RESUMABLE_EXIT_CODE in codes and codes <= {RESUMABLE_EXIT_CODE, -signal.SIGTERM, -signal.SIGKILL}:
            print(f"node {node}: its workers stopped resumably (exit code {RESUMABLE_EXIT_CODE})", flush=True)
            return 0
        rank = min(failures, key=lambda rank: failures[rank].timestamp)
        code = _exit_code(failures[rank].exitcode)
        _record_node_failure(code, f"node {node}: {_describe(rank, failures[rank])}", time.time())
        print(f"node {node}: {_describe(rank, failures[rank])}", file=sys.stderr, flush=True)
        return code
    except Exception as error:  # the agent itself: e.g. the rendezvous store gone with its node
        status, _ = _job_status()
        if status == RESUMABLE_EXIT_CODE:  # the job's stop is recorded: this node's is part of it
            print(f"node {node}: torchrun agent ended with {type(error).__name__} after the job's resumable "
                  "stop was recorded: not a failure", flush=True)
            return 0
        message = " ".join(f"{type(error).__name__}: {error}".split())[:300]
        _record_node_failure(1, f"node {node}: torchrun agent failed: {message}", time.time())
        raise


# -- what the job does after a stop ------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class SchedulerJobState:
    """What the batch script reads of its own job (``scontrol show job``) once the trainer ended."""

    state: str
    """JobState: RUNNING, or COMPLETING once SLURM ends the job (a plain scancel, a time limit)."""
    reason: str
    """Reason: ``TimeLimit`` when the time limit ended the job."""
    preempted: bool
    """Preemption began during this run (PreemptTime at or after StartTime)."""

    @classmethod
    def parse(cls, text: str) -> SchedulerJobState:
        fields = dict(re.findall(r"(\w+)=(\S*)", text))
        preempt, start = fields.get("PreemptTime", "None"), fields.get("StartTime", "")
        return cls(state=fields.get("JobState", "UNKNOWN"), reason=fields.get("Reason", "None"),
                   preempted=preempt not in ("None", "Unknown", "") and preempt >= start)


STOP_TABLE = (
    # (what happened, what the trainer gets, how the script knows, the job), in the order of the rules
    ("preemption (`GraceTime`)", "SIGTERM (or the job's `--signal` with `send_user_signal`)",
     "PreemptTime set during this run", "requeued"),
    ("time limit reached (no warning, or after it)", "SIGTERM, SIGKILL `KillWait` s later",
     "Reason=TimeLimit", "requeued"),
    ("plain `scancel JOB`", "SIGTERM, SIGKILL `KillWait` s later", "JobState COMPLETING, no time limit",
     "CANCELLED"),
    ("time-limit warning (`--signal=B:USR1@600`)", "SIGUSR1, passed on by the batch shell",
     "a SIGUSR1 came", "requeued"),
    ("`scancel --signal=USR1 JOB` (also `--batch`, `--full`)", "SIGUSR1", "a SIGUSR1 came", "requeued"),
    ("`scancel --signal=TERM JOB` (also `--batch`, `--full`)", "SIGTERM", "SIGTERM without a SIGUSR1",
     "CANCELLED (the script cancels it)"),
    ("a hung rank (`training.hang_timeout_minutes`)", "(no signal: every other rank's watchdog)",
     "the trainer's reason starts `hang:`", "requeued"),
    ("`training.exit_duration_in_mins`, `training.exit_interval`", "(no signal)", "the trainer's reason",
     "requeued"),
)
"""Which stop requeues the job and which cancels it: rendered as the table of docs/clusters.md
(checked by tests/unit/test_slurm_batch.py), decided by :func:`stop_outcome`."""


def stop_outcome(job: SchedulerJobState, *, batch_signals: set[str], trainer_reason: str) -> tuple[str, str]:
    """``("requeue" | "cancel", why)`` for a resumable stop (exit code 75), by :data:`STOP_TABLE`.
    ``batch_signals``: what the batch shell received (``{"USR1", "TERM"}``); ``trainer_reason``: the
    trainer's one-line reason (``stopped after step N/M (signal SIGTERM)``), which names SIGUSR1 when
    any rank got one. The batch shell passes a SIGTERM on as SIGUSR1 (srun would kill its tasks on
    SIGTERM), so a trainer's SIGUSR1 is a warning only when the batch shell got no SIGTERM."""
    warned = "USR1" in batch_signals or ("TERM" not in batch_signals and "SIGUSR1" in trainer_reason)
    if job.preempted:
        return "requeue", "preempted"
    if job.reason == "TimeLimit" or job.state == "TIMEOUT":
        return "requeue", "time limit"
    if job.state in ("COMPLETING", "CANCELLED"):
        return "cancel", "cancelled (scancel)"
    if warned:
        return "requeue", "SIGUSR1 (a warning, or scancel --signal=USR1)"
    if trainer_reason.startswith("hang:"):
        return "requeue", "a hung rank (training.hang_timeout_minutes)"
    if "signal" in trainer_reason:
        return "cancel", "SIGTERM without a warning (scancel --signal=TERM): cancelled"
    return "requeue", "stopped by the recipe's own limit"


def _node_failures(status_file: str) -> list[tuple[int, float, str]]:
    """Each failed node's record (code, time, message): the cause first. A worker killed by a signal
    the step did not send (the OOM killer, an operator) is a cause; an exit 1 may be a peer's
    consequence (its collective broke), so among equals the earliest comes first."""
    folder, prefix = os.path.split(status_file)
    records = []
    for name in sorted(os.listdir(folder or ".")):
        if name.startswith(f"{prefix}.node-"):  # write_atomic's temporary files start with "."
            with open(os.path.join(folder, name)) as f:
                code, when, message = f.readline().strip().split(" ", 2)
            records.append((int(code), float(when), message))
            os.remove(os.path.join(folder, name))
    return sorted(records, key=lambda record: (record[0] < 128, record[1]))


def outcome(*, srun_code: int, batch_signals: str, status_file: str, job_id: str) -> tuple[str, int, str]:
    """``(action, exit code, message)`` for the batch script, action one of finished, requeue,
    cancel, failed; the status file is rewritten with the code and message when a node failed."""
    status, reason = _job_status()
    failures = _node_failures(status_file)
    if status == RESUMABLE_EXIT_CODE:
        record = subprocess.run(["scontrol", "--oneliner", "show", "job", job_id], capture_output=True,
                                text=True).stdout
        action, why = stop_outcome(SchedulerJobState.parse(record), batch_signals=set(batch_signals.split()),
                                   trainer_reason=reason)
        return action, status, f"{reason}; {why}"
    if failures:
        code, _, message = failures[0]
        message += "".join(f"; then {other}" for _, _, other in failures[1:])
        with open(status_file, "w") as out:
            out.write(f"{code} {message}\n")
        return "failed", code, message
    if srun_code == 0 and status in (0, None):
        return "finished", 0, reason or "exit code 0"
    code = status if status not in (None, 0) else srun_code
    return "failed", code, reason or f"exit code {code}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["agent"]:  # torchrun's own arguments follow, untouched
        return agent(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m megatron_ext.launch.slurm_batch",
                                     description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("address", help="this node's address (on $NETWORK_INTERFACE if set)")
    after = commands.add_parser("outcome", help="after srun: '<action> <exit code> <message>'")
    after.add_argument("--srun-code", type=int, required=True)
    after.add_argument("--batch-signals", default="", help="signals the batch shell received, e.g. 'USR1 TERM'")
    args = parser.parse_args(argv)
    if args.command == "address":
        print(node_address(os.environ.get(INTERFACE_ENV) or None))
        return 0
    status_file = _status_file()
    if not status_file:
        parser.error(f"{EXIT_STATUS_ENV} is not set")
    action, code, message = outcome(srun_code=args.srun_code, batch_signals=args.batch_signals,
                                    status_file=status_file, job_id=os.environ.get("SLURM_JOB_ID", ""))
    print(action, code, message)
    return 0


if __name__ == "__main__":
    sys.exit(main())
