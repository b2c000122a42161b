"""``megatron_ext.measurements``: the committed measurements shipped with the package are what the
checkout's results give (one command refreshes them), each record carries its provenance, and a
folder of one's own is read the same way."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_ext import measurements

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"


def test_the_packaged_measurements_are_the_committed_ones():
    assert measurements.packaged_path().read_text() == measurements.refreshed(RESULTS), (
        "run python -m megatron_ext.measurements --refresh benchmarks/results")
    assert measurements.main(["--check", str(RESULTS)]) == 0
    shipped = measurements.packaged()
    # The 2026-11-27 H100 visit's 1B rows: the recipe's side (local then) and the TE spec's variant.
    at_1b = [r for r in shipped.throughput if r.file.startswith("gpu_visits/h100-2026-11-27/") and r.model == "1b"]
    assert {r.backend for r in at_1b} == {"local", "te"}
    assert all("commit" in r.provenance and r.date == "2026-11-27" for r in at_1b)
    assert any(r.device == "cpu2" for r in shipped.finetune)


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
    found = measurements.read_all(tmp_path)
    (only,) = found.throughput
    assert (only.file, only.device, only.provenance, only.flops_per_s) == (
        "mine/throughput_b200.json", "NVIDIA B200", "commit abc1234, 2030-01-02", 400e12)
    (speed,) = found.finetune
    assert (speed.label, speed.steps, speed.seconds) == ("new", 300, 42.0)
    assert speed.describe().startswith("mine/finetune_speed_b200.json ('new'): NVIDIA B200, commit unknown")
    both = measurements.packaged() + found
    assert len(both.throughput) == len(measurements.packaged().throughput) + 1
