"""Measurements the package owns: typed records of what the benchmarks measured, read from their
result files and shipped inside the package.

Records (each with its provenance, resolved when the record is made: file, device, commit, date):

- :class:`ThroughputRow`: one device's training FLOP/s for a shape (model, sequence length, precision,
  layer implementation), from ``benchmarks/throughput.py``'s ``throughput*.json``; a timed variant
  that ran the same step another way (:data:`SAME_FLOPS_SETTINGS`) is a row of its own.
- :class:`FinetuneSpeed`: the seconds of one fine-tuning run, from ``benchmarks/finetune_speed.py``'s
  ``finetune_speed*.json``.
- :class:`GpuVisit`: one GPU suite visit (``benchmarks/results/gpu_visits/<kind>-<date>[suffix]/``, as
  ``benchmarks/gpu_suite.py`` wrote it): its ``summary.json`` (:class:`VisitStage` per stage), each
  stage's :class:`ThroughputSide` records (``<stage>/throughput.sides.jsonl``) and
  :class:`GpuTestReport` files (``<stage>/gpu_check_*.json``), and the visit's ``fingerprints.json``.
  :func:`read_visits` gives a folder's visits newest first (the one date order every reader uses);
  ``benchmarks/recipe_defaults.py``, ``benchmarks/visit_plan.py`` and ``tools/render_docs.py`` read
  visits only through it.

Where they come from:

- :func:`packaged`: the committed measurements shipped with the package (``megatron_ext/measured/
  measurements.json``), so that an installed package prices runs from the same measured speeds as a
  clone. ``python -m megatron_ext.measurements --refresh benchmarks/results`` rewrites it from a
  checkout's results (provenance from git); ``tests/unit/test_measurements.py`` checks it is current.
- :func:`read_all`: a results folder of the user's own (``--results-dir``, ``$MEGATRON_EXT_RESULTS_DIR``),
  read the same way (provenance from git when the folder is in a repository).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from megatron_ext.config_loading import UserError

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
class Measurements:
    throughput: tuple[ThroughputRow, ...] = ()
    finetune: tuple[FinetuneSpeed, ...] = ()

    def __add__(self, other: Measurements) -> Measurements:
        return Measurements(throughput=self.throughput + other.throughput, finetune=self.finetune + other.finetune)


def _git_added(results_dir: Path) -> dict[str, tuple[str, str]]:
    """``{path relative to results_dir: (commit, date)}`` of the commit that added each file."""
    try:
        top = subprocess.run(["git", "-C", str(results_dir), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=20, check=True).stdout.strip()
        log = subprocess.run(["git", "-C", top, "log", "--diff-filter=A", "--name-only", "--format=@%h %cs", "--",
                              str(results_dir.resolve())], capture_output=True, text=True, timeout=60,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found: dict[str, tuple[str, str]] = {}
    commit = date = ""
    for line in log.splitlines():
        if line.startswith("@"):
            commit, date = line[1:].split(" ", 1)
        elif line.strip():
            path = (Path(top) / line.strip()).resolve()
            try:
                found.setdefault(str(path.relative_to(results_dir.resolve())), (commit, date))
            except ValueError:
                continue
    return found


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


@functools.lru_cache(maxsize=8)
def read_all(results_dir: Path) -> Measurements:
    """Every throughput row and fine-tuning speed of the result files below ``results_dir`` (read
    once per process: a tool may plan many runs). Files that are not such records are passed over."""
    added = _git_added(results_dir)
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
    return Measurements(throughput=tuple(throughput), finetune=tuple(finetune))


def _to_json(measurements: Measurements) -> str:
    return json.dumps({"throughput": [dataclasses.asdict(r) for r in measurements.throughput],
                       "finetune": [dataclasses.asdict(r) for r in measurements.finetune]}, indent=1) + "\n"


@functools.cache
def packaged() -> Measurements:
    """The committed measurements shipped with the package (module docstring)."""
    text = resources.files("megatron_ext").joinpath("measured", PACKAGED_FILE).read_text()
    record = json.loads(text)
    return Measurements(throughput=tuple(ThroughputRow(**r) for r in record["throughput"]),
                        finetune=tuple(FinetuneSpeed(**r) for r in record["finetune"]))


def packaged_path() -> Path:
    return Path(str(resources.files("megatron_ext").joinpath("measured", PACKAGED_FILE)))


def refreshed(results_dir: Path) -> str:
    """What the packaged file holds when refreshed from ``results_dir`` (a checkout's
    ``benchmarks/results``)."""
    read_all.cache_clear()
    return _to_json(read_all(results_dir))


# -- GPU visits: the folders benchmarks/gpu_suite.py writes -------------------------------------

VISIT_SUMMARY = "summary.json"
SIDES_FILE = "throughput.sides.jsonl"
"""In a throughput stage's folder: one line per side as ``benchmarks/throughput.py`` timed it."""
FINGERPRINTS_FILE = "fingerprints.json"
"""In a visit's folder: the fingerprints of the known sides' code in the tree it ran
(``benchmarks/visit_plan.py``)."""
_VISIT_NAME = re.compile(r"^(?P<kind>[^-]+)-(?P<date>\d{4}-\d{2}-\d{2})(?P<suffix>\w*)$")

RENAMED_SETTING_VALUES = {"cuda_graphs": {"local": "megatron"}}
"""Setting values the visits recorded before the value was renamed (``cuda_graphs: local`` is today's
``megatron``): a :class:`ThroughputSide` carries today's spelling; the files stay as measured."""


def device_kind(device: str) -> str:
    """The kind of a recorded device name, as visit folders are named: ``NVIDIA H100 80GB HBM3`` ->
    ``h100``, ``NVIDIA H200`` -> ``h200``, ``AMD Instinct MI300X`` -> ``mi300x``, ``cpu2`` -> ``cpu``;
    a name with no model number gives its slug."""
    if device.lower().startswith("cpu"):
        return "cpu"
    match = re.search(r"\b([A-Z]{1,2}\d{2,3}[A-Z]?)\b", device)
    return match.group(1).lower() if match else re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_")


def _read_json(path: Path, expected: str) -> object:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: missing (expected {expected})") from None
    except OSError as error:
        raise UserError(f"{path}: cannot be read ({error.strerror}); expected {expected}") from None
    except json.JSONDecodeError as error:
        raise UserError(f"{path}: line {error.lineno}: not JSON ({error.msg}); expected {expected}") from None


def _record(value: object, keys: tuple[str, ...], where: str, expected: str) -> dict:
    """``value`` as a JSON object holding ``keys``, or a one-line error naming ``where`` and the key."""
    if not isinstance(value, dict):
        raise UserError(f"{where}: expected {expected} (a JSON object), got {type(value).__name__}")
    missing = [key for key in keys if key not in value]
    if missing:
        raise UserError(f"{where}: no {', '.join(repr(k) for k in missing)} (expected {expected})")
    return value


@dataclass(frozen=True, kw_only=True)
class ThroughputSide:
    """One side (one configuration) of a throughput row a visit timed, as ``benchmarks/throughput.py``
    wrote it. Fields a side recorded only from some date on are None in older records."""

    row: str
    """``1b seq 2048 bf16``: the preset, sequence length and precision."""
    side: str
    """``megatron_ext`` (the recipe's configuration), ``hf``, or a variant of ``throughput.VARIANTS``."""
    tokens_per_s: float | None
    """None: the side did not finish (``error`` says why)."""
    settings: dict | None
    """What the side ran, in today's spelling (:data:`RENAMED_SETTING_VALUES`); None: recorded before
    sides carried their settings (its name says what it ran)."""
    flops_per_token: float | None
    peak_mem_gb: float | None
    error: str | None

    @property
    def micro_batch_size(self) -> int | None:
        return (self.settings or {}).get("micro_batch_size")

    @classmethod
    def from_record(cls, record: object, where: str) -> ThroughputSide:
        record = _record(record, ("row", "side"), where, "a throughput side with its row and side")
        settings = record.get("settings")
        if settings:
            settings = {key: RENAMED_SETTING_VALUES.get(key, {}).get(value, value)
                        for key, value in settings.items()}
        return cls(row=str(record["row"]), side=str(record["side"]), tokens_per_s=record.get("tokens_per_s"),
                   settings=settings, flops_per_token=record.get("flops_per_token"),
                   peak_mem_gb=record.get("peak_mem_gb"), error=record.get("error"))


def read_side_records(stage_dir: Path) -> list[dict]:
    """The lines of a stage's :data:`SIDES_FILE` as written (none when the stage wrote no such file);
    a line that is not a JSON object is refused with its file and line."""
    path = stage_dir / SIDES_FILE
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise UserError(f"{path}:{number}: not JSON ({error.msg}); expected one throughput side a line"
                            ) from None
        records.append(_record(record, ("row", "side"), f"{path}:{number}", "a throughput side: its row and side"))
    return records


def read_sides(stage_dir: Path) -> tuple[ThroughputSide, ...]:
    """A stage's :data:`SIDES_FILE` as typed sides."""
    path = stage_dir / SIDES_FILE
    return tuple(ThroughputSide.from_record(record, str(path)) for record in read_side_records(stage_dir))


@dataclass(frozen=True, kw_only=True)
class GpuTestResult:
    test: str
    """The pytest node id."""
    outcome: str
    """``passed``, ``failed``, ``error``, ``skipped``, ``unfinished``."""
    error: str | None


@dataclass(frozen=True, kw_only=True)
class GpuTestReport:
    """One ``gpu_check_<device>.json`` (``benchmarks/gpu_check.py``): the ``gpu`` tests one run saw."""

    file: Path
    tests: tuple[GpuTestResult, ...]
    collected: int | None
    """How many tests pytest collected (None: reports before gpu_check counted them)."""
    collection_errors: tuple[dict, ...]
    fp8_vs_bf16_loss: dict | None
    pytest_exit_code: int | None

    def passed(self) -> set[str]:
        return {t.test for t in self.tests if t.outcome == "passed"}


def read_gpu_test_report(path: Path) -> GpuTestReport:
    expected = "a gpu_check report (benchmarks/gpu_check.py)"
    record = _record(_read_json(path, expected), ("tests",), str(path), expected)
    tests = []
    for i, test in enumerate(record["tests"]):
        test = _record(test, ("test", "outcome"), f"{path}: tests[{i}]", "a test with its outcome")
        tests.append(GpuTestResult(test=test["test"], outcome=test["outcome"], error=test.get("error")))
    return GpuTestReport(file=path, tests=tuple(tests), collected=record.get("collected"),
                         collection_errors=tuple(record.get("collection_errors") or ()),
                         fp8_vs_bf16_loss=record.get("fp8_vs_bf16_loss"),
                         pytest_exit_code=record.get("pytest_exit_code"))


def read_gpu_test_reports(stage_dir: Path) -> tuple[GpuTestReport, ...]:
    """The ``gpu_check_*.json`` reports in a stage's folder, by name."""
    return tuple(read_gpu_test_report(path) for path in sorted(stage_dir.glob("gpu_check_*.json")))


@dataclass(frozen=True, kw_only=True)
class VisitStage:
    """One stage of a visit as its ``summary.json`` records it."""

    name: str
    status: str
    """``passed``, ``failed``, ``timed_out``, ``skipped``, ``not_applicable``."""
    exit_code: int | None
    reason: str | None
    figures: dict
    """The stage's key figures as the suite's reader for it recorded them (keys depend on the stage)."""
    folder: Path
    """The stage's own files: ``<visit>/<name>/``."""

    @property
    def runs_gpu_tests(self) -> bool:
        """A ``gpu_tests*`` stage (``benchmarks/gpu_check.py``: all ``gpu`` tests or a subset)."""
        return self.name.startswith("gpu_tests")

    @property
    def ran_out_of_time(self) -> bool:
        """Stopped by its time limit: the suite's ``timed_out``, or exit 124 (``timeout``'s convention,
        which suites before 2026-11-27 recorded as ``failed``)."""
        return self.status == "timed_out" or self.exit_code == 124

    def sides(self) -> tuple[ThroughputSide, ...]:
        """The throughput sides the stage timed: those its figures hold (the suite reads them from the
        stage's :data:`SIDES_FILE` when it ends), else the file's (summaries before 2026-11-26 kept none)."""
        if self.figures.get("sides"):
            where = f"{self.folder.parent / VISIT_SUMMARY}: stage {self.name}: sides"
            return tuple(ThroughputSide.from_record(record, f"{where}[{i}]")
                         for i, record in enumerate(self.figures["sides"]))
        return read_sides(self.folder)

    def gpu_test_reports(self) -> tuple[GpuTestReport, ...]:
        return read_gpu_test_reports(self.folder)


@dataclass(frozen=True, kw_only=True)
class GpuVisit:
    """One GPU suite visit: ``<kind>-<YYYY-MM-DD>[suffix]/`` with the ``summary.json`` the suite wrote."""

    folder: Path
    kind: str
    """The folder's prefix (``h100``): :func:`device_kind` of the device the visit ran on."""
    date: str
    suffix: str
    """A letter after the date for a second visit that day (``h200-2026-11-26b``), else empty."""
    device: str
    commit: str | None
    """The commit the suite ran (None: it could not tell)."""
    budget_s: float
    elapsed_s: float
    stages: tuple[VisitStage, ...]

    @property
    def name(self) -> str:
        return self.folder.name

    @property
    def order(self) -> tuple[str, str, str]:
        """Newer visits sort after older: by date, then the same day's suffix (``...-26b`` after
        ``...-26``), then the kind (only to make the order total)."""
        return self.date, self.suffix, self.kind

    def fingerprints(self) -> dict[str, str] | None:
        """The known sides' code fingerprints the visit recorded (:data:`FINGERPRINTS_FILE`), or None."""
        path = self.folder / FINGERPRINTS_FILE
        if not path.is_file():
            return None
        expected = "the fingerprints benchmarks/visit_plan.py writes"
        return _record(_read_json(path, expected), ("sides",), str(path), expected)["sides"]


def read_visit(folder: Path) -> GpuVisit:
    """The visit in ``folder``; a folder not named as a visit, or a missing or malformed
    ``summary.json``, is refused in one line naming the file and what was expected."""
    name = _VISIT_NAME.match(folder.name)
    if name is None:
        raise UserError(f"{folder}: a GPU visit folder is named <kind>-<YYYY-MM-DD>[suffix] "
                        "(h100-2026-11-27, h200-2026-11-26b)")
    path = folder / VISIT_SUMMARY
    expected = "the summary benchmarks/gpu_suite.py writes"
    record = _record(_read_json(path, expected), ("device", "commit", "budget_s", "elapsed_s", "stages"),
                     str(path), expected)
    stages = []
    for i, stage in enumerate(record["stages"]):
        stage = _record(stage, ("name", "status", "exit_code", "reason", "figures"), f"{path}: stages[{i}]",
                        "a stage as the suite records it")
        stages.append(VisitStage(name=stage["name"], status=stage["status"], exit_code=stage["exit_code"],
                                 reason=stage["reason"], figures=stage["figures"] or {},
                                 folder=folder / stage["name"]))
    return GpuVisit(folder=folder, kind=name["kind"], date=name["date"], suffix=name["suffix"],
                    device=record["device"], commit=record["commit"], budget_s=float(record["budget_s"]),
                    elapsed_s=float(record["elapsed_s"]), stages=tuple(stages))


def read_visits(visits_dir: Path) -> tuple[GpuVisit, ...]:
    """The suite visits under ``visits_dir`` (each folder with a ``summary.json``; the first visits,
    before the suite, kept other files and are passed over), newest first (:attr:`GpuVisit.order`)."""
    if not visits_dir.is_dir():
        raise UserError(f"{visits_dir}: no such folder (expected GPU visit folders <kind>-<YYYY-MM-DD>[suffix]/)")
    visits = [read_visit(folder) for folder in visits_dir.iterdir() if (folder / VISIT_SUMMARY).is_file()]
    return tuple(sorted(visits, key=lambda visit: visit.order, reverse=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Refresh or check the measurements shipped with the package.")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--refresh", type=Path, metavar="RESULTS_DIR",
                      help="rewrite the packaged measurements from a checkout's benchmarks/results")
    mode.add_argument("--check", type=Path, metavar="RESULTS_DIR",
                      help="exit 1 when the packaged measurements are not what RESULTS_DIR gives")
    args = parser.parse_args(argv)
    results_dir = args.refresh or args.check
    if not results_dir.is_dir():
        parser.error(f"{results_dir}: no such directory (expected a checkout's benchmarks/results)")
    text = refreshed(results_dir)
    if args.refresh:
        packaged_path().write_text(text)
        counts = json.loads(text)
        print(f"wrote {packaged_path()}: {len(counts['throughput'])} throughput rows, "
              f"{len(counts['finetune'])} fine-tuning speeds")
        return 0
    if packaged_path().read_text() != text:
        print(f"{packaged_path()} is not what {results_dir} gives: run python -m megatron_ext.measurements "
              f"--refresh {results_dir}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
