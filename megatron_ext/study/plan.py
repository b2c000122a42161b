"""A study expanded to its runs, and the runs arranged as a tree of training segments.

**Runs.** Each run of a study is a full recipe (the size's base recipe, the study's overrides,
phases, ``training.train_iters``, ``training.seed``, output paths; a continued pretraining also
``checkpoint.load`` = its source's ``save`` and ``checkpoint.finetune``): what
``pretrain_encoder.py --config`` would train as a separate run.

**Segments.** Runs that compute the same thing on their first ``n`` steps
(``training.branching.shared_steps``: same run definition, and at every step the same phase,
masking ratio and learning rate) need those steps trained once. Each run is one segment
``[start, end)`` of its steps:

- ``scratch``: ``[0, train_iters)`` from step 0;
- ``branch``: ``[b, train_iters)`` from the full state (weights, optimizer, step, RNG) of its
  parent's checkpoint at step ``b``: the parent's trajectory is this run's up to ``b``;
- ``weights``: a continued pretraining, ``[0, train_iters)`` on its own step count, from the
  weights of its source's final (decayed) checkpoint.

Runs are placed longest first (the long run owns the trunk; a shorter budget branches off it),
each at the latest step it shares with a run already placed. The branch step is then moved back
to the child's own last schedule point within the shared steps (a phase start, the warmup end or
the start of its WSD decay): a 12K run shares 10,001 steps with the 42K run (its first lowered
rate is at step 10,001) and branches at 10,000, where its decay begins; a 25/75 biphasic run
branches off the CLM run where its MLM phase begins. A parent saves, and keeps, every step a
child branches from.

**Decay mixtures and merges.** With ``decay_mixtures`` every from-scratch run is planned on the
trunk blend and again per decay mixture, its phases cut at its WSD decay start (:func:`decay_phases`):
a decay run is its trunk run up to there, so it branches off the trunk where its decay begins. A
merge (``merges``) is no segment: a :class:`PlannedMerge` of its runs' final checkpoints, whose TIES
base is the checkpoint where those runs part (a step their owner saves and keeps).

**Recipes of the tree.** Once placed, each run's recipe says where its segment starts: a branch
``checkpoint.branch_from`` (its parent's ``checkpoint.save``) and ``checkpoint.branch_step``, a
parent ``checkpoint.keep_steps`` (its segment's ``saves``). Trained one after another, parents
first, the recipes train the tree; each run's steps are the separate run's (the trainer refuses a
branch whose recipe differs from its parent's before the branch step).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from megatron_ext.config_loading import ConfigError, UserError, build_dataclass
from megatron_ext.phases import Phase, resolve_phases
from megatron_ext.schedule import LRScheduleConfig
from megatron_ext.study.spec import MergeSpec, MixtureSpec, Study, steps_label
from megatron_ext.training.branching import shared_steps
from megatron_ext.training.config import RunConfig, TrainingConfig
from megatron_ext.training.preflight import Caller, preflight
from megatron_ext.training.recipe import deep_merge, needs_tokenizer_vocab, read_recipe, run_config_from_dict

VOCAB_NOT_READ = 128
"""The vocabulary a ``model.vocab_size: from_tokenizer`` run is validated with: a plan reads no
tokenizer, and runs that name the same tokenizer compare equal anyway."""

Start = Literal["scratch", "branch", "weights"]


@dataclass(frozen=True, kw_only=True)
class PlannedRun:
    """One run of a study, as a separate run would train it."""

    name: str
    """Unique in the study: ``{size}_{kind}_{budget}`` (``610m_biphasic_25_75_12k``); a continued
    pretraining is ``{source}_{cpt kind}_{steps}`` (``610m_clm_42k_cpt_mlm_40_2k``)."""
    size: str
    """The size's name."""
    seed: int
    """``training.seed``."""
    kind: str
    """``clm``, ``mlm_40``, ``biphasic_25_75`` or ``cpt_mlm_40``."""
    source: str | None
    """A continued pretraining's source run (its final checkpoint's weights); None otherwise."""
    recipe: dict[str, Any]
    """The full recipe (YAML-able), ``base:`` resolved."""
    config: RunConfig = field(repr=False, compare=False)
    """``recipe`` validated."""

    @property
    def train_iters(self) -> int:
        return self.config.training.train_iters

    @property
    def tokens_per_step(self) -> int:
        return self.config.data.global_batch_size * self.config.data.seq_length


@dataclass(frozen=True, kw_only=True)
class Segment:
    """The steps of one run that the tree trains, and where they start from."""

    run: str
    """The run (its recipe, its ``checkpoint.save``) this segment trains."""
    start: int
    """First step trained (the run's own step count)."""
    end: int
    """One past the last step: the run's ``train_iters``."""
    start_from: Start
    """``scratch``, ``branch`` (full state at ``branch_step`` of ``parent``) or ``weights`` (the
    weights of ``parent``'s checkpoint at ``branch_step``, its last; fresh optimizer, step 0)."""
    parent: str | None
    """The run whose checkpoint this segment starts from (None: from scratch)."""
    branch_step: int | None
    """The step of that checkpoint."""
    shared_steps: int | None
    """``branch``: how many steps the run shares with its parent from step 0 (>= ``branch_step``)."""
    saves: tuple[int, ...] = ()
    """Steps of this run that children start from: saved and kept (never pruned)."""

    @property
    def steps(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, kw_only=True)
class PlannedMerge:
    """One merged model of a study: ``tools/merge_checkpoints.py`` over the final checkpoints of
    ``parents`` once they are trained."""

    name: str
    """``{size}_{merge}_{budget}`` with the parents' seed and isolation suffixes (``_s<seed>``, ``_iso``)."""
    size: str
    seed: int
    spec: MergeSpec
    """The study's ``merges`` entry (method, weights, density, lambda)."""
    parents: tuple[str, ...]
    """The runs merged, in the entry's order."""
    parent_saves: tuple[str, ...]
    """Their ``checkpoint.save`` (the tool takes a save directory's newest checkpoint: the final)."""
    save: str
    """The merged model's save directory (``output.save`` with ``{run}`` = ``name``)."""
    base_run: str | None = None
    """TIES: the run that trains the parents' last shared step (it saves and keeps that step)."""
    base_step: int | None = None
    """TIES: the step where the parents part (their branch step)."""
    base: str | None = None
    """TIES: ``--base``, the checkpoint of ``base_run`` at ``base_step``."""

    def args(self) -> list[str]:
        """``merge_checkpoints.py``'s arguments."""
        spec = self.spec
        args = ["--method", spec.method, *self.parent_saves, "--out", self.save]
        if self.base is not None:
            args += ["--base", self.base]
        for flag, value in (("--density", spec.density), ("--lambda", spec.scale)):
            if value is not None:
                args += [flag, str(value)]
        if spec.weights is not None:
            args += ["--weights", *(str(w) for w in spec.weights)]
        return args


@dataclass(frozen=True, kw_only=True)
class StudyPlan:
    """The runs of a study and the tree of segments that trains them."""

    study: Study
    path: Path
    """The study file."""
    runs: tuple[PlannedRun, ...]
    """In study order: per size and seed, objectives then biphasic (each over ``budgets``), then
    continued pretraining."""
    segments: tuple[Segment, ...]
    """One per run, in the order of ``runs``."""
    merges: tuple[PlannedMerge, ...] = ()
    """Merged models, per size and seed (and isolation setting), in the order of ``study.merges``."""

    def run(self, name: str) -> PlannedRun:
        return next(r for r in self.runs if r.name == name)

    def segment(self, name: str) -> Segment:
        return next(s for s in self.segments if s.run == name)

    def children(self, name: str | None) -> list[Segment]:
        """Segments starting from ``name``'s checkpoints (None: the roots), by step, then in study order."""
        order = {r.name: i for i, r in enumerate(self.runs)}
        found = [s for s in self.segments if s.parent == name]
        return sorted(found, key=lambda s: (s.branch_step or 0, order[s.run]))

    @property
    def steps_separate(self) -> int:
        return sum(r.train_iters for r in self.runs)

    @property
    def steps_tree(self) -> int:
        return sum(s.steps for s in self.segments)

    @property
    def tokens_separate(self) -> int:
        return sum(r.train_iters * r.tokens_per_step for r in self.runs)

    @property
    def tokens_tree(self) -> int:
        return sum(s.steps * self.run(s.run).tokens_per_step for s in self.segments)

    def wall_steps(self, rule: Literal["separate", "checkpoint", "parent_done"],
                   step_cost: dict[str, float] | None = None) -> float:
        """Steps on the longest chain with one machine per run or segment: ``separate`` runs (a
        continued pretraining after its source), segments starting as soon as their parent's
        checkpoint exists (``checkpoint``), or once their parent's segment is done
        (``parent_done``: a job dependency on the parent's job). ``step_cost``: the seconds of a
        step of each run (the chain's wall time instead of its steps)."""
        cost = (lambda name: 1) if step_cost is None else step_cost.__getitem__
        done: dict[str, float] = {}
        began: dict[str, float] = {}
        for segment in self._parents_first():
            run = self.run(segment.run)
            if rule == "separate":
                began[run.name] = done[run.source] if run.source else 0
                done[run.name] = began[run.name] + run.train_iters * cost(run.name)
                continue
            parent = self.segment(segment.parent) if segment.parent else None
            if parent is None:
                began[run.name] = 0
            elif segment.start_from == "weights" or rule == "parent_done":
                began[run.name] = done[parent.run]
            else:
                began[run.name] = began[parent.run] + (segment.branch_step - parent.start) * cost(parent.run)
            done[run.name] = began[run.name] + segment.steps * cost(run.name)
        return max(done.values())

    def _parents_first(self) -> list[Segment]:
        order, todo = [], [None]
        while todo:
            for child in self.children(todo.pop(0)):
                order.append(child)
                todo.append(child.run)
        return order


def _base_recipe(study: Study, path: Path, index: int) -> dict[str, Any]:
    size = study.sizes[index]
    base_path = path.parent / size.base
    if not base_path.is_file():
        raise ConfigError(f"{path}: sizes[{index}].base: {base_path}: no such recipe")
    try:
        base = read_recipe(base_path)
    except ConfigError as err:
        raise ConfigError(f"{path}: sizes[{index}].base: {err}") from None
    if "phases" in base:
        raise ConfigError(f"{path}: sizes[{index}].base: {base_path} sets phases; a study's base recipe "
                          "must not (the study sets them): use a size base such as examples/recipes/base/")
    return deep_merge(base, study.overrides) if study.overrides else base


def run_name(*, size: str, kind: str, steps: int, seed: int, base_seed: int, isolated: bool | None) -> str:
    """``{size}_{kind}_{steps}``, ``_s<seed>`` at a seed other than the base's, ``_iso`` when isolated."""
    return (f"{size}_{kind}_{steps_label(steps)}" + (f"_s{seed}" if seed != base_seed else "")
            + ("_iso" if isolated else ""))


def decay_phases(phases: list[dict], *, recipe: dict[str, Any], steps: int, trunk: MixtureSpec, decay: MixtureSpec,
                 where: str) -> list[dict]:
    """``phases`` of a run of ``steps`` steps as step counts, cut at the start of the WSD decay
    (``recipe``'s schedule): ``trunk``'s data before it, ``decay``'s from it."""
    try:
        schedule = build_dataclass(LRScheduleConfig, recipe.get("schedule") or {}, "schedule")
        resolved = resolve_phases([Phase.from_config(p, f"phases[{i}]") for i, p in enumerate(phases)], steps)
    except UserError as err:
        raise ConfigError(f"{where}: {err}") from None
    if schedule.lr_decay_style != "wsd":
        raise ConfigError(f"{where}: decay_mixtures needs schedule.lr_decay_style: wsd (a decay of its own at the "
                          f"end of the run), got {schedule.lr_decay_style!r}")
    start = steps - schedule.lr_wsd_decay_iters
    if start < 1:
        raise ConfigError(f"{where}: schedule.lr_wsd_decay_iters {schedule.lr_wsd_decay_iters} leaves no steps "
                          f"before the decay of a {steps}-step run")
    cut = []
    for phase, placed in zip(phases, resolved):
        steady = {key: value for key, value in phase.items() if key != "share"}
        for begin, end, mixture in ((placed.start, min(placed.end, start), trunk),
                                    (max(placed.start, start), placed.end, decay)):
            if end > begin:
                piece = {**steady, "steps": end - begin, **mixture.phase_keys()}
                if begin > placed.start:  # the decay continues the phase: no second warmup
                    piece.pop("restart_warmup", None)
                cut.append(piece)
    return cut


def expand_runs(study: Study, path: str | Path) -> tuple[list[PlannedRun], list[PlannedMerge]]:
    """Every run of ``study`` (read from ``path``; base recipes are relative to it), validated, and
    its merges (their TIES base not yet placed: :func:`plan_study`)."""
    path = Path(path)
    runs: list[PlannedRun] = []
    merges: list[PlannedMerge] = []
    names: set[str] = set()

    def add(*, size: str, seed: int, base_seed: int, kind: str, steps: int, base: dict, phases: list,
            source: PlannedRun | None = None, overrides: dict | None = None, isolated: bool | None = None
            ) -> PlannedRun:
        if source is None:
            name = run_name(size=size, kind=kind, steps=steps, seed=seed, base_seed=base_seed, isolated=isolated)
        else:
            name = f"{source.name}_{kind}_{steps_label(steps)}"
        if name in names:
            raise ConfigError(f"{path}: two runs are named {name}")
        names.add(name)
        outputs = dict(study=study.name, run=name, size=size, seed=seed)
        recipe = deep_merge(base, overrides) if overrides else base
        checkpoint: dict[str, Any] = {"save": study.output.render("save", **outputs)}
        if source is not None:
            checkpoint.update(load=source.recipe["checkpoint"]["save"], finetune=True)
        recipe = deep_merge(recipe, {
            "phases": phases,
            "training": {"train_iters": steps, "seed": seed},
            "checkpoint": checkpoint,
            "logging": {"log_dir": study.output.render("log_dir", **outputs)},
        })
        run = PlannedRun(name=name, size=size, seed=seed, kind=kind, source=source.name if source else None,
                         recipe=recipe, config=_validated(recipe, path, name))
        runs.append(run)
        return run

    def add_scratch(*, kind: str, steps: int, phases: list, **common) -> None:
        """The run of ``kind``, and with decay mixtures, the same on the trunk blend and per decay mixture."""
        mixtures = study.decay_mixtures
        if mixtures is None:
            scratch[kind, steps] = add(**common, kind=kind, steps=steps, phases=phases)
            return
        for decay in (mixtures.trunk, *mixtures.decays):
            variant = kind if decay is mixtures.trunk else mixtures.decay_kind(kind, decay)
            where = f"{path}: run {run_name(kind=variant, steps=steps, **naming)}"
            scratch[variant, steps] = add(**common, kind=variant, steps=steps, phases=decay_phases(
                phases, recipe=common["base"], steps=steps, trunk=mixtures.trunk, decay=decay, where=where))

    for index, size in enumerate(study.sizes):
        base = _base_recipe(study, path, index)
        base_seed = (base.get("training") or {}).get("seed", TrainingConfig.__dataclass_fields__["seed"].default)
        for seed, isolated in [(seed, isolated) for seed in study.seeds or (base_seed,)
                               for isolated in study.reset_attention_mask or (None,)]:
            scratch: dict[tuple[str, int], PlannedRun] = {}
            axis_base = base if isolated is None else deep_merge(base, {"data": {"reset_attention_mask": isolated}})
            common = dict(size=size.name, seed=seed, base_seed=base_seed, base=axis_base, isolated=isolated)
            naming = dict(size=size.name, seed=seed, base_seed=base_seed, isolated=isolated)
            for objective in study.objectives:
                for budget in study.budgets:
                    add_scratch(**common, kind=objective.kind, steps=budget, phases=objective.phases())
            if study.biphasic is not None:
                for share in study.biphasic.clm_shares:
                    for budget in study.budgets:
                        add_scratch(**common, kind=study.biphasic.kind(share), steps=budget,
                                    phases=study.biphasic.phases(share))
            if study.cpt is not None:
                for source_kind in study.cpt.sources:
                    source = scratch[source_kind, study.cpt_source_budget]
                    for continuation in study.cpt.continuations:
                        add(**common, kind=study.cpt.kind, steps=continuation.steps, phases=study.cpt.phases(),
                            source=source, overrides=continuation.overrides)
            for merge in study.merges:
                budget = study.merge_budget(merge)
                name = run_name(kind=merge.name, steps=budget, **naming)
                if name in names:
                    raise ConfigError(f"{path}: merge {merge.name} and a run are both named {name}")
                names.add(name)
                parents = tuple(scratch[kind, budget] for kind in merge.runs)
                merges.append(PlannedMerge(
                    name=name, size=size.name, seed=seed, spec=merge, parents=tuple(p.name for p in parents),
                    parent_saves=tuple(p.recipe["checkpoint"]["save"] for p in parents),
                    save=study.output.render("save", study=study.name, run=name, size=size.name, seed=seed)))
    return runs, merges


def _validated(recipe: dict[str, Any], path: Path, name: str) -> RunConfig:
    """``recipe`` as a run config, through the run's pre-flight for a plan (``training.preflight``:
    the config's rules and the model's split over its parallel sizes; the world size, the machine,
    the data and the tokenizer are the launch's, checked when each run starts)."""
    try:
        vocab = VOCAB_NOT_READ if needs_tokenizer_vocab(recipe) else None
        config = run_config_from_dict(recipe, tokenizer_vocab_size=vocab)
    except ConfigError as err:
        raise ConfigError(f"{path}: run {name}: {err}") from None
    try:
        preflight(config, Caller.STUDY_PLAN)
    except UserError as err:
        raise ConfigError(f"{path}: run {name}: {err}") from None
    return config


def _in_the_tree(run: PlannedRun, segment: Segment, parent: PlannedRun | None, path: Path) -> PlannedRun:
    """``run`` with the checkpoint keys that make its recipe train ``segment``: a branch's
    ``branch_from``/``branch_step``, a parent's ``keep_steps``."""
    keys: dict[str, Any] = {}
    if segment.start_from == "branch":
        keys.update(branch_from=parent.recipe["checkpoint"]["save"], branch_step=segment.branch_step)
    if segment.saves:
        keys["keep_steps"] = list(segment.saves)
    if not keys:
        return run
    recipe = deep_merge(run.recipe, {"checkpoint": keys})
    return dataclasses.replace(run, recipe=recipe, config=_validated(recipe, path, run.name))


def schedule_points(config: RunConfig) -> list[int]:
    """The steps where a run's own schedule changes course: 0, each phase start, the end of each
    warmup and the start of the WSD decay. A branch is placed at one of them."""
    total, schedule = config.training.train_iters, config.schedule
    resolved = config.resolved_phases
    points = {0, schedule.lr_warmup_iters, *(p.start for p in resolved)}
    points.update(p.start + schedule.lr_warmup_iters for p in resolved if p.restart_warmup)
    if schedule.lr_decay_style == "wsd":
        points.add(total - schedule.lr_wsd_decay_iters)
    return sorted(p for p in points if 0 <= p < total)


def _owner(segments: dict[str, Segment], name: str, step: int) -> str:
    """The run whose segment trains step ``step`` of ``name``'s trajectory (``0 < step``)."""
    segment = segments[name]
    while not segment.start < step:  # the step lies before this segment: its parent trained it
        assert segment.start_from == "branch", segment
        segment = segments[segment.parent]
    return segment.run


def plan_study(study: Study, path: str | Path) -> StudyPlan:
    """Expand ``study`` and arrange its runs as a tree of segments (module docstring)."""
    path = Path(path)
    runs, merges = expand_runs(study, path)
    by_name = {r.name: r for r in runs}
    # Longest first, then study order; a continued pretraining after every run it may start from.
    order = sorted(runs, key=lambda r: (r.source is not None, -r.train_iters))
    segments: dict[str, Segment] = {}
    placed: list[PlannedRun] = []
    for run in order:
        best, partner = 0, None
        for other in placed:
            shared = shared_steps(other.config, run.config)
            if shared > best:
                best, partner = shared, other
        if best >= run.train_iters:
            raise ConfigError(f"{path}: runs {partner.name} and {run.name} are the same run for all "
                              f"{run.train_iters} steps of {run.name}; remove one")
        step = max(p for p in schedule_points(run.config) if p <= best)
        if step > 0:
            segments[run.name] = Segment(run=run.name, start=step, end=run.train_iters, start_from="branch",
                                         parent=_owner(segments, partner.name, step), branch_step=step,
                                         shared_steps=best)
        elif run.source is not None:
            segments[run.name] = Segment(run=run.name, start=0, end=run.train_iters, start_from="weights",
                                         parent=run.source, branch_step=by_name[run.source].train_iters,
                                         shared_steps=None)
        else:
            segments[run.name] = Segment(run=run.name, start=0, end=run.train_iters, start_from="scratch",
                                         parent=None, branch_step=None, shared_steps=None)
        placed.append(run)
    saves: dict[str, set[int]] = {name: set() for name in segments}
    for segment in segments.values():
        if segment.parent is not None:
            saves[segment.parent].add(segment.branch_step)
    merges = [_with_base(merge, by_name, segments, path) if merge.spec.method == "ties" else merge
              for merge in merges]
    for merge in merges:
        if merge.base_run is not None:
            saves[merge.base_run].add(merge.base_step)
    tree = [dataclasses.replace(segments[r.name], saves=tuple(sorted(saves[r.name]))) for r in runs]
    return StudyPlan(
        study=study, path=path, segments=tuple(tree), merges=tuple(merges),
        runs=tuple(_in_the_tree(run, segment, by_name.get(segment.parent), path) for run, segment in zip(runs, tree)),
    )


def _with_base(merge: PlannedMerge, runs: dict[str, PlannedRun], segments: dict[str, Segment],
               path: Path) -> PlannedMerge:
    """A TIES merge with its base: the checkpoint at the step where its parents part, each pair at the
    same step (the last schedule point they share, where the tree branches them: a decay start)."""
    parts: dict[int, tuple[str, str]] = {}
    for i, a in enumerate(merge.parents):
        for b in merge.parents[i + 1:]:
            shared = shared_steps(runs[a].config, runs[b].config)
            step = min(max(p for p in schedule_points(runs[name].config) if p <= shared) for name in (a, b))
            parts.setdefault(step, (a, b))
    where = f"{path}: merges {merge.spec.name} ({merge.name}), method ties"
    if len(parts) > 1:
        found = "; ".join(f"{a} and {b} part at step {step:,}" for step, (a, b) in sorted(parts.items()))
        raise ConfigError(f"{where}: its runs must branch off one trajectory at one step (the base is the "
                          f"checkpoint there), but {found}; merge those of one branch step, or use method uniform")
    (step,) = parts
    if step == 0:
        raise ConfigError(f"{where}: its runs share no steps, so no checkpoint is their common base; "
                          "merge runs branched off one trunk, or use method uniform")
    owner = _owner(segments, merge.parents[0], step)
    save = runs[owner].recipe["checkpoint"]["save"]
    return dataclasses.replace(merge, base_run=owner, base_step=step,
                               base=str(Path(save) / f"iter_{step:07d}"))  # the writer's checkpoint name


def plan_to_dict(plan: StudyPlan) -> dict[str, Any]:
    """The plan as plain data (JSON-able): what the launch layer reads."""
    return {
        "study": plan.study.name,
        "study_file": str(plan.path),
        "runs": [{"name": r.name, "size": r.size, "seed": r.seed, "kind": r.kind, "source": r.source,
                  "train_iters": r.train_iters, "tokens_per_step": r.tokens_per_step, "recipe": r.recipe}
                 for r in plan.runs],
        "segments": [dataclasses.asdict(s) for s in plan.segments],
        "merges": [{"name": m.name, "size": m.size, "seed": m.seed, "method": m.spec.method, "parents": list(m.parents),
                    "save": m.save, "base_run": m.base_run, "base_step": m.base_step, "args": m.args()}
                   for m in plan.merges],
        "totals": {"steps_separate": plan.steps_separate, "steps_tree": plan.steps_tree,
                   "tokens_separate": plan.tokens_separate, "tokens_tree": plan.tokens_tree},
    }
