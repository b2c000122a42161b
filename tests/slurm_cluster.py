"""A private SLURM cluster for the tests: munged, slurmctld and one or more slurmd on this host.

Everything the cluster needs lives under one temporary directory: its ``slurm.conf`` (selected
through ``SLURM_CONF`` in :attr:`SlurmCluster.env`, which every command the tests run must use), a
fresh munge key and munged socket (``AuthInfo=socket=...``), state, spool and log folders, and its
own TCP ports. The daemons run in the foreground as children of the test process, so stopping the
cluster ends exactly the processes it started; a system-wide SLURM or munge is never touched.

    with start_cluster(nodes=2) as cluster:   # two slurmd on this host: nodes <hostname> and localhost
        job = cluster.sbatch(["--nodes=1", "script.sbatch"], env=...)
        info = cluster.wait(job)          # {"JobState": "COMPLETED", "ExitCode": "0:0", ...}
        cluster.preempt(job)              # a high-tier job on its nodes: SLURM preempts it (requeue)

Preemption is real: two partitions on the same nodes, the default one preemptible (``GraceTime``,
``PreemptMode=REQUEUE``), the other of a higher ``PriorityTier``. What the preempted job receives
(SLURM 22.05, slurmctld's preempt.c): SIGCONT and SIGTERM to every process of its steps, not the
batch shell; with :meth:`SlurmCluster.send_user_signal` on, its ``--signal`` instead (for ``B:``, to
the batch shell only); at the end of the grace time SIGCONT, SIGTERM to every process of the job,
the batch shell and srun included, then SIGKILL after ``KillWait``.

Runnable by hand to experiment: ``python tests/slurm_cluster.py [--nodes 2]`` starts a cluster,
prints the ``SLURM_CONF`` to export, and stops it on Ctrl-C or SIGTERM.

Requirements: the Debian packages ``slurm-wlm`` (slurmctld, slurmd, client commands) and ``munge``
(Debian 12: SLURM 22.05, munge 0.5.15). Used as root, as CI runs; for another user the daemons are
configured to run as that user (``SlurmUser``, ``SlurmdUser``), which is untested.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo", "srun")
PARTITION = "cpu"
"""The default partition, preemptible: a job of :data:`PREEMPTOR_PARTITION` that needs its nodes
requeues its jobs (``PreemptMode=REQUEUE``) after :data:`GRACE_TIME`."""
PREEMPTOR_PARTITION = "urgent"
"""Same nodes, higher ``PriorityTier`` (``PreemptType=preempt/partition_prio``); not preemptible."""
GRACE_TIME = 120
"""Seconds a preempted job has between its first signal and SLURM ending it (``GraceTime``):
longer than a step plus a save of the tests' recipes on a loaded 2-core machine, with a margin."""
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE"}


def missing_binaries() -> list[str]:
    """The SLURM and munge programs this host lacks (empty when a private cluster can start)."""
    return [name for name in PROGRAMS if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]


def _binary(name: str) -> str:
    found = shutil.which(name) or (str(Path("/usr/sbin", name)) if Path("/usr/sbin", name).exists() else None)
    if found is None:
        raise FileNotFoundError(f"{name} not found (install Debian's slurm-wlm and munge)")
    return found


def _free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free right now (bound together, so no two are equal)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _die_with_parent() -> None:
    """In a daemon about to start: SIGTERM when the process that started it dies, so a test run that
    is killed (and cannot stop the cluster) leaves no daemon behind."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class SlurmError(RuntimeError):
    pass


class SlurmCluster:
    """A running private cluster; :meth:`stop` (or leaving the ``with`` block) ends its daemons."""

    def __init__(self, root: Path, *, nodes: int = 1, cpus: int | None = None, verbose: bool = False):
        self.root = root
        self.hostname = socket.gethostname().split(".")[0]
        # The nodes share this host's cores: each declares its share, so SLURM's variables (and the
        # threads the launch script derives from them) do not oversubscribe the host.
        self.cpus = cpus or max(1, (os.cpu_count() or 1) // nodes)
        # Each node is a slurmd of its own (its own port, spool and log) on this host. Their names must
        # resolve (the launch script's rendezvous is on the first node's name): this host's name, and
        # for a second node, localhost.
        if nodes not in (1, 2) or (nodes == 2 and self.hostname == "localhost"):
            raise ValueError(f"a private cluster has 1 or 2 nodes on a host not named localhost, not {nodes}")
        self.nodes = [self.hostname, "localhost"][:nodes]
        self.partition = PARTITION
        self.preemptor_partition = PREEMPTOR_PARTITION
        self.user_signal_at_preemption = False
        self.ports: list[int] | None = None
        """slurmctld's, then each slurmd's: chosen when the configuration is first written."""
        self.verbose = verbose
        self.conf = root / "etc" / "slurm.conf"
        self.processes: dict[str, subprocess.Popen] = {}
        user = pwd.getpwuid(os.getuid()).pw_name
        self.user = user
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_",
                                                                                  "SALLOC_", "SQUEUE_"))},
                    "SLURM_CONF": str(self.conf)}

    # -- start and stop -----------------------------------------------------------------------------

    def start(self, timeout: float = 60) -> SlurmCluster:
        try:
            self._write_munge()
            self._write_conf()
            self._start_munged()
            self._spawn("slurmctld", [_binary("slurmctld"), "-D", "-i", "-f", str(self.conf)]
                        + (["-vv"] if self.verbose else []))
            for node in self.nodes:
                self._spawn(f"slurmd-{node}", [_binary("slurmd"), "-D", "-N", node, "-f", str(self.conf)]
                            + (["-vv"] if self.verbose else []))
            self.wait_idle(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _write_munge(self) -> None:
        # munged insists: its socket's folder reachable by all, the key private to its owner.
        munge = self.root / "munge"
        munge.mkdir(mode=0o755)
        os.chmod(munge, 0o755)
        key = munge / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o400)
        self.munge_socket = munge / "munge.socket"

    def _start_munged(self) -> None:
        munge = self.root / "munge"
        self._spawn("munged", [_binary("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={munge / 'munge.key'}", f"--pid-file={munge / 'munged.pid'}",
                               f"--log-file={self.root / 'log' / 'munged.log'}",
                               f"--seed-file={munge / 'munged.seed'}"])
        deadline = time.monotonic() + 20
        while not self.munge_socket.exists():
            self._check_alive()
            if time.monotonic() > deadline:
                raise SlurmError(f"munged did not create its socket; log:\n{self._log('munged.log')}")
            time.sleep(0.05)

    def _write_conf(self) -> None:
        """Write ``slurm.conf``: the first time with new ports and folders, then (for
        :meth:`send_user_signal`) the same ones."""
        if self.ports is None:
            for sub in ("etc", "state", "log", "run"):
                (self.root / sub).mkdir(exist_ok=True)
            for node in self.nodes:
                (self.root / "spool" / node).mkdir(parents=True)
            self.ports = _free_ports(1 + len(self.nodes))
        ctld_port, *slurmd_ports = self.ports
        node_lines = []
        for node, port in zip(self.nodes, slurmd_ports):
            node_lines.append(f"NodeName={node} NodeHostname={self.hostname} NodeAddr=127.0.0.1 Port={port} "
                              f"CPUs={self.cpus} RealMemory=1000 State=UNKNOWN")
        log, run = self.root / "log", self.root / "run"
        self.conf.write_text("\n".join([
            "# A private test cluster (tests/slurm_cluster.py); every path under " + str(self.root),
            f"ClusterName=megatronext{os.getpid()}",
            f"SlurmctldHost={self.hostname}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_ports[0]}",
            f"SlurmUser={self.user}",
            f"SlurmdUser={self.user}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire also delays the start of a requeued job (default 120 s).
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",
            f"StateSaveLocation={self.root / 'state'}",
            # %n: the node's name, so several slurmd on this host keep their files apart.
            f"SlurmdSpoolDir={self.root / 'spool'}/%n",
            f"SlurmctldPidFile={run / 'slurmctld.pid'}",
            f"SlurmdPidFile={run}/slurmd-%n.pid",
            f"SlurmctldLogFile={log / 'slurmctld.log'}",
            f"SlurmdLogFile={log}/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "ReturnToService=2",
            "JobRequeue=1",
            # Finished jobs stay visible to `scontrol show job` for the whole test session.
            "MinJobAge=3600",
            "MessageTimeout=30",
            "InactiveLimit=0",
            "KillWait=30",
            "Waittime=0",
            "SlurmctldTimeout=60",
            "SlurmdTimeout=120",
            # Test pending jobs every 2 s (default 60), so a requeued job starts once eligible.
            "SchedulerParameters=sched_interval=2",
            # A job of the higher tier requeues the lower tier's jobs on the nodes it needs.
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
            *(["SlurmctldParameters=preempt_send_user_signal"] if self.user_signal_at_preemption else []),
            *node_lines,
            f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 "
            f"GraceTime={GRACE_TIME}",
            f"PartitionName={self.preemptor_partition} Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 "
            "PreemptMode=OFF",
            "",
        ]))

    def send_user_signal(self, on: bool) -> None:
        """Set ``SlurmctldParameters=preempt_send_user_signal`` (SLURM 22.05's name; 23.02 and later:
        ``PreemptParameters=send_user_signal``) and apply it with ``scontrol reconfigure``: a preempted
        job gets its ``--signal`` instead of SIGTERM."""
        self.user_signal_at_preemption = on
        self._write_conf()
        self.run(["scontrol", "reconfigure"])

    def preempt(self, job_id: int) -> int:
        """Submit a job of the higher tier that needs all of ``job_id``'s nodes (a running job), so
        that SLURM preempts it; the preemptor's id (it sleeps a second)."""
        nodes = self.job(job_id)["NodeList"]
        return self.sbatch([f"--partition={self.preemptor_partition}", f"--nodelist={nodes}", "--exclusive",
                            f"--job-name=preempts-{job_id}", f"--output={self.root / 'log'}/preemptor-%j.out",
                            "--wrap=sleep 1"])

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = (self.root / "log" / f"{name}.stdout").open("wb")
        self.processes[name] = subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True,
                                                preexec_fn=_die_with_parent)
        out.close()

    def _check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise SlurmError(f"{name} exited with code {process.returncode}:\n{self.logs()}")

    def _log(self, name: str, tail: int = 40) -> str:
        path = self.root / "log" / name
        return "\n".join(path.read_text(errors="replace").splitlines()[-tail:]) if path.exists() else ""

    def logs(self, tail: int = 40) -> str:
        """The last lines of every daemon log, for a failure message."""
        return "\n".join(f"--- {p.name}\n{self._log(p.name, tail)}" for p in sorted((self.root / "log").iterdir()))

    def wait_idle(self, timeout: float = 60) -> None:
        """Wait until every node is idle (registered and not running anything)."""
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            self._check_alive()
            result = self.run(["sinfo", "--noheader", "--Node", "--format=%N %T"], check=False)
            if result.returncode == 0:
                states = dict(line.split() for line in result.stdout.splitlines() if line.strip())
                if set(states) == set(self.nodes) and all(s == "idle" for s in states.values()):
                    return
            time.sleep(0.25)
        raise SlurmError(f"nodes not idle after {timeout:.0f} s: {states}\n{self.logs()}")

    def stop(self, timeout: float = 30) -> None:
        """Cancel the cluster's jobs, then end its slurmd, slurmctld and munged (in that order)."""
        if "slurmctld" in self.processes and self.processes["slurmctld"].poll() is None:
            jobs = self.run(["squeue", "--noheader", "--format=%i"], check=False).stdout.split()
            if jobs:
                self.run(["scancel", "--full", *jobs], check=False)
                self.run(["scancel", *jobs], check=False)
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline and self.run(
                        ["squeue", "--noheader", "--format=%i"], check=False).stdout.split():
                    time.sleep(0.5)
        order = [n for n in self.processes if n.startswith("slurmd-")] + ["slurmctld", "munged"]
        for name in order:
            process = self.processes.get(name)
            if process is None or process.poll() is not None:
                continue
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()

    # -- commands -----------------------------------------------------------------------------------

    def run(self, argv: Sequence[str], *, check: bool = True, env: dict | None = None, replace_env: bool = False,
            cwd: str | Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        """A SLURM command against this cluster, in :attr:`env` updated with ``env`` (or in ``env``
        alone with ``replace_env``; ``SLURM_CONF`` is always this cluster's)."""
        environment = {**(env or {})} if replace_env else {**self.env, **(env or {})}
        result = subprocess.run(list(argv), env={**environment, "SLURM_CONF": str(self.conf)},
                                cwd=cwd, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise SlurmError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def sbatch(self, argv: Sequence[str], *, env: dict | None = None, replace_env: bool = False,
               cwd: str | Path | None = None) -> int:
        """Submit a batch job (it gets the environment :meth:`run` gives sbatch); its id."""
        out = self.run(["sbatch", "--parsable", *argv], env=env, replace_env=replace_env, cwd=cwd).stdout.strip()
        return int(out.split(";")[0])

    def job(self, job_id: int, *, attempts: int = 5) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, StdOut, ...). Retried: on a
        loaded machine a client can lose its connection to slurmctld (seen: scontrol killed by SIGPIPE)."""
        for attempt in range(attempts):
            result = self.run(["scontrol", "--oneliner", "show", "job", str(job_id)], check=attempt == attempts - 1)
            if result.returncode == 0:
                return dict(re.findall(r"(\w+(?:/\w+)?)=(\S*)", result.stdout))
            time.sleep(1)
        raise AssertionError("unreachable")

    def wait(self, job_id: int, *, states: set[str] = FINAL_STATES, timeout: float = 300,
             poll: float = 1) -> dict[str, str]:
        """Wait until the job is in one of ``states``; its :meth:`job` record."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            self._check_alive()
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(poll)
        raise SlurmError(f"job {job_id} not in {sorted(states)} after {timeout:.0f} s: {info}")


@contextlib.contextmanager
def start_cluster(root: Path | None = None, *, nodes: int = 1, verbose: bool = False) -> Iterator[SlurmCluster]:
    """Start a private cluster under ``root`` (a new folder in /tmp when None; munged's socket path
    must be short and its folders reachable by all, which pytest's 0700 temporary folders are not)."""
    owned = root is None
    root = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp")) if owned else root
    os.chmod(root, 0o755)
    cluster = SlurmCluster(root, nodes=nodes, verbose=verbose)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        if owned:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--root", type=Path, default=None, help="folder for the cluster (kept) [a new one in /tmp]")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    if args.root:
        args.root.mkdir(parents=True, exist_ok=False)
    with start_cluster(args.root, nodes=args.nodes, verbose=args.verbose) as c:
        print(f"export SLURM_CONF={c.conf}   # nodes {' '.join(c.nodes)}, partition {c.partition}", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
