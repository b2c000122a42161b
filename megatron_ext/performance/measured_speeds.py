"""The measured-speed table: typed records of the speeds the benchmarks measured, read from their
result files, and the committed ones shipped inside the package.

Records (each with its provenance, resolved when the record is made: file, device, commit, date):

- :class:`ThroughputRow`: one device's training FLOP/s for a shape (model, sequence length, precision,
  layer implementation), from ``benchmarks/throughput.py``'s ``throughput*.json``; a timed variant
  that ran the same step another way (:data:`SAME_FLOPS_SETTINGS`) is a row of its own.
- :class:`FinetuneSpeed`: the seconds of one fine-tuning run, from ``benchmarks/finetune_speed.py``'s
  ``finetune_speed*.json``.

Where they come from:

- :func:`packaged`: the committed measurements shipped with the package (``megatron_ext/measured/
  measurements.json``), so that an installed package prices runs from the same measured speeds as a
  clone. ``python -m benchmarks.measured_refresh --refresh benchmarks/results`` rewrites it from a
  checkout's results, with each file's provenance from git (:func:`read_results`' ``added``);
  ``tests/unit/test_measured_refresh.py`` checks it is current.
- :func:`read_results`: a results folder of the user's own (``--results-dir``,
  ``$MEGATRON_EXT_RESULTS_DIR``), read the same way; a record's provenance is its own ``commit`` and
  ``date``, else the date in its path (no git is asked here).

The GPU suite's visit folders (their summaries, sides and gpu-test reports) are the benchmarks'
(``benchmarks/gpu_visits.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

PACKAGED_FILE = "measurements.json"
"""In the package's ``measured`` folder."""

MEASURED_FINETUNE_PARAMETERS = {"all-MiniLM-L6-v2": 22_713_216}
"""Parameters of the models early ``finetune_speed`` records name without a count."""

SAME_FLOPS_SETTINGS = frozenset({"transformer_impl", "cuda_graphs", "gradient_accumulation_fusion", "rope_fusion"})
"""Settings that change how a step runs but not its FLOPs per token: a throughput variant that
differs from its row only in these is a speed of the same step (the row's FLOP/s scaled by tokens/s)."""


@dataclass(frozen=True, kw_only=True)
class ThroughputRow:
    """One device's training FLOP/s for one shape."""

    file: str
    """The result file, relative to its results folder."""
    device: str
    provenance: str
    """``commit abc1234, 2026-11-24`` (the commit that made or added the file, and the date)."""
    model: str
    parameters: int
    seq_length: int
    precision: str
    backend: str | None
    """The layer implementation (``local``, ``te``) when recorded."""
    flops_per_s: float
    date: str
    variant: str | None = None
    """The throughput variant it was timed as (None: the row's default side)."""


@dataclass(frozen=True, kw_only=True)
class FinetuneSpeed:
    """The time of one fine-tuning run of ours, as ``benchmarks/finetune_speed.py`` measured it."""

    file: str
    device: str
    provenance: str
    label: str
    """The measurement's name inside its file (the newest of the file is the one kept)."""
    model: str
    task: str
    parameters: int
    steps: int
    batch_size: int
    seconds: float

    def describe(self) -> str:
        return (f"{self.file} ('{self.label}'): {self.device}, {self.provenance}: {self.model} {self.task} "
                f"{self.steps} steps in {self.seconds:.0f} s")


@dataclass(frozen=True, kw_only=True)
class MeasuredSpeeds:
    """The speeds a cost is priced from: the packaged ones, plus those of a folder of one's own."""

    throughput: tuple[ThroughputRow, ...] = ()
    finetune: tuple[FinetuneSpeed, ...] = ()

    def __add__(self, other: MeasuredSpeeds) -> MeasuredSpeeds:
        return MeasuredSpeeds(throughput=self.throughput + other.throughput, finetune=self.finetune + other.finetune)


def _same_flops_variants(row: dict) -> Iterator[tuple[str, dict, dict]]:
    """The timed variants of a throughput row (``benchmarks/throughput.py --variants``) that ran the
    row's step with other :data:`SAME_FLOPS_SETTINGS`: (name, variant, its settings)."""
    default = row.get("settings") or {}
    for name, variant in (row.get("variants") or {}).items():
        settings = variant.get("settings") or {}
        if (not variant.get("tokens_per_s") or variant.get("error") or not settings or not default
                or not row.get("tokens_per_s") or "transformer_impl" not in settings):
            continue
        changed = {key for key in default.keys() | settings.keys() if default.get(key) != settings.get(key)}
        if changed and changed <= SAME_FLOPS_SETTINGS:
            yield name, variant, settings


def _throughput_rows(relative: str, record: dict, provenance: str, date: str) -> list[ThroughputRow]:
    rows = []
    for row in record["rows"]:
        if not row.get("tflops") or not row.get("parameters") or row.get("error"):
            continue
        measured = functools.partial(ThroughputRow, file=relative, device=record["device"], provenance=provenance,
                                     model=str(row.get("model")), parameters=int(row["parameters"]),
                                     seq_length=int(row["seq_length"]), precision=str(row["precision"]), date=date)
        # The layer implementation under its name of the time (``attention_backend`` before the rename).
        backend = row.get("transformer_impl") or row.get("attention_backend")
        rows.append(measured(backend=backend, flops_per_s=float(row["tflops"]) * 1e12))
        rows.extend(measured(backend=settings["transformer_impl"],
                             flops_per_s=float(row["tflops"]) * 1e12 * variant["tokens_per_s"] / row["tokens_per_s"],
                             variant=name)
                    for name, variant, settings in _same_flops_variants(row))
    return rows


def _finetune_speed(relative: str, record: dict, provenance: str) -> FinetuneSpeed | None:
    if not record.get("measurements") or "device" not in record:
        return None
    label, measurement = list(record["measurements"].items())[-1]
    parameters = record.get("parameters") or MEASURED_FINETUNE_PARAMETERS.get(record.get("model"))
    if parameters is None:
        return None
    config = measurement["config"]
    return FinetuneSpeed(file=relative, device=record["device"], provenance=provenance, label=label,
                         model=str(record.get("model")), task=str(record.get("task")), parameters=int(parameters),
                         steps=int(config["steps"]), batch_size=int(config["batch_size"]),
                         seconds=float(measurement["median_seconds"]["ours"]))


def read_results(results_dir: Path, *, added: Mapping[str, tuple[str, str]] | None = None) -> MeasuredSpeeds:
    """Every throughput row and fine-tuning speed of the result files below ``results_dir``. Files
    that are not such records are passed over. ``added``: ``{path relative to results_dir: (commit,
    date)}`` of the commit that added each file (``benchmarks/measured_refresh.py`` asks git), the
    provenance of a record that names no commit of its own."""
    added = added or {}
    throughput: list[ThroughputRow] = []
    finetune: list[FinetuneSpeed] = []
    for path in sorted(results_dir.rglob("*.json")):
        kind = ("throughput" if path.name.startswith("throughput") else
                "finetune" if path.name.startswith("finetune_speed") else None)
        if kind is None:
            continue
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(record, dict):
            continue
        relative = str(path.relative_to(results_dir))
        commit, added_on = added.get(relative, ("", ""))
        dated = re.search(r"\d{4}-\d{2}-\d{2}", relative)
        date = record.get("date") or (dated.group(0) if dated else added_on)
        made = (f"commit {record['commit']}" if record.get("commit") else
                f"added in commit {commit}" if commit else "commit unknown")
        provenance = ", ".join(part for part in (made, date) if part)
        if kind == "throughput" and isinstance(record.get("rows"), list) and "device" in record:
            throughput += _throughput_rows(relative, record, provenance, date)
        elif kind == "finetune" and (speed := _finetune_speed(relative, record, provenance)) is not None:
            finetune.append(speed)
    return MeasuredSpeeds(throughput=tuple(throughput), finetune=tuple(finetune))


def to_json(speeds: MeasuredSpeeds) -> str:
    """The text of the packaged file holding ``speeds`` (what :func:`packaged` reads back)."""
    return json.dumps({"throughput": [dataclasses.asdict(r) for r in speeds.throughput],
                       "finetune": [dataclasses.asdict(r) for r in speeds.finetune]}, indent=1) + "\n"


@functools.cache
def packaged() -> MeasuredSpeeds:
    """The committed measurements shipped with the package (module docstring)."""
    text = resources.files("megatron_ext").joinpath("measured", PACKAGED_FILE).read_text()
    record = json.loads(text)
    return MeasuredSpeeds(throughput=tuple(ThroughputRow(**r) for r in record["throughput"]),
                        finetune=tuple(FinetuneSpeed(**r) for r in record["finetune"]))


def packaged_path() -> Path:
    """The packaged file (``benchmarks/measured_refresh.py`` rewrites it)."""
    return Path(str(resources.files("megatron_ext").joinpath("measured", PACKAGED_FILE)))
