"""Write the parts of the docs that the code and the committed results already hold, so that no one
types them by hand: the README's GPU status table, the recipe keys, the exit codes and each tool's
``--help``.

    python -m tools.render_docs           # rewrite every generated region in place
    python -m tools.render_docs --check   # exit 1, naming each page, when one is out of date

A generated region sits between two HTML comments in a page::

    <!-- generated: NAME -->
    ... (written by this script; edits here are overwritten)
    <!-- end generated: NAME -->

:data:`GENERATORS` maps each NAME to the function that renders it (``cli-help TOOL`` takes the
tool as its argument: its file, ``tools/evaluate.py``, or ``-m`` and its module, ``-m tools.check_docs``). ``tests/integration/test_docs.py`` fails when a committed region differs from what this
script renders now.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import sys
import typing
from collections.abc import Callable
from pathlib import Path

from benchmarks.gpu_visits import GpuVisit, VisitStage, read_visits
from tools.check_docs import Program, doc_pages, program_help

REPO = Path(__file__).resolve().parent.parent

GPU_VISITS = REPO / "benchmarks" / "results" / "gpu_visits"
REGION = re.compile(r"(?P<open><!-- generated: (?P<name>[^>]*?) -->\n)(?P<body>.*?)(?P<close><!-- end generated: (?P=name) -->)",
                    re.S)


# -- the GPU status table ------------------------------------------------------------------------


def newest_gpu_suite_run(root: Path = GPU_VISITS) -> GpuVisit:
    """The newest committed visit of ``benchmarks/gpu_suite.py`` under ``gpu_visits/<kind>-<date>[suffix]/``
    (``benchmarks.gpu_visits.read_visits``: by date, then by suffix, ``h200-2026-11-26b`` after
    ``h200-2026-11-26``)."""
    visits = read_visits(root)
    if not visits:
        raise FileNotFoundError(f"no gpu_suite summary.json under {root}")
    return visits[0]


def _throughput_figures(stage: VisitStage, commit: str | None) -> str:
    figures = stage.figures
    sides = [s for s in stage.sides() if s.tokens_per_s]
    rows = figures.get("rows") or []
    parts = []
    for row in rows:
        ours = row.get("tokens_per_s") or row.get("megatron_ext", {}).get("tokens_per_s")
        if not ours:
            continue
        mfu = f", {100 * row['mfu']:.1f} % MFU" if row.get("mfu") else ""
        hf = f", x{row['speedup_vs_hf']:.2f} Hugging Face" if row.get("speedup_vs_hf") else ""
        shape = f" ({row['shape']})" if row.get("shape") else ""
        variants = [f"{name.replace('_', ' ')} {v['tokens_per_s']:,.0f}" for name, v in (row.get("variants") or {}).items()
                    if v.get("tokens_per_s") and not v.get("same_as")]
        parts.append(f"{row.get('name', row.get('row', ''))}{shape}: the recipe at {commit} {ours:,.0f} tok/s{mfu}{hf}"
                     + (f"; variants (tok/s): {', '.join(variants)}" if variants else ""))
    if rows:
        sides = []  # a complete row says it all; the sides are its parts
    for side in sides:
        label = ("the recipe at that commit" if side.side == "megatron_ext" else side.side.replace("_", " "))
        parts.append(f"{label} {side.tokens_per_s:,.0f} tok/s (peak {side.peak_mem_gb:.1f} GB)")
    return "; ".join(parts)


def _test_figures(stage: VisitStage) -> str:
    figures = stage.figures
    counts = figures.get("counts") or {}
    text = ", ".join(f"{n} {what}" for what, n in counts.items())
    problems = figures.get("problems") or []
    if problems:
        text += f"; problems: {len(problems)}"
    return text


def _visit_notes(folder: Path, link: Path) -> str:
    """The title of the visit's own notes (``README.md``), which say what the suite's record does
    not (a corrected commit, what was cut short)."""
    notes = folder / "README.md"
    if not notes.is_file():
        return ""
    title = notes.read_text().splitlines()[0].lstrip("# ").strip()
    return f" Its notes: [{title}]({link}/README.md)."


def render_gpu_status(page: Path) -> str:
    visit = newest_gpu_suite_run()
    link = Path(os.path.relpath(visit.folder, page.parent))
    lines = [
        f"Newest GPU visit: **{visit.device}**, recorded commit `{visit.commit}`, folder "
        f"[`{link.name}/`]({link}/) (`benchmarks/gpu_suite.py`, budget {visit.budget_s:.0f} s, "
        f"used {visit.elapsed_s:.0f} s)." + _visit_notes(visit.folder, link),
        "",
        "| stage | status | what it measured |",
        "|---|---|---|",
    ]
    not_run = []
    for stage in visit.stages:
        if stage.status in ("skipped", "not_applicable"):
            not_run.append(f"`{stage.name}` ({stage.reason or stage.status})")
            continue
        figures = _throughput_figures(stage, visit.commit) or _test_figures(stage)
        if stage.exit_code == 124:  # stopped itself at its time limit (suites before 2026-11-27 said failed)
            status = "timed out (stopped itself at its limit)"
        else:
            status = stage.status.replace("_", " ") + (f" ({stage.reason})" if stage.reason else "")
        lines.append(f"| `{stage.name}` | {status} | {figures} |")
    if not_run:
        lines += ["", "Not run in that visit: " + ", ".join(not_run) + "."]
    return "\n".join(lines) + "\n"


def render_recipe_defaults(page: Path) -> str:
    """The paper recipes' GPU defaults and the measurement behind each, from the table
    ``benchmarks/recipe_defaults.py`` writes (``benchmarks/results/recipe_defaults.json``)."""
    table = json.loads((RESULTS / "recipe_defaults.json").read_text())
    lines = ["| size | setting | default | why | measured (bf16, one GPU) | device, visit, commit |",
             "|---|---|---|---|---|---|"]
    for size, settings in table["sizes"].items():
        for key, entry in settings.items():
            if entry.get("value") is None:
                continue
            measured = "; ".join(f"{c['value']}: {c['tokens_per_s']:,} tok/s, {100 * c['mfu']:.1f} % MFU"
                                 for c in entry.get("candidates", []))
            lines.append(f"| {size} | `{key}` | `{entry['value']}` | {entry['source']} | {measured} | "
                         f"{entry['device']}, `{entry['visit']}`, {entry['commit']}; gpu tests: {entry['gpu_tests']} |")
    unmeasured = sorted({key for settings in table["sizes"].values() for key, entry in settings.items()
                         if entry.get("value") is None})
    if unmeasured:
        lines += ["", "Not compared on a GPU yet (each recipe keeps its own setting): "
                  + ", ".join(f"`{key}`" for key in unmeasured) + "."]
    return "\n".join(lines) + "\n"


# -- CPU benchmark tables ------------------------------------------------------------------------

RESULTS = REPO / "benchmarks" / "results"


def render_preprocess_throughput(page: Path) -> str:
    result = json.loads((RESULTS / "preprocess_cpu2.json").read_text())
    lines = [f"{result['corpus']}, {result['host']['cpus']} CPU cores; target: {result['target']}.", "",
             "| workers | raw tokenizer batch encode | end to end | ratio | start-up |", "|---|---|---|---|---|"]
    for row in result["rows"]:
        end = row["end_to_end"]
        lines.append(f"| {row['workers']} | {row['raw_tokenizer']['tokens_per_s'] / 1e3:,.0f}k tokens/s | "
                     f"{end['tokens_per_s'] / 1e3:,.0f}k tokens/s | {row['ratio_to_raw_tokenizer']:.2f} | "
                     f"{end['startup_seconds']:.1f} s |")
    return "\n".join(lines) + "\n"


def render_cpu_throughput(page: Path) -> str:
    result = json.loads((RESULTS / "throughput_cpu2.json").read_text())
    settings = result["settings"]
    lines = [f"Device `{result['device']}`, vocabulary {settings['vocab_size']:,}, torch "
             f"{result['versions']['torch']}, megatron-core {result['versions']['megatron_core']}; each variant "
             "undoes or adds one setting, timed in the same run:", "",
             "| model | seq | precision | tokens/s | Hugging Face tokens/s | vs HF | variant: tokens/s (default's speedup) |",
             "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        variants = "; ".join(f"{name}: {v['tokens_per_s']:,.0f} (x{v['default_speedup']:.2f})"
                             for name, v in (row.get("variants") or {}).items() if v.get("tokens_per_s"))
        lines.append(f"| {row['model']} | {row['seq_length']} | {row['precision']} | {row['tokens_per_s']:,.0f} | "
                     f"{row['hf_tokens_per_s']:,.0f} | x{row['speedup_vs_hf']:.2f} | {variants} |")
    return "\n".join(lines) + "\n"


# -- the scaling plan's estimates ----------------------------------------------------------------

SCALING_SIZES = ("210m", "610m", "1b")
GLOBAL_TOKENS = 1152 * 2048
"""The paper recipes' global batch: 1,152 sequences of 2,048 tokens."""
H100_BF16_TFLOPS = 989.0
NVLINK_GB_S, IB_GB_S_PER_GPU = 400.0, 45.0


def render_scaling_estimates(page: Path) -> str:
    """Parameters, distributed-optimizer traffic and step times of the paper's sizes, computed from
    the presets and the FLOPs convention of ``megatron_ext/performance/flops.py``."""
    from megatron_ext.model.config import PRESETS, parameter_count
    from megatron_ext.performance.flops import flops_per_token

    lines = ["| preset | parameters | bytes per GPU per step (DP 64) | step at 40 % MFU, 8 / 64 H100 | "
             "NVLink (~400 GB/s), 8 GPUs | InfiniBand (~45 GB/s per GPU), 64 GPUs |", "|---|---|---|---|---|---|"]
    for name in SCALING_SIZES:
        config = PRESETS[name]
        params = parameter_count(config)
        # fp32 gradients reduce-scattered (4 bytes), bf16 parameters all-gathered (2 bytes)
        traffic = {dp: 6 * params * (dp - 1) / dp for dp in (8, 64)}
        flops = flops_per_token(config, 2048)
        step = {gpus: GLOBAL_TOKENS * flops / (gpus * H100_BF16_TFLOPS * 1e12 * 0.4) for gpus in (8, 64)}
        nvlink = traffic[8] / (NVLINK_GB_S * 1e9)
        infiniband = traffic[64] / (IB_GB_S_PER_GPU * 1e9)
        lines.append(f"| {name} | {params / 1e6:,.0f}M | {traffic[64] / 1e9:.1f} GB | {step[8]:.2f} s / {step[64]:.2f} s "
                     f"| {nvlink * 1e3:.0f} ms | {infiniband * 1e3:.0f} ms ({100 * infiniband / step[64]:.0f} % of the step) |")
    flops = ", ".join(f"{flops_per_token(PRESETS[name], 2048):.3g}" for name in SCALING_SIZES)
    return "\n".join(lines) + (f"\n\nStep time = {GLOBAL_TOKENS:,} tokens x FLOPs/token with the LM head at every "
                               f"position (CLM steps: {flops} at 210M / 610M / 1B) / (GPUs x {H100_BF16_TFLOPS:.0f} "
                               "TFLOP/s x 0.4).\n")


def render_dry_run_plan(page: Path, recipe: str, world_size: str) -> str:
    """``pretrain_encoder.py --config RECIPE --dry-run --world-size N``'s plan, up to its memory
    estimate (what follows depends on the machine it runs on)."""
    code, output = _program("pretrain_encoder.py").run(["--config", recipe, "--dry-run", "--world-size", world_size])
    if code != 0:
        raise RuntimeError(f"pretrain_encoder.py --dry-run of {recipe} exited {code}: {output[-2000:]}")
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("world size"))
    end = next(i for i, line in enumerate(lines) if line.startswith("memory/rank"))
    return "```text\n" + "\n".join(lines[start:end + 1]) + "\n```\n"


# -- recipe keys ---------------------------------------------------------------------------------


def _type_name(annotation: typing.Any) -> str:
    text = str(annotation) if not isinstance(annotation, type) else annotation.__name__
    text = re.sub(r"typing\.", "", text).replace("NoneType", "None")
    return text.replace("|", "\\|")


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return f"`{field.default!r}`"
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f"`{field.default_factory()!r}`"  # type: ignore[misc]
    return "required"


def _dataclass_table(cls: type, prefix: str) -> list[str]:
    from megatron_ext.config_loading import _field_docs

    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    lines = ["| key | type | default | what it is |", "|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        doc = docs.get(field.name, "").replace("%%", "%").replace("|", "\\|")
        lines.append(f"| `{prefix}{field.name}` | {_type_name(hints[field.name])} | {_default(field)} | {doc} |")
    return lines


def render_recipe_keys(page: Path) -> str:
    from megatron_ext import objectives
    from megatron_ext.phases import Phase
    from megatron_ext.training.config import SECTIONS

    out = []
    for name, cls in SECTIONS.items():
        out += [f"### `{name}:`", "", " ".join((cls.__doc__ or "").split()), ""]
        if name == "model":
            out += ["`model.preset` (`210m`, `610m`, `1b`, ...) fills every shape key below; the recipe's own keys "
                    "override it.", ""]
        out += _dataclass_table(cls, f"{name}."), ""
    out += ["### `phases:`", "", " ".join((Phase.__doc__ or "").split()), ""]
    out += _dataclass_table(Phase, ""), ""
    for tag, cls in objectives.OBJECTIVES.items():
        out += [f"#### objective `{tag}`", "", " ".join((cls.__doc__ or "").split()), ""]
        if dataclasses.fields(cls):
            out += _dataclass_table(cls, ""), ""
    return "\n".join(line if isinstance(line, str) else "\n".join(line) for line in out)


def render_study_keys(page: Path) -> str:
    from megatron_ext.study import spec

    from megatron_ext.launch import LAUNCHERS, Resources

    out = []
    classes = [v for v in vars(spec).values()
               if isinstance(v, type) and dataclasses.is_dataclass(v) and v.__module__ == spec.__name__]
    classes.append(Resources)
    for cls in classes:
        out += [f"### `{cls.__name__}`", "", " ".join((cls.__doc__ or "").split()), ""]
        out += _dataclass_table(cls, ""), ""
    out += [f"In a study file, `resources:` takes `nodes`, `gpus_per_node`, `time` and one list of extra flags "
            f"per launcher, by its name: {', '.join(f'`{name}`' for name in LAUNCHERS)}.", ""]
    return "\n".join(line if isinstance(line, str) else "\n".join(line) for line in out)


# -- the import layers -------------------------------------------------------------------------


def render_import_layers(page: Path) -> str:
    """The layers of ``tests/unit/test_layering.py`` (``LAYERS``, bottom up, with each layer's comment),
    from the top down: the test is what holds the imports to them."""
    import ast

    source = (REPO / "tests" / "unit" / "test_layering.py").read_text()
    tree = ast.parse(source)
    layers = next(node.value for node in tree.body if isinstance(node, ast.AnnAssign)
                  and getattr(node.target, "id", None) == "LAYERS")
    sets = [element for element in ast.walk(layers) if isinstance(element, ast.Set)]
    lines = source.splitlines()
    out = []
    for number, layer in enumerate(reversed(sets), start=1):
        units = [element.value for element in layer.elts]
        names = [f"`{unit}/`" if (REPO / "megatron_ext" / unit).is_dir() else f"`{unit}.py`" for unit in units]
        comment = lines[layer.end_lineno - 1].partition("#")[2].strip()
        if units == ["cli"]:
            names.append("`pretrain_encoder.py`, `tools/`")
        out.append(f"{number}. {', '.join(names)}" + (f" ({comment})" if comment else ""))
    return "\n".join(out) + "\n"


def render_unit_graph(page: Path) -> str:
    """The package's units and the units each imports (``tools/import_graph.py``, read from the
    source now), as a Mermaid flowchart whose rows are the layers of ``render_import_layers``, top
    down: every arrow points down a row or along it. Arrows into the bottom row (configuration
    reading, the hardware probe, file publishing ...) are counted, not drawn."""
    import ast

    from tools.import_graph import module_graph, unit_graph

    edges = unit_graph(module_graph(REPO))
    source = (REPO / "tests" / "unit" / "test_layering.py").read_text()
    layers = next(node.value for node in ast.parse(source).body if isinstance(node, ast.AnnAssign)
                  and getattr(node.target, "id", None) == "LAYERS")
    rows = [sorted(element.value for element in layer.elts)
            for layer in reversed([e for e in ast.walk(layers) if isinstance(e, ast.Set)])]
    out = ["```mermaid", "flowchart TD"]
    for number, row in enumerate(rows, start=1):
        out.append(f'  subgraph layer{number}[" "]')
        out += [f'    {unit}["{unit}/"]' if (REPO / "megatron_ext" / unit).is_dir() else f'    {unit}["{unit}.py"]'
                for unit in row]
        out.append("  end")
    ground = set(rows[-1])  # what most units ask: their arrows would hide the rest
    arrows = sorted((a, b) for a, targets in edges.items() if a for b in targets if b)
    drawn = [(a, b) for a, b in arrows if b not in ground]
    out += [f"  {a} --> {b}" for a, b in drawn]
    out.append("```")
    return "\n".join(out) + (f"\n\n{sum(map(len, rows))} units, {len(arrows)} arrows between them; the "
                              f"{len(arrows) - len(drawn)} into the bottom row are not drawn.\n")


# -- exit codes ----------------------------------------------------------------------------------

EXIT_CODE_CONSTANTS = tuple(("megatron_ext.exit_codes", name) for name in (
    "USER_ERROR_EXIT_CODE", "STORAGE_EXIT_CODE", "RESUMABLE_EXIT_CODE", "STOPPED_UNSAVED_EXIT_CODE",
    "INTERRUPTED_EXIT_CODE"))
"""Each exit status the trainer and the tools use (all in ``megatron_ext/exit_codes.py``), with its docstring."""


def _constant_doc(module_name: str, name: str) -> str:
    import ast
    import importlib
    import inspect

    module = importlib.import_module(module_name)
    tree = ast.parse(inspect.getsource(module))
    for node, nxt in zip(tree.body, tree.body[1:]):
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            return " ".join(str(nxt.value.value).split())
    raise LookupError(f"{module_name}.{name} has no docstring")


def render_exit_codes(page: Path) -> str:
    import importlib

    rows = [("0", "", "Finished: the run reached `training.train_iters` (a tool: it did what was asked).")]
    for module_name, name in EXIT_CODE_CONSTANTS:
        code = getattr(importlib.import_module(module_name), name)
        doc = re.sub(r":data:`~?([\w.]+)`", r"`\1`", _constant_doc(module_name, name)).replace("``", "`")
        rows.append((str(code), f"`{name}` (`{module_name}`)", doc.replace("|", "\\|")))
    rows.append(("1", "", "A bug: the traceback is printed. Please report it with the command and the log."))
    lines = ["| exit code | constant | meaning |", "|---|---|---|"]
    lines += [f"| **{code}** | {name} | {doc} |" for code, name, doc in sorted(rows, key=lambda r: int(r[0]))]
    return "\n".join(lines) + "\n"


# -- the study cost estimates (docs/cost.md) ----------------------------------------------------

STUDIES = REPO / "examples" / "studies"
PAPER_MI250X_GPU_HOURS = 110_000
"""The paper's reported compute (arXiv 2507.00994): about 110,000 GPU-hours on MI250X."""
PAPER_GRID_GPUS = 64
"""GPUs per run (8 nodes of 8) and evaluation workers of the estimate of the paper's grid."""


@functools.cache
def _study_cost(study_file: str, *, paper_evaluation: bool, kind: str = "H100"):
    """The cost model's estimate of ``examples/studies/<study_file>`` on ``kind`` GPUs from the committed
    measurements; ``paper_evaluation``: with the paper's 12 tasks (LR grid x 5 seeds) on 64 workers and
    every run on 64 GPUs, as the page's comparison with the paper counts them."""
    from megatron_ext.performance.cost import SpeedTable
    from megatron_ext.study.cost import study_cost
    from megatron_ext.study.plan import plan_study
    from megatron_ext.study.spec import EvaluationSpec, read_study

    path = STUDIES / study_file
    study = read_study(path)
    if paper_evaluation:
        study = dataclasses.replace(study, evaluation=EvaluationSpec(tasks=("paper",), workers=PAPER_GRID_GPUS))
    plan = plan_study(study, path)
    speeds = SpeedTable(kind=kind)
    cost = study_cost(plan, speeds=speeds, gpus=PAPER_GRID_GPUS if paper_evaluation else None, gpus_per_node=8)
    return plan, cost, speeds


def _size_speeds(plan, speeds) -> str:
    """Each size's training speed and where it comes from (MLM steps; measured rows name their file)."""
    from megatron_ext.performance.devices import PEAK_TFLOPS
    from megatron_ext.study.cost import costed_config

    parts = []
    for size in plan.study.sizes:
        run = next(r for r in plan.runs if r.size == size.name)
        speed = speeds.speed(costed_config(run), "mlm")
        mfu = speed.flops_per_s / (PEAK_TFLOPS[speeds.kind][0] * 1e12)
        where = ""
        if speed.source == "measured":
            file = speed.detail.split(":")[0]
            spec = re.search(r", (\w+) spec", speed.detail)
            where = f", {spec.group(1)} spec" if spec else ""
            where += f"; `{file.removeprefix('gpu_visits/')}`"
        parts.append(f"{size.name}: {speed.source}, {speed.flops_per_s / 1e12:,.0f} TFLOP/s ({100 * mfu:.1f} % MFU{where})")
    return "; ".join(parts)


def _evaluation_source(cost) -> str:
    """Where the fine-tuning runs' times come from: each item's source starts with its kind
    (``assumed: ...``, ``measured, scaled ...``, ``calibrated: ...``; a reference's with ``as SIZE's run: ``)."""
    kinds = {re.match(r"(?:as \S+'s run: )?(\w+)", item.source).group(1) for item in cost.evaluation.items}
    return ", ".join(sorted({k if k in ("assumed", "calibrated", "measured") else "unknown" for k in kinds})) + " speed"


def render_paper_grid_cost(page: Path) -> str:
    """The paper's grid (``paper_610m.yaml``) and the three sizes (``paper_sizes.yaml``) on H100s,
    from the cost model and the committed measurements, against the paper's 110,000 MI250X hours."""
    from megatron_ext.performance.devices import PEAK_TFLOPS

    columns = {name: _study_cost(name, paper_evaluation=True) for name in ("paper_610m.yaml", "paper_sizes.yaml")}
    header = [f"{name} ({len(plan.runs)} runs)" for name, (plan, _, _) in columns.items()]
    rows = {"training as the tree": [], "training, every run from scratch": [], "evaluation": [],
            "whole study, tree / separate runs": [], "wall time (tree, a job per segment; evaluation on 64 workers)": [],
            "speeds (MLM steps)": []}
    for plan, cost, speeds in columns.values():
        tree, separate, evaluation = cost.tree_gpu_hours, cost.separate_gpu_hours, cost.evaluation_gpu_hours
        rows["training as the tree"].append(f"{tree:,.0f} GPU-hours")
        rows["training, every run from scratch"].append(f"{separate:,.0f} GPU-hours")
        rows["evaluation"].append(f"{cost.evaluation.runs:,} runs, {evaluation:,.0f} GPU-hours ({_evaluation_source(cost)})")
        rows["whole study, tree / separate runs"].append(f"{tree + evaluation:,.0f} / {separate + evaluation:,.0f} GPU-hours")
        rows["wall time (tree, a job per segment; evaluation on 64 workers)"].append(
            f"{cost.parallel_s / 3600:,.1f} h training + {cost.evaluation.wall_s / 3600:,.1f} h evaluation")
        rows["speeds (MLM steps)"].append(_size_speeds(plan, speeds))
    lines = ["| | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    lines += [f"| {what} | " + " | ".join(cells) + " |" for what, cells in rows.items()]

    plan, cost, _ = columns["paper_610m.yaml"]
    module, h100 = PEAK_TFLOPS["MI250X"][0], PEAK_TFLOPS["H100"][0]
    as_modules = PAPER_MI250X_GPU_HOURS * module / h100
    as_gcds = as_modules / 2
    ours = cost.separate_gpu_hours + cost.evaluation_gpu_hours
    saved = cost.separate_gpu_hours - cost.tree_gpu_hours
    lines += ["", f"Against the paper, with the peak FLOP/s of the two GPUs (bf16, dense): an MI250X module is "
              f"{module:,.0f} TFLOP/s (two GCDs of {module / 2:,.1f}), an H100 {h100:,.0f}, {h100 / module:.2f}x one "
              f"module or {2 * h100 / module:.2f}x one GCD. {PAPER_MI250X_GPU_HOURS:,} MI250X GPU-hours are therefore "
              f"{as_modules:,.0f} H100-hours at equal MFU if the paper counts modules, or {as_gcds:,.0f} if it counts "
              f"GCDs (on clusters such as Adastra each GCD is one GPU to SLURM). The estimate for the 610M grid's "
              f"separate runs plus its evaluation, {ours:,.0f} H100 GPU-hours, is {as_gcds / ours:.1f}x (GCDs) to "
              f"{as_modules / ours:.1f}x (modules) below that. Sharing trunks as a tree saves {saved:,.0f} GPU-hours "
              f"({100 * saved / cost.separate_gpu_hours:.1f} %) of that grid's training."]
    return "\n".join(lines) + "\n"


def render_one_node_cost(page: Path) -> str:
    """``examples/studies/one_node.yaml``'s estimate on its own resources (8 H100s)."""
    plan, cost, speeds = _study_cost("one_node.yaml", paper_evaluation=False)
    total = cost.total_gpu_hours
    wall = cost.sequential_s + cost.evaluation.wall_s
    return (f"On 8 H100s, from the committed measurements: {cost.tree_gpu_hours:,.1f} GPU-hours of training "
            f"({cost.sequential_s / 3600:,.1f} h, one segment after another), {cost.evaluation.runs:,} fine-tuning runs "
            f"({cost.evaluation_gpu_hours:,.1f} GPU-hours, {cost.evaluation.wall_s / 3600:,.1f} h on "
            f"{cost.evaluation.workers} workers, {_evaluation_source(cost)}): {total:,.1f} GPU-hours and "
            f"{wall / 3600:,.1f} h in all, of the node's 192 GPU-hours and 24 h. Speeds: {_size_speeds(plan, speeds)}.\n")


# -- each tool's --help --------------------------------------------------------------------------


def _program(*command: str) -> Program:
    """A program as a region names it: its file (``pretrain_encoder.py``), or ``-m`` and its module."""
    if command[0] == "-m":
        return Program(name=" ".join(command), module=command[1])
    return Program(name=command[0], script=REPO / command[0])


def render_cli_help(page: Path, *command: str) -> str:
    text = program_help(_program(*command)).rstrip()
    text = re.sub(r"usage: \S*?([\w.-]+\.py)", r"usage: \1", text)
    return f"```text\n{text}\n```\n"


def render_megatron_flags(page: Path) -> str:
    """Each Megatron-LM flag the trainer takes, beside Megatron-LM's default, and the refused ones
    (``megatron_ext.cli.megatron_flags``, the table its test keeps complete)."""
    from megatron_ext.cli.megatron_flags import flags_table
    from megatron_ext.cli.pretrain_encoder import build_parser

    return flags_table(*build_parser())


GENERATORS: dict[str, Callable[..., str]] = {  # each takes the page (for relative links), then its arguments
    "megatron-flags": render_megatron_flags,
    "gpu-status": render_gpu_status,
    "recipe-defaults": render_recipe_defaults,
    "preprocess-throughput": render_preprocess_throughput,
    "cpu-throughput": render_cpu_throughput,
    "scaling-estimates": render_scaling_estimates,
    "dry-run-plan": render_dry_run_plan,
    "recipe-keys": render_recipe_keys,
    "study-keys": render_study_keys,
    "exit-codes": render_exit_codes,
    "paper-grid-cost": render_paper_grid_cost,
    "one-node-cost": render_one_node_cost,
    "import-layers": render_import_layers,
    "unit-graph": render_unit_graph,
    "cli-help": render_cli_help,
}


def render_page(text: str, page: Path) -> str:
    """``text`` (the page at ``page``) with every generated region rendered now."""

    def fill(match: re.Match) -> str:
        name, *args = match["name"].split()
        if name not in GENERATORS:
            raise KeyError(f"unknown generated region {name!r}; expected one of {sorted(GENERATORS)}")
        return match["open"] + GENERATORS[name](page, *args) + match["close"]

    return REGION.sub(fill, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="render_docs.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a page is out of date")
    args = parser.parse_args(argv)
    stale = []
    for page in doc_pages():
        text = page.read_text()
        if "<!-- generated: " not in text:
            continue
        new = render_page(text, page)
        if new != text:
            stale.append(page.relative_to(REPO))
            if not args.check:
                page.write_text(new)
    for page in stale:
        print(f"{page}: {'out of date (run python -m tools.render_docs)' if args.check else 'rewritten'}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
