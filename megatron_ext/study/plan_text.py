"""The plan of a study as text: the segment tree, each run's steps alone and in the tree, totals."""

from __future__ import annotations

from megatron_ext.study.plan import Segment, StudyPlan


def _n(value: int) -> str:
    return f"{value:,}"


def _tokens(value: int) -> str:
    for unit, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6)):
        if value >= scale:
            return f"{value:,} ({value / scale:.2f}{unit})"
    return f"{value:,}"


def _start(segment: Segment, recipe: dict) -> str:
    if segment.start_from == "scratch":
        # A size base may load weights itself (an imported model's recipe_model.yaml): say so.
        return "base's weights" if (recipe.get("checkpoint") or {}).get("load") else "from scratch"
    if segment.start_from == "weights":
        return f"weights at {_n(segment.branch_step)}"
    return f"branch at {_n(segment.branch_step)}"


def tree_rows(plan: StudyPlan) -> list[tuple[str, Segment]]:
    """``(indented name, segment)`` in tree order, children under their parent with box lines."""
    rows: list[tuple[str, Segment]] = []

    def walk(parent: str | None, prefix: str) -> None:
        children = plan.children(parent)
        for i, segment in enumerate(children):
            last = i == len(children) - 1
            if parent is None:
                head, below = "", ""
            else:
                head = prefix + ("└── " if last else "├── ")
                below = prefix + ("    " if last else "│   ")
            rows.append((head + segment.run, segment))
            walk(segment.run, below)

    walk(None, "")
    return rows


def merge_rows(plan: StudyPlan) -> list[str]:
    """The merges, each with its parents, base and command (none: no lines)."""
    if not plan.merges:
        return []
    out = ["", "merges: a model merged from the final checkpoints of its runs by tools/merge_checkpoints.py (CPU,",
           "seconds to minutes), run once they are trained; ties against the checkpoint where its runs part"]
    for merge in plan.merges:
        spec = merge.spec
        how = spec.method if spec.method == "uniform" else (
            f"ties (density {spec.config().density:g}, lambda {spec.config().scale:g})")
        weights = "" if spec.weights is None else " weights " + " ".join(f"{w:g}" for w in spec.weights)
        against = "" if merge.base_run is None else f", base {merge.base_run} at {_n(merge.base_step)}"
        out += [f"  {merge.name}: {how} of {', '.join(merge.parents)}{weights}{against}",
                f"    merge_checkpoints.py {' '.join(merge.args())}"]
    return out


def format_plan(plan: StudyPlan) -> str:
    """What ``plan_study.py --dry-run`` prints."""
    sizes = ", ".join(s.name for s in plan.study.sizes)
    out = [f"study {plan.study.name} ({plan.path}): {len(plan.runs)} runs ({sizes}), "
           f"{sum(1 for s in plan.segments if s.start_from == 'scratch')} from step 0",
           "",
           "segment tree: the steps [start, end) each run trains, and where it starts: from scratch; a branch",
           "(the parent's full state at that step: the same run up to there); weights (the parent's final",
           "weights, a fresh optimizer and step count: continued pretraining). 'keeps': the steps a run saves",
           "for its children and never prunes. 'base's weights': from step 0, from the weights its size's base",
           "recipe loads (checkpoint.load, e.g. an imported model's recipe_model.yaml)."]
    rows = tree_rows(plan)
    width = max(len(name) for name, _ in rows) + 2
    for name, segment in rows:
        line = (f"  {name:<{width}}[{segment.start:>7,}, {segment.end:>7,})  {segment.steps:>7,} steps  "
                f"{_start(segment, plan.run(segment.run).recipe):<20}")
        if segment.saves:
            line += "keeps " + " ".join(_n(s) for s in segment.saves)
        out.append(line.rstrip())

    out += ["", "runs: steps alone (a separate run) and in the tree"]
    width = max(len(r.name) for r in plan.runs) + 2
    out.append(f"  {'run':<{width}}{'alone':>9}{'in the tree':>13}")
    for run in plan.runs:
        out.append(f"  {run.name:<{width}}{run.train_iters:>9,}{plan.segment(run.name).steps:>13,}")
    out.append(f"  {'total':<{width}}{plan.steps_separate:>9,}{plan.steps_tree:>13,}")

    out += merge_rows(plan)

    saved_steps = plan.steps_separate - plan.steps_tree
    per_step = sorted({r.tokens_per_step for r in plan.runs})
    out += [
        "",
        "totals (tokens = steps x global batch x sequence length: "
        + ", ".join(_n(t) for t in per_step) + " per step)",
        f"  separate runs: {plan.steps_separate:>11,} steps  {_tokens(plan.tokens_separate)} tokens",
        f"  as the tree:   {plan.steps_tree:>11,} steps  {_tokens(plan.tokens_tree)} tokens",
        f"  saved:         {saved_steps:>11,} steps  {_tokens(plan.tokens_separate - plan.tokens_tree)} tokens"
        f"  ({100 * saved_steps / plan.steps_separate:.1f} % of the steps)",
        f"  longest chain with one machine per run or segment: {plan.wall_steps('separate'):,} steps as "
        "separate runs;",
        f"    as the tree {plan.wall_steps('checkpoint'):,} if a segment starts once its branch checkpoint "
        "exists, "
        f"{plan.wall_steps('parent_done'):,} if it waits until its parent's segment is done",
        "",
        "exact branches: the run definitions and, at every shared step, the phase, masking ratio and learning",
        "rate were compared (training.branching); the sample order is assumed the same at every run length,",
        "true while each dataset is read within one epoch (Megatron shuffles over the epochs a length builds):",
        "each branch compares it from the data files when it starts, and is refused where it differs",
        "",
        "recipes (--plan-json): a branch has checkpoint.branch_from (its parent's save) and branch_step, a",
        "parent checkpoint.keep_steps; trained parents first, each recipe trains its segment",
    ]
    return "\n".join(out)
