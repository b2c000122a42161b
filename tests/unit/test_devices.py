"""``megatron_ext.performance.devices``: one rule names a device's kind, for visit folders and for
the peak table the cost model prices from."""

from __future__ import annotations

from megatron_ext.performance import devices


def test_one_device_kind_rule_names_visit_folders_and_prices_runs():
    kinds = {"NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200", "NVIDIA B200": "b200",
             "NVIDIA A100-SXM4-80GB": "a100", "AMD Instinct MI300X": "mi300x", "cpu2": "cpu",
             "Some Accelerator": "some_accelerator"}
    assert {device: devices.device_kind(device) for device in kinds} == kinds


def test_a_recorded_device_is_priced_as_the_kind_its_visit_folder_is_named():
    """``devices.known_kind`` is ``devices.device_kind`` in the peak table's spelling."""
    assert [devices.known_kind(d) for d in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "cpu2", "NVIDIA GeForce RTX 4090")] == [
        "H100", "H200", devices.CPU, None]
    assert devices.known_kind("NVIDIA H100 80GB HBM3").lower() == devices.device_kind("NVIDIA H100 80GB HBM3")
