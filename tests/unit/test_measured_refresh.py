"""``benchmarks/measured_refresh.py``: the measured speeds shipped with the package are what the
checkout's results give (one command refreshes them), each record with its provenance from git."""

from __future__ import annotations

from pathlib import Path

from benchmarks import measured_refresh
from megatron_ext.performance import measured_speeds

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"


def test_the_packaged_measurements_are_the_committed_ones():
    assert measured_speeds.packaged_path().read_text() == measured_refresh.refreshed(RESULTS), (
        "run python -m benchmarks.measured_refresh --refresh benchmarks/results")
    assert measured_refresh.main(["--check", str(RESULTS)]) == 0
    shipped = measured_speeds.packaged()
    # The 2026-11-27 H100 visit's 1B rows: the recipe's side (local then) and the TE spec's variant.
    at_1b = [r for r in shipped.throughput if r.file.startswith("gpu_visits/h100-2026-11-27/") and r.model == "1b"]
    assert {r.backend for r in at_1b} == {"local", "te"}
    assert all("commit" in r.provenance and r.date == "2026-11-27" for r in at_1b)
    assert any(r.device == "cpu2" for r in shipped.finetune)
