"""Where a benchmark writes its record: ``benchmarks/results/<name>_<device>.json``."""

from __future__ import annotations

import json
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def write_record(name: str, device: str, record: dict, output: Path | None = None) -> Path:
    """Write ``record`` as JSON to ``output``, or to ``results/<name>_<device slug>.json``; returns
    the path (the device as a file-name slug: ``NVIDIA H100 80GB HBM3`` -> ``nvidia_h100_80gb_hbm3``)."""
    path = output or RESULTS / f"{name}_{re.sub(r'[^A-Za-z0-9]+', '_', device).strip('_').lower()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    return path
