"""What each kind of device can do, from the vendors' datasheets: dense peak FLOP/s (what MFU is
measured against and what the cost model assumes a share of) and memory (what ``--dry-run --gpu
KIND`` checks a run's estimate against); and the one rule that names a device's kind.

Standard library only (and ``config_loading``): the GPU suite (``benchmarks/gpu_suite.py``) names
its visit folders by :func:`device_kind` in a process that must stay light.
"""

from __future__ import annotations

import re

from megatron_ext.config_loading import UserError

CPU = "cpu"
"""The kind of a CPU-only machine (no peak: measured or calibrated speeds only)."""

PEAK_TFLOPS = {
    # Dense peak TFLOP/s per device, no sparsity: (bf16, fp8); matched as a substring of the device
    # name, in this order. Sources: the vendors' datasheets.
    "H100": (989.0, 1979.0),    # NVIDIA H100 Tensor Core GPU datasheet, SXM (PCIe: 756 / 1,513)
    "H200": (989.0, 1979.0),    # NVIDIA H200 Tensor Core GPU datasheet, SXM
    "B200": (2250.0, 4500.0),   # NVIDIA HGX B200 datasheet, per GPU
    "A100": (312.0, None),      # NVIDIA A100 Tensor Core GPU datasheet (no FP8)
    "L40S": (362.05, 733.0),    # NVIDIA L40S datasheet
    "MI300X": (1307.4, 2614.9),  # AMD Instinct MI300X datasheet
    "MI250X": (383.0, None),    # AMD Instinct MI250X datasheet: the whole OAM module, two GCDs of 191.5
}

GPU_MEMORY_GIB = {
    # Memory per device (GiB as the vendors' datasheets state GB of HBM), by PEAK_TFLOPS's kinds.
    "H100": 80, "H200": 141, "B200": 180, "A100": 80, "L40S": 48, "MI300X": 192, "MI250X": 128,
}
"""What ``--dry-run --gpu KIND`` checks the estimate against (A100: the 80 GB model)."""


def peak_flops_per_device(device_name: str, *, fp8: bool = False) -> float | None:
    """Dense peak FLOP/s of a known GPU by (substring of) its name, else None."""
    for key, (bf16, f8) in PEAK_TFLOPS.items():
        if key in device_name:
            value = f8 if fp8 else bf16
            return value * 1e12 if value else None
    return None


def device_kind(device: str) -> str:
    """The kind of a recorded device name, as visit folders are named: ``NVIDIA H100 80GB HBM3`` ->
    ``h100``, ``NVIDIA H200`` -> ``h200``, ``AMD Instinct MI300X`` -> ``mi300x``, ``cpu2`` -> ``cpu``;
    a name with no model number gives its slug."""
    if device.lower().startswith("cpu"):
        return "cpu"
    match = re.search(r"\b([A-Z]{1,2}\d{2,3}[A-Z]?)\b", device)
    return match.group(1).lower() if match else re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_")


def known_kind(device: str) -> str | None:
    """The kind of a recorded device name as :data:`PEAK_TFLOPS` spells it (``NVIDIA H100 80GB HBM3``
    -> ``H100``, ``cpu2`` -> ``cpu``; :func:`device_kind`, the rule visit folders are named by), or
    None for a kind with no known peak."""
    kind = device_kind(device)
    return CPU if kind == CPU else next((known for known in PEAK_TFLOPS if known.lower() == kind), None)


def gpu_kind(name: str) -> str:
    """``name`` (``--gpu``) as a kind of :data:`PEAK_TFLOPS` (case-insensitive) or :data:`CPU`; a
    clear error otherwise."""
    if name.lower() == CPU:
        return CPU
    for kind in PEAK_TFLOPS:
        if kind.lower() == name.lower():
            return kind
    raise UserError(f"--gpu {name}: unknown GPU kind; known: {', '.join(PEAK_TFLOPS)}, {CPU}")


def this_machine_kind() -> str:
    """The kind of this machine's GPU (or :data:`CPU`); an unknown GPU is named as an error."""
    from megatron_ext import hardware  # torch: not for the light readers of this module

    name = hardware.device_name() if hardware.on_gpu() else None
    if not name:
        return CPU
    kind = known_kind(name)
    if kind is None:
        raise UserError(f"this machine's GPU ({name}) has no known peak: give --gpu KIND "
                        f"({', '.join(PEAK_TFLOPS)})")
    return kind
