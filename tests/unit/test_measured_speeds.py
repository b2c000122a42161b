"""``megatron_ext.performance.measured_speeds``: a folder of one's own is read as the packaged speeds
are, each record with its provenance, and adds to them."""

from __future__ import annotations

import json

from megatron_ext.performance import measured_speeds


def test_a_folder_of_ones_own_is_read_with_its_provenance(tmp_path):
    row = {"model": "1b", "seq_length": 2048, "precision": "bf16", "parameters": 1_000, "tflops": 400.0,
           "tokens_per_s": 50_000.0, "transformer_impl": "te"}
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "throughput_b200.json").write_text(json.dumps(
        {"device": "NVIDIA B200", "commit": "abc1234", "date": "2030-01-02", "rows": [row, {**row, "tflops": None}]}))
    (tmp_path / "mine" / "throughput_broken.json").write_text("{not json")
    (tmp_path / "mine" / "finetune_speed_b200.json").write_text(json.dumps(
        {"device": "NVIDIA B200", "model": "eurobert-210m", "task": "sst2", "parameters": 210_000_000,
         "measurements": {"old": {"config": {"steps": 10, "batch_size": 32}, "median_seconds": {"ours": 99.0}},
                          "new": {"config": {"steps": 300, "batch_size": 32}, "median_seconds": {"ours": 42.0}}}}))
    found = measured_speeds.read_results(tmp_path)
    (only,) = found.throughput
    assert (only.file, only.device, only.provenance, only.flops_per_s) == (
        "mine/throughput_b200.json", "NVIDIA B200", "commit abc1234, 2030-01-02", 400e12)
    (speed,) = found.finetune
    assert (speed.label, speed.steps, speed.seconds) == ("new", 300, 42.0)
    assert speed.describe().startswith("mine/finetune_speed_b200.json ('new'): NVIDIA B200, commit unknown")
    both = measured_speeds.packaged() + found
    assert len(both.throughput) == len(measured_speeds.packaged().throughput) + 1
