"""The paper recipes' GPU defaults, derived from the committed GPU measurements (never typed by hand).

The rule: for each model size, the newest GPU suite visit (``benchmarks/results/gpu_visits/<kind>-<date>/``
with a ``summary.json`` from ``benchmarks/gpu_suite.py``) that timed more than one value of a setting
at that size in bf16, on the same batches, decides that setting: the fastest value wins (unless the trainer's default is within the timing noise of it, 3 %: then the
default stands), provided the
visit's ``gpu`` tests passed (a ``gpu_tests*`` stage with status ``passed``, or one stopped by its
time limit with no test failed and none uncollected: what ran passed, and the table says how many). A setting no visit compared
stays as the recipe has it; a size no visit timed follows the nearest timed size, and the table says so.
The settings decided this way are the layer implementation (``model.transformer_impl``) and CUDA graphs
(``training.cuda_graphs``); FP8 needs the TE spec whatever wins in bf16 (a run asking for FP8 with the
local spec is refused in one line naming both keys).

    python -m benchmarks.recipe_defaults            # print the table
    python -m benchmarks.recipe_defaults --write    # rewrite benchmarks/results/recipe_defaults.{json,md}
    python -m benchmarks.recipe_defaults --check    # exit 1 if the committed table or a recipe disagrees

The visits are read by ``benchmarks.gpu_visits.read_visits`` (newest first: by date, then a
same-day suffix). ``tests/unit/test_recipe_defaults.py`` runs ``--check``'s logic: the committed table
is what the committed visits give, and every paper recipe sets what the table says.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from benchmarks.gpu_visits import GpuVisit, ThroughputSide, read_visits
from megatron_ext.config_loading import UserError

VISITS_DIR = REPO / "benchmarks" / "results" / "gpu_visits"
TABLE_JSON = REPO / "benchmarks" / "results" / "recipe_defaults.json"
TABLE_MD = REPO / "benchmarks" / "results" / "recipe_defaults.md"
SIZE_RECIPES = {"210m": "210m.yaml", "610m": "610m.yaml", "1b": "1b.yaml"}
"""The size bases (examples/recipes/base/) every paper recipe inherits its GPU settings from."""
SIZE_ORDER = ("210m", "610m", "1b")

# The recipe keys the rule decides, as (section, key, what a side's settings call it, the trainer's default).
DECIDED = (("model", "transformer_impl", "transformer_impl", "local"),
           ("training", "cuda_graphs", "cuda_graphs", "none"))

TIMING_NOISE = 0.03
"""How far apart two sides of one visit's row may be and still count as equally fast: the throughput
benchmark's rounds are short (3 timed steps x 2), +-3 % between runs of the same configuration."""

# Sides timed before the suite recorded each side's settings: what their names mean. The default side
# ("megatron_ext") ran the recipe at the visit's commit; its layer implementation is the other one of
# a timed ``local_spec``/``te_spec`` variant on the same row (two values exist).
_NAMED_SIDES = {"local_spec": {"transformer_impl": "local"}, "te_spec": {"transformer_impl": "te"},
                "local_spec_cuda_graphs": {"transformer_impl": "local", "cuda_graphs": "megatron"},
                "te_spec_cuda_graphs": {"transformer_impl": "te", "cuda_graphs": "megatron"},
                "cuda_graphs": {"cuda_graphs": "megatron"}}
_OTHER_IMPL = {"local": "te", "te": "local"}


@dataclass(frozen=True, kw_only=True)
class Side:
    """One timed configuration of one row of one visit."""

    visit: str
    device: str
    commit: str | None
    size: str
    name: str
    settings: dict
    tokens_per_s: float
    mfu: float | None
    micro_batch_size: int | None = None
    """The side's micro-batch as recorded (sides before 2026-11-27 recorded none)."""


@functools.cache  # the same few (size, seq) for every side of a visit
def _mlm40_flops_per_token(size: str, seq_length: int) -> float:
    """FLOPs per token of the throughput benchmark's step (MLM-40, LM head at the scored positions),
    for sides recorded before the suite wrote them (the MFU convention of performance/flops.py)."""
    from megatron_ext.model.config import preset
    from megatron_ext.phases import Phase, resolve_phases
    from megatron_ext.performance.flops import flops_per_token, mean_lm_head_share

    (phase,) = resolve_phases([Phase.from_config({"objective": "mlm", "mask_ratio": 0.4, "share": 1.0}, "throughput")], 1)
    share = mean_lm_head_share(phase, seq_length=seq_length, scored_only=True)
    return flops_per_token(preset(size, vocab_size=128256), seq_length, lm_head_share=share)


def _mfu(side: ThroughputSide, size: str, seq_length: int, device: str) -> float | None:
    from megatron_ext.performance.devices import peak_flops_per_device

    peak = peak_flops_per_device(device)
    if peak is None or not side.tokens_per_s:
        return None
    flops = side.flops_per_token or _mlm40_flops_per_token(size, seq_length)
    return side.tokens_per_s * flops / peak


def _side_settings(side: ThroughputSide, row_sides: list[ThroughputSide]) -> dict:
    if side.settings:  # in today's spelling (gpu_visits.RENAMED_SETTING_VALUES)
        return {key: side.settings.get(key) for _, _, key, _ in DECIDED}
    name = side.side
    settings = {key: default for _, _, key, default in DECIDED}
    if name in _NAMED_SIDES:
        return {**settings, **_NAMED_SIDES[name]}
    if name != "megatron_ext":
        raise ValueError(f"side {name!r} recorded no settings and has no known meaning")
    impls = {_NAMED_SIDES[s.side]["transformer_impl"] for s in row_sides
             if s.side in _NAMED_SIDES and "transformer_impl" in _NAMED_SIDES[s.side]}
    if len(impls) == 1:
        settings["transformer_impl"] = _OTHER_IMPL[impls.pop()]
    else:
        raise ValueError("the default side recorded no settings and no variant tells its layer implementation")
    return settings


def gpu_tests_verdict(visit: GpuVisit) -> str | None:
    """``"passed"``, or for a ``gpu_tests*`` stage that ran out of time (the suite's status ``timed_out``,
    or ``failed`` with exit 124 as suites before 2026-11-27 recorded it) with none failed, erroring or
    uncollected: how many passed of how many, and that the rest did not finish. ``None`` when no stage
    qualifies or any ``gpu_tests*`` stage of the visit saw a failure."""
    verdicts = []
    for stage in (s for s in visit.stages if s.runs_gpu_tests):
        figures = stage.figures
        counts = figures.get("counts") or {}
        if counts.get("failed") or counts.get("error") or figures.get("collection_errors"):
            return None  # a failure anywhere in the visit's gpu tests: it decides nothing
        if stage.status == "passed":
            verdicts.insert(0, "passed")
        elif stage.ran_out_of_time and counts.get("passed"):
            finished = sum(counts.get(outcome, 0) for outcome in ("passed", "skipped"))
            of = f" of {figures['collected']}" if figures.get("collected") else ""
            rest = f"{figures['collected'] - finished} not finished" if figures.get("collected") else "the rest not finished"
            verdicts.append(f"{counts['passed']}{of} passed, none failed, {rest} (stopped at its time limit)")
        elif stage.status == "failed":
            return None
    return verdicts[0] if verdicts else None


def suite_sides(visit: GpuVisit) -> tuple[list[Side], str | None]:
    """The bf16 sides at seq 2048 a suite visit timed (complete rows and partial ones), and the verdict
    of its ``gpu`` tests (:func:`gpu_tests_verdict`; ``None``: the visit decides nothing)."""
    verdict = gpu_tests_verdict(visit)
    sides = []
    for stage in visit.stages:
        records = list(stage.sides())  # each side as throughput.py wrote it, with its settings
        where = f"{visit.folder / 'summary.json'}: stage {stage.name}: rows"
        for row in stage.figures.get("rows") or []:  # a complete row: its default side and timed variants
            name = row.get("row") or f"{row['model']} seq {row['seq_length']} {row['precision']}"
            if any(record.row == name for record in records):
                continue  # its sides are read above, with the settings each ran
            timed = [("megatron_ext", row)] + [(variant, v) for variant, v in (row.get("variants") or {}).items()
                                               if not v.get("same_as_default")]
            for side, figures in timed:
                records.append(ThroughputSide.from_record({"row": name, "side": side, "settings": figures.get("settings"),
                                                           "tokens_per_s": figures.get("tokens_per_s")}, where))
        by_row: dict[str, list[ThroughputSide]] = {}
        for record in records:
            if record.side != "hf" and record.tokens_per_s:
                by_row.setdefault(record.row, []).append(record)
        for row, row_sides in by_row.items():
            size, _, seq, precision = row.split()
            if precision != "bf16" or seq != "2048":
                continue
            for record in row_sides:
                sides.append(Side(visit=visit.name, device=visit.device, commit=visit.commit, size=size,
                                  name=record.side, settings=_side_settings(record, row_sides),
                                  tokens_per_s=record.tokens_per_s, mfu=_mfu(record, size, int(seq), visit.device),
                                  micro_batch_size=record.micro_batch_size))
    return sides, verdict


def _decide_by_size(visits: list[GpuVisit]) -> dict[str, dict[str, dict]]:
    """Per size and decided setting, the newest of ``visits`` (newest first) that compared values."""
    measured: dict[str, dict[str, dict]] = {}
    for visit in visits:
        sides, verdict = suite_sides(visit)
        if verdict is None:
            continue
        for size in {s.size for s in sides}:
            at_size = [s for s in sides if s.size == size]
            for section, key, setting, default in DECIDED:
                if f"{section}.{key}" in measured.get(size, {}):
                    continue  # a newer visit decided it
                values = {s.settings.get(setting) for s in at_size}
                if len(values) < 2:
                    continue
                best = {}
                for s in at_size:  # the fastest side of each value
                    value = s.settings.get(setting)
                    if value not in best or s.tokens_per_s > best[value].tokens_per_s:
                        best[value] = s
                ranked = sorted(best.values(), key=lambda s: s.tokens_per_s, reverse=True)
                winner, source = ranked[0], "measured"
                # Within the timing noise of the fastest, the trainer's default (the plainer run) stands.
                tied = [s for s in ranked if s.tokens_per_s * (1 + TIMING_NOISE) >= ranked[0].tokens_per_s]
                plain = next((s for s in tied if s.settings.get(setting) == default), None)
                if plain is not None and plain is not winner:
                    winner = plain
                    source = (f"measured: within the timing noise ({100 * TIMING_NOISE:.0f} %) of the fastest, "
                              "the trainer's default")
                measured.setdefault(size, {})[f"{section}.{key}"] = {
                    "value": winner.settings.get(setting), "source": source, "visit": winner.visit,
                    "device": winner.device, "commit": winner.commit, "gpu_tests": verdict,
                    "micro_batch_size": winner.micro_batch_size,
                    "candidates": [{"value": s.settings.get(setting), "side": s.name,
                                    "tokens_per_s": round(s.tokens_per_s), "mfu": None if s.mfu is None else round(s.mfu, 4)}
                                   for s in ranked]}
    return measured


def device_kinds(visits: list[GpuVisit]) -> dict:
    """Per device kind (``h100``, ``h200``: a visit folder's prefix), what its own newest deciding
    visit says of each setting at each timed size, and whether one value serves every kind: the kinds
    agree, or those that disagree measured another micro-batch than the size recipe runs now (not
    comparable: the visit plan re-times that kind's known sides), or they disagree at the recipe's own
    shape, and the recipes would need a default per device kind (``--check`` then fails)."""
    kinds: dict[str, dict] = {}
    for kind in sorted({v.kind for v in visits}):
        kinds[kind] = _decide_by_size([v for v in visits if v.kind == kind])
    verdicts = {}
    for size in SIZE_ORDER:
        recipe_micro = _recipe_micro_batch(size)
        for section, key, _, _ in DECIDED:
            name = f"{section}.{key}"
            at_shape = {k: m[size][name] for k, m in kinds.items() if name in m.get(size, {})}
            if not at_shape:
                continue
            comparable = {k: e for k, e in at_shape.items() if e.get("micro_batch_size") == recipe_micro}
            stale = {k: e for k, e in at_shape.items() if k not in comparable}
            values = {e["value"] for e in comparable.values()}
            if len(values) > 1:
                verdict = {"one_value_serves": False, "why": (
                    "the device kinds disagree at the recipe's micro-batch of "
                    f"{recipe_micro}: " + ", ".join(f"{k}: {e['value']} ({e['visit']})" for k, e in comparable.items())
                    + "; the recipes need a default per device kind")}
            else:
                why = []
                if comparable:
                    why.append(f"{', '.join(comparable)} measured at the recipe's micro-batch of {recipe_micro}: "
                               f"{values.pop()}")
                for k, e in stale.items():
                    recorded = ("no micro-batch recorded (the visits before 2026-11-27 ran 6 x 3)"
                                if e.get("micro_batch_size") is None else f"micro-batch {e['micro_batch_size']}")
                    why.append(f"{k}'s comparison ({e['value']}, {e['visit']}) ran {recorded}, not the recipe's "
                               f"{recipe_micro}: not comparable; the next {k.upper()} visit re-times it (visit plan)")
                verdict = {"one_value_serves": True, "why": "; ".join(why)}
            verdicts.setdefault(size, {})[name] = {
                "kinds": {k: {"value": e["value"], "visit": e["visit"], "micro_batch_size": e.get("micro_batch_size")}
                          for k, e in at_shape.items()}, **verdict}
    return verdicts


def _recipe_micro_batch(size: str) -> int:
    from megatron_ext.training.recipe import read_recipe

    return read_recipe(REPO / "examples" / "recipes" / "base" / SIZE_RECIPES[size])["data"]["micro_batch_size"]


def decide(visits_dir: Path = VISITS_DIR) -> dict:
    """The table: per size and decided setting, the value and the measurement behind it, and per
    device kind what its own visits say (:func:`device_kinds`)."""
    visits = list(read_visits(visits_dir))  # newest first
    measured = _decide_by_size(visits)
    table = {}
    for size in SIZE_ORDER:
        entries = {}
        for section, key, _, _ in DECIDED:
            name = f"{section}.{key}"
            if name in measured.get(size, {}):
                entries[name] = measured[size][name]
                continue
            nearest = sorted((s for s in measured if name in measured[s]),
                             key=lambda s: abs(SIZE_ORDER.index(s) - SIZE_ORDER.index(size)))
            if nearest:
                entries[name] = {**measured[nearest[0]][name], "source": f"follows {nearest[0]} (not timed at {size})"}
            else:
                entries[name] = {"value": None, "source": "not compared on a GPU yet: the recipe's own setting"}
        table[size] = entries
    rule = __doc__.split("\n\n")[1].replace("\n", " ").removeprefix("The rule: ")
    return {"rule": rule[0].upper() + rule[1:], "sizes": table, "device_kinds": device_kinds(visits)}


def render_markdown(table: dict) -> str:
    lines = ["# Paper recipes: GPU defaults and the measurements behind them", "",
             "Written by `python -m benchmarks.recipe_defaults --write` from the committed GPU visits "
             "(`benchmarks/results/gpu_visits/`); `tests/unit/test_recipe_defaults.py` keeps it, and the recipes "
             "under `examples/recipes/base/`, in step with them.", "", f"Rule: {table['rule']}", "",
             "| size | setting | default | source | measured (bf16, seq 2048, MLM-40, one GPU) | device | visit | commit | gpu tests |",
             "|---|---|---|---|---|---|---|---|---|"]
    for size, entries in table["sizes"].items():
        for name, entry in entries.items():
            if entry["value"] is None and entry["source"].startswith("not compared"):
                lines.append(f"| {size} | `{name}` | (recipe's) | {entry['source']} | | | | | |")
                continue
            figures = "; ".join(
                f"{c['value'] or 'off'}: {c['tokens_per_s']:,} tok/s"
                + ("" if c["mfu"] is None else f", {100 * c['mfu']:.1f} % MFU") for c in entry["candidates"])
            lines.append(f"| {size} | `{name}` | `{entry['value'] or 'off'}` | {entry['source']} | {figures} | "
                         f"{entry['device']} | `{entry['visit']}` | {entry['commit']} | {entry['gpu_tests']} |")
    lines += ["", "## One default for every device kind?", "",
              "Each device kind's own newest deciding visit, per size it timed; one value serves all kinds when they "
              "agree at the recipe's micro-batch (a kind measured at another shape is not comparable, and the visit "
              "plan re-times it there).", "",
              "| size | setting | per kind | one value serves | why |", "|---|---|---|---|---|"]
    for size, entries in table.get("device_kinds", {}).items():
        for name, entry in entries.items():
            kinds = "; ".join(f"{k}: `{e['value'] or 'off'}` ({e['visit']}, micro-batch {e['micro_batch_size'] or '?'})"
                              for k, e in entry["kinds"].items())
            lines.append(f"| {size} | `{name}` | {kinds} | {'yes' if entry['one_value_serves'] else '**no**'} | "
                         f"{entry['why']} |")
    lines += ["", "FP8 (`training.fp8_format`) runs Transformer Engine layers only: with the local spec a run "
              "asking for FP8 is refused in one line; add `--transformer-impl te`.", ""]
    return "\n".join(lines)


def recipe_setting(size: str, section: str, key: str):
    """The size recipe's setting as the trainer reads it (``read_recipe``: bases merged, old key names
    and values under today's)."""
    from megatron_ext.training.recipe import read_recipe

    recipe = read_recipe(REPO / "examples" / "recipes" / "base" / SIZE_RECIPES[size])
    return (recipe.get(section) or {}).get(key)


def disagreements(table: dict) -> list[str]:
    """Where the size recipes differ from the table (a setting the table leaves to the recipe is skipped),
    and where device kinds disagree at the recipe's own shape (one default cannot serve them)."""
    problems = [f"{size}: {name}: {entry['why']}" for size, entries in table.get("device_kinds", {}).items()
                for name, entry in entries.items() if not entry["one_value_serves"]]
    for size, entries in table["sizes"].items():
        for name, entry in entries.items():
            if entry["value"] is None and entry["source"].startswith("not compared"):
                continue
            section, key = name.split(".")
            have = recipe_setting(size, section, key)
            if have is None:  # the recipe leaves it to the trainer
                have = next(default for s, k, _, default in DECIDED if (s, k) == (section, key))
            if have != entry["value"]:
                problems.append(f"examples/recipes/base/{SIZE_RECIPES[size]}: {name} is {have!r}; the measurements "
                                f"say {entry['value']!r} ({entry['source']}, {entry.get('visit')})")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite benchmarks/results/recipe_defaults.{json,md}")
    mode.add_argument("--check", action="store_true",
                      help="exit 1 when the committed table or a size recipe disagrees with the committed visits")
    args = parser.parse_args(argv)
    try:
        table = decide()
    except UserError as error:  # a visit folder's files, named
        parser.exit(2, f"recipe_defaults.py: error: {error}\n")
    text = render_markdown(table)
    if args.write:
        TABLE_JSON.write_text(json.dumps(table, indent=1) + "\n")
        TABLE_MD.write_text(text)
        print(f"wrote {TABLE_JSON.relative_to(REPO)} and {TABLE_MD.relative_to(REPO)}")
        return 0
    if args.check:
        problems = disagreements(table)
        if not TABLE_JSON.is_file() or json.loads(TABLE_JSON.read_text()) != table:
            problems.append(f"{TABLE_JSON.relative_to(REPO)} is not what the committed visits give: "
                            "run python -m benchmarks.recipe_defaults --write")
        for problem in problems:
            print(f"recipe_defaults.py: {problem}", file=sys.stderr)
        return 1 if problems else 0
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
