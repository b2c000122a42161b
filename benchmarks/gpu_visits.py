"""The GPU suite's visit folders, as ``benchmarks/gpu_suite.py`` writes them: typed records read from
their files, and one date order.

- :class:`GpuVisit`: one visit (``benchmarks/results/gpu_visits/<kind>-<date>[suffix]/``; ``<kind>``
  is ``megatron_ext.performance.devices.device_kind`` of its device): its ``summary.json``
  (:class:`VisitStage` per stage), each stage's :class:`ThroughputSide` records
  (``<stage>/throughput.sides.jsonl``) and :class:`GpuTestReport` files (``<stage>/gpu_check_*.json``),
  and the visit's ``fingerprints.json``.
- :func:`read_visits` gives a folder's visits newest first (the one date order every reader uses);
  ``benchmarks/recipe_defaults.py``, ``benchmarks/visit_plan.py`` and ``tools/render_docs.py`` read
  visits only through it.

Standard library only (and ``megatron_ext.config_loading``): the suite's process stays light.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.config_loading import UserError

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
