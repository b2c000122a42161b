"""Process-group start-up and teardown: ``torch.distributed`` and Megatron's model-parallel groups,
on CPU (gloo, Megatron's CUDA calls redirected: ``cuda_on_cpu``) and GPU (nccl, one device per
local rank) alike (``hardware``, divergence 1)."""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from megatron_ext import hardware
from megatron_ext import megatron_compat
from megatron_ext.megatron_compat import cuda_on_cpu


def distributed_backend() -> str:
    """``torch.distributed`` backend for this platform."""
    return "nccl" if hardware.on_gpu() else "gloo"


def init_process_group_and_model_parallel(
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    seed: int = 1234,
    init_method: str = "env://",
    rank: int | None = None,
    world_size: int | None = None,
    timeout_minutes: int = 30,
) -> None:
    """Start ``torch.distributed`` (if not started) and Megatron's model-parallel groups.

    Args:
        tensor_parallel_size: Tensor-parallel size.
        pipeline_parallel_size: Pipeline-parallel size; data parallelism takes the rest. Whether the
            world size divides is the pre-flight's rule (``training.layout.check_layout``, checked
            before a run starts); Megatron's ``initialize_model_parallel`` refuses it too.
        seed: Seed for parameter initialisation (same on every rank; ``hardware``, divergences 3 and 4).
        init_method: ``torch.distributed`` rendezvous; ``env://`` reads ``MASTER_ADDR``,
            ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE`` as set by torchrun or SLURM scripts.
        rank: This process's rank; ``None`` reads ``RANK`` (default 0).
        world_size: Number of processes; ``None`` reads ``WORLD_SIZE`` (default 1).
        timeout_minutes: Collective timeout.

    On CPU this also redirects Megatron's CUDA calls to the CPU (``cuda_on_cpu``), until ``destroy_process_group_and_model_parallel``
    (after checking the megatron-core version first, so a refused version starts nothing).
    """
    if not hardware.on_gpu():
        megatron_compat.check_megatron_core_version()
    if not dist.is_initialized():
        rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
        if init_method == "env://" and world_size == 1 and "MASTER_PORT" not in os.environ:
            # A lone process (no torchrun) still needs a rendezvous: a file store, no TCP port (a
            # probed "free" port can be taken by another process before the store binds it).
            global _rendezvous_dir
            _rendezvous_dir = tempfile.mkdtemp(prefix="megatron_ext_rendezvous_")
            init_method = f"file://{_rendezvous_dir}/store"
        if hardware.on_gpu():
            local_rank = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
            torch.cuda.set_device(local_rank)
        dist.init_process_group(
            backend=distributed_backend(),
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel_size,
        pipeline_model_parallel_size=pipeline_parallel_size,
        distributed_timeout_minutes=timeout_minutes,
    )
    hardware.seed_model_parallel(seed)
    cuda_on_cpu.redirect_cuda_calls()  # on until destroy_process_group_and_model_parallel


_rendezvous_dir: str | None = None
"""Directory of a lone process's file-store rendezvous (removed on teardown)."""


def destroy_process_group_and_model_parallel() -> None:
    """Undo ``init_process_group_and_model_parallel`` (tests, tools that run twice), the CUDA-call
    redirection included."""
    global _rendezvous_dir
    from megatron.core import parallel_state
    try:
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        if _rendezvous_dir is not None:  # a lone process's file store
            shutil.rmtree(_rendezvous_dir, ignore_errors=True)
            _rendezvous_dir = None
    finally:
        cuda_on_cpu.stop_redirecting_cuda_calls()


def rank_nodes() -> list[str]:
    """Every rank's node name, by global rank (``processes.node_name``): a collective, called by every
    rank once as a run starts, so that rank 0's log can say where each rank runs."""
    from megatron_ext.processes import node_name

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [node_name()]
    names: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(names, node_name())
    return [str(name) for name in names]
