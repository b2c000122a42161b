"""Where megatron_ext works around megatron-core, all pinned to the one release they were checked
against (:data:`MEGATRON_CORE_VERSION`, requirements.txt's pin). Moving to another release means
reading each module below against it, then changing the version here:

- ``cuda_on_cpu``: Megatron-Core's CUDA-only calls (DDP, optimizers, schedules, checkpoint save)
  redirected to the CPU, and TE/apex kernels swapped for Megatron's local torch ones on a CPU
  machine; refuses to start under another release (:func:`check_megatron_core_version`).
- ``optimizer``: the distributed optimizer's checkpoint load with torch's Adam (no TE/apex): the
  state allocated before a load, the per-parameter ``step`` kept and restored.
- ``checkpoint_results``: the checkpoint writers' results queue, owned and shut down here instead of
  Megatron's never-closed ``Manager()``.
- ``datasets``: what ``training.datasets`` reads of Megatron's datasets beyond their documented use
  (the split rounding, ``GPTDataset``'s sample and epoch counts and shuffle threshold, the C++
  blending index, one epoch built with no sizes), to plan reads without building anything and to
  read each source as its own stream.

Elsewhere the code uses megatron-core as documented; where it reads a private detail (a threshold,
an attribute), the docstring there names the release.
"""

from __future__ import annotations

MEGATRON_CORE_VERSION = "0.19.2"
"""The megatron-core release every workaround in this package was checked against."""


def installed_megatron_core_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("megatron-core")


def check_megatron_core_version() -> None:
    """Refuse (``RuntimeError``) to patch a megatron-core release the workarounds were not checked
    against: a call they do not cover would fail later, far from its cause."""
    installed = installed_megatron_core_version()
    if installed != MEGATRON_CORE_VERSION:
        raise RuntimeError(
            f"megatron-core {installed} is installed, but megatron_ext runs Megatron-Core's DDP, optimizer, "
            f"schedules and checkpoint save on CPU only for megatron-core {MEGATRON_CORE_VERSION}, whose "
            "CUDA-only calls it redirects (megatron_ext/megatron_compat/cuda_on_cpu.py). Install "
            f"megatron-core=={MEGATRON_CORE_VERSION} (requirements.txt), or check megatron_ext/megatron_compat/ "
            "against the new release and update MEGATRON_CORE_VERSION")
