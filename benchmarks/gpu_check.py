"""Run the GPU tests and record their outcome, so the state of the GPU path is visible without a GPU.

    .venv/bin/python benchmarks/gpu_check.py        # on a CUDA machine

Runs ``pytest -m gpu tests/test_gpu.py`` and writes ``benchmarks/results/gpu_check_<device>.json``:
one pass/fail/skip line per test, device name and compute capability, driver, torch / CUDA /
Transformer Engine / megatron-core versions, and, when the bf16 and FP8 biphasic runs both
passed, the FP8-vs-bf16 training-loss gap over their last 20 steps of each phase. Exits with
pytest's code. Without CUDA it says so and exits 2 (nothing is written).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO))

from megatron_ext import platform  # noqa: E402


def loss_gap(out: Path, recipe: str) -> dict | None:
    """Mean |FP8 - bf16| training loss per phase window (last 20 steps of CLM and of MLM)."""
    bf16, fp8 = out / "biphasic_bf16.json", out / f"biphasic_{recipe}.json"
    if not (bf16.is_file() and fp8.is_file()):
        return None
    a = {int(k): v for k, v in json.loads(bf16.read_text())["losses"].items()}
    b = {int(k): v for k, v in json.loads(fp8.read_text())["losses"].items()}
    windows = {"clm_steps_81_100": range(81, 101), "mlm_steps_181_200": range(181, 201)}
    return {name: {"bf16": sum(a[s] for s in w) / len(w), "fp8": sum(b[s] for s in w) / len(w),
                   "mean_abs_gap": sum(abs(a[s] - b[s]) for s in w) / len(w)} for name, w in windows.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not platform.on_gpu():
        print("gpu_check.py: no CUDA device here; the GPU tests only run on a GPU machine", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GPU_CHECK_OUT": tmp}
        run = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-rA", "-p", "no:cacheprovider",
                              "tests/test_gpu.py"], cwd=REPO, env=env, capture_output=True, text=True)
        print(run.stdout[-20000:], run.stderr[-5000:], sep="\n")
        lines = [line for line in run.stdout.splitlines()
                 if re.match(r"^(PASSED|FAILED|SKIPPED|ERROR) ", line) or re.search(r"::\S+ (PASSED|FAILED|SKIPPED|ERROR)", line)]
        gaps = {recipe: loss_gap(Path(tmp), recipe) for recipe in ("delayed", "tensorwise")}
    import torch

    name = platform.device_name()
    record = {"device": name, "compute_capability": ".".join(map(str, torch.cuda.get_device_capability())),
              **platform.software_versions(), "pytest_exit_code": run.returncode, "tests": lines, "fp8_vs_bf16_loss": gaps}
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / f"gpu_check_{re.sub(r'[^A-Za-z0-9]+', '_', name).strip('_').lower()}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
