"""Megatron-Core's CUDA-only calls redirected to the CPU: how the same Megatron engine (and the same
checkpoint writer) runs on CPU over gloo and on GPU (``hardware``, divergence 7).

Megatron-Core outside the model (its DDP, optimizers, gradient clipping, forward-backward
schedules, pipeline p2p included, and the distributed-checkpoint save) places small tensors on
CUDA, uses CUDA streams and checks for ``torch.cuda`` tensor types even when every parameter is on
the CPU. On CPU, ``process_group.init_process_group_and_model_parallel`` turns this redirection on
for the whole process (:func:`redirect_cuda_calls`), until
``process_group.destroy_process_group_and_model_parallel`` (:func:`cuda_calls_not_redirected` turns
it off for a while, e.g. in a test), pinned to the megatron-core release it was checked against
(``megatron_compat.MEGATRON_CORE_VERSION``). Megatron also picks Transformer Engine's or apex's CUDA
multi-tensor kernels (gradient norm and clipping, main-parameter copies) and fused optimizers
(FusedAdam/FusedSGD) whenever they import, whatever the tensors' device: on a CPU machine with TE
installed the first optimizer step died in ``clip_grads.py`` ("no CUDA-capable device is
detected"). While the redirection is on, those module attributes hold Megatron's local torch
implementations and torch's AdamW/SGD, as when neither imports (``_megatron_torch_kernels`` lists
each one), and get their originals back when it is off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

from megatron_ext import hardware
from megatron_ext.megatron_compat import check_megatron_core_version, installed_megatron_core_version


def _is_cuda(device) -> bool:
    return isinstance(device, (str, torch.device)) and str(device).startswith("cuda")


class _CudaToCpu(TorchFunctionMode):
    """Tensor-level half of the redirection: CUDA placements become CPU ones, and a CPU tensor's
    ``type()`` answers with its ``torch.cuda`` name (Megatron's optimizers dispatch on it)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _NoStream:
    """Stands in for ``torch.cuda.Stream``: CPU work is ordered already."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


_CUDA_STAND_INS = {
    "current_device": lambda: torch.device("cpu"),
    "synchronize": lambda device=None: None,
    "empty_cache": lambda: None,
    "Stream": _NoStream,
    "current_stream": lambda device=None: _NoStream(),
    "stream": lambda stream=None: contextlib.nullcontext(),
}
_redirection: tuple[_CudaToCpu, dict, dict] | None = None
"""While the redirection is on: the mode entered, the ``torch.cuda`` functions it replaced, and the
Megatron-Core module attributes it replaced (``{(module, attribute): original}``)."""


def _megatron_torch_kernels() -> dict[tuple[str, str], object]:
    """Module attribute -> value for every place megatron-core 0.19.2 chooses Transformer Engine's
    or apex's CUDA kernels at import (``try: from transformer_engine... except ImportError: try:
    apex... except ImportError: <local>``), set to what it chooses when neither imports: its local
    torch multi-tensor functions and torch's optimizers. Those choices are made once per process,
    whatever the tensors' device, so a CPU run on a machine where TE or apex imports would reach a
    CUDA kernel (TE's ``multi_tensor_applier`` at the first gradient clipping: "no CUDA-capable
    device is detected")."""
    from megatron.core.utils import local_multi_tensor_applier, local_multi_tensor_l2_norm, local_multi_tensor_scale

    clip_grads, optimizer = "megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"
    package, distributed = "megatron.core.optimizer", "megatron.core.optimizer.distrib_optimizer"
    return {
        # Gradient norm and clipping (get_grad_norm_fp32, clip_grad_by_total_norm_fp32); no tensor
        # scale kernel: the norm is then a float, as without TE.
        (clip_grads, "multi_tensor_applier"): local_multi_tensor_applier,
        (clip_grads, "l2_norm_impl"): local_multi_tensor_l2_norm,
        (clip_grads, "multi_tensor_scale_impl"): local_multi_tensor_scale,
        (clip_grads, "multi_tensor_scale_tensor_impl"): None,
        # Main-parameter copies of the mixed-precision optimizer (_multi_tensor_copy_this_to_that).
        (optimizer, "multi_tensor_applier"): local_multi_tensor_applier,
        (optimizer, "multi_tensor_scale_impl"): local_multi_tensor_scale,
        # get_megatron_optimizer: torch's AdamW/SGD instead of TE's (or apex's) FusedAdam/FusedSGD
        # (CUDA kernels; torch's AdamW runs fused on CPU, training.optim.set_fused_adam).
        (package, "USING_PYTORCH_OPTIMIZER"): True,
        (package, "Adam"): torch.optim.AdamW,
        (package, "SGD"): torch.optim.SGD,
        # The distributed optimizer's state handling follows the optimizer actually built.
        (distributed, "HAVE_APEX_OR_TE"): False,
        (distributed, "USING_TE_OPTIMIZER"): False,
        (distributed, "USING_APEX_OPTIMIZER"): False,
        (distributed, "Adam"): torch.optim.Adam,
    }


def redirect_cuda_calls() -> None:
    """Turn the redirection on for this process (CPU only; already on: nothing to do).

    megatron-core 0.19.2's DDP, optimizers, gradient clipping, pipeline schedules and
    distributed-checkpoint save place small tensors with ``device="cuda"`` or
    ``torch.cuda.current_device()`` (the optimizers' step and gradient norm, the pipeline
    schedules and their p2p communication, the distributed-checkpoint save), order work with
    CUDA streams and ``torch.cuda.synchronize`` (the gradient buffers, the async file writer)
    and accept parameters only if ``param.type()`` names a ``torch.cuda`` type (the
    distributed optimizer). While on: those placements are the CPU, streams and synchronisation
    do nothing, and ``type()`` gives the ``torch.cuda`` name (a ``TorchFunctionMode`` of this
    thread and stand-ins in ``torch.cuda``). Where Transformer Engine or apex imports, Megatron
    chose their CUDA multi-tensor kernels and fused optimizers at import: while on, its modules
    hold the local torch ones instead (``_megatron_torch_kernels``).

    The list was checked against megatron-core ``MEGATRON_CORE_VERSION`` only: with any
    other version this raises ``RuntimeError`` rather than risk a call it does not cover.
    """
    global _redirection
    if hardware.on_gpu() or _redirection is not None:
        return
    check_megatron_core_version()
    import importlib

    kernels = _megatron_torch_kernels()
    modules = {name: importlib.import_module(name) for name, _ in kernels}
    missing = [f"{module}.{attribute}" for module, attribute in kernels if not hasattr(modules[module], attribute)]
    if missing:  # the version pin makes this a mistake in the list: nothing is replaced
        raise RuntimeError(f"{', '.join(missing)} not found in megatron-core {installed_megatron_core_version()}; "
                           "update megatron_ext.megatron_compat.cuda_on_cpu._megatron_torch_kernels")
    replaced_kernels = {(module, attribute): getattr(modules[module], attribute) for module, attribute in kernels}
    for (module, attribute), local in kernels.items():
        setattr(modules[module], attribute, local)
    replaced = {name: getattr(torch.cuda, name) for name in _CUDA_STAND_INS}
    for name, stand_in in _CUDA_STAND_INS.items():
        setattr(torch.cuda, name, stand_in)
    mode = _CudaToCpu()
    mode.__enter__()
    _redirection = (mode, replaced, replaced_kernels)


def stop_redirecting_cuda_calls() -> None:
    """Turn the redirection off again (off already: nothing to do)."""
    global _redirection
    if _redirection is None:
        return
    mode, replaced, replaced_kernels = _redirection
    if torch.overrides._get_current_function_mode_stack()[-1:] != [mode]:
        raise RuntimeError("the CUDA-call redirection is being turned off inside another TorchFunctionMode; "
                           "leave that mode first")
    _redirection = None
    mode.__exit__(None, None, None)
    for name, original in replaced.items():
        setattr(torch.cuda, name, original)
    import sys

    for (module, attribute), original in replaced_kernels.items():
        setattr(sys.modules[module], attribute, original)


def cuda_calls_redirected() -> bool:
    """Whether the redirection is on in this process (always False on GPU)."""
    return _redirection is not None


@contextlib.contextmanager
def cuda_calls_not_redirected() -> Iterator[None]:
    """The redirection off inside the block (e.g. a test of real ``torch.cuda`` behaviour), back on
    after it if it was on."""
    was_on = cuda_calls_redirected()
    stop_redirecting_cuda_calls()
    try:
        yield
    finally:
        if was_on:
            redirect_cuda_calls()


def check_megatron_runs_here(what: str) -> None:
    """Raise ``RuntimeError`` when ``what`` (Megatron-Core code outside the model) would reach
    for CUDA on a CPU process whose process group was not set up by
    ``init_process_group_and_model_parallel`` (which turns the redirection on)."""
    if not hardware.on_gpu() and not cuda_calls_redirected():
        raise RuntimeError(
            f"{what} runs Megatron-Core code that calls CUDA; on CPU those calls are redirected from "
            "megatron_ext.process_group.init_process_group_and_model_parallel on: set up the process group with it")
