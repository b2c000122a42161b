"""A multi-node job's stop line says where the signal came: the stop reason agreed by every rank
(``StopPolicy.reason_to_stop``, a collective) names the lowest rank a SIGUSR1 reached, else the lowest
a stop signal reached, and its node; the trainer's banner names rank 0's node (``hardware.placement``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

from megatron_ext import hardware

WORKER = textwrap.dedent("""
    import json, os, signal, sys, time
    import torch, torch.distributed as dist
    from megatron_ext import process_group
    from megatron_ext.training.stop import StopPolicy
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    gathered = tuple(process_group.rank_nodes())  # each rank's SLURMD_NODENAME
    for signals, named in json.loads(sys.argv[1]):
        sent = {int(r): getattr(signal, name) for r, name in (pair.split(":") for pair in signals.split(",") if pair)}
        stop = StopPolicy(handle_signals=True, duration_minutes=None, interval=None,
                          rank_nodes=gathered if named else ())
        with stop.signals_handled():
            if rank in sent:
                os.kill(os.getpid(), sent[rank])
                time.sleep(0.1)
            print(json.dumps(str(stop.reason_to_stop(1, torch.device("cpu")))), flush=True)
    dist.destroy_process_group()
""")

# (signals sent, whether the ranks' nodes are known) -> what rank 0 and rank 2 of 3 say
CASES = {
    ("2:SIGUSR1", True): ("signal SIGUSR1 on rank 2 (b02)", "signal SIGUSR1"),
    ("2:SIGUSR1", False): ("signal SIGUSR1 on rank 2", "signal SIGUSR1"),
    # a SIGTERM on rank 1 and a SIGUSR1 on rank 2: the warning wins (a launcher requeues on it)
    ("1:SIGTERM,2:SIGUSR1", True): ("signal SIGUSR1 on rank 2 (b02)", "signal SIGUSR1"),
    ("1:SIGTERM,2:SIGTERM", True): ("a signal on rank 1 (a01)", "signal SIGTERM"),
    ("0:SIGINT", True): ("signal SIGINT", "a signal on rank 0 (a01)"),
    ("", True): ("None", "None"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_stop_reason_names_the_rank_and_node_the_signal_reached():
    world, port, cases = 3, _free_port(), list(CASES)
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(cases)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "SLURMD_NODENAME": ("a01", "a01", "b02")[rank], "RANK": str(rank),
                                   "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "OMP_NUM_THREADS": "1"})
             for rank in range(world)]
    said = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        said.append([json.loads(line) for line in out.splitlines()])
    assert {case: (said[0][i], said[2][i]) for i, case in enumerate(cases)} == CASES


def test_the_banner_names_each_ranks_node():
    assert hardware.placement(["a01"] * 8 + ["b02"] * 8) == "16 ranks on 2 nodes (a01: ranks 0-7, b02: ranks 8-15); this log is rank 0's"
    assert hardware.placement(["a01", "b02", "a01"]) == "3 ranks on 2 nodes (a01: ranks 0,2, b02: rank 1); this log is rank 0's"
    assert hardware.placement(["a01"]) == "1 rank on a01"
    assert hardware.placement(["a01", "a01"]) == "2 ranks on a01"


def test_a_single_process_gathers_its_own_node_name(monkeypatch):
    from megatron_ext import process_group

    monkeypatch.setenv("SLURMD_NODENAME", "gpu-a01")
    assert process_group.rank_nodes() == ["gpu-a01"]
