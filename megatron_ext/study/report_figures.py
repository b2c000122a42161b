"""The study report's figures: what each of the paper's figures draws (its series, by family), or
why it is skipped. Drawn as PNG by the evaluation's renderer (``study/report_files.py``).

PNG, one subplot per family; each drawn when the study has the runs it needs and they are evaluated,
otherwise named with the reason: score vs CLM share (MLM, or the biphasic runs' second objective, at
0 %; biphasic; CLM 100 %; one line per budget), score vs pretraining tokens (MLM and CLM runs: their
budgets' final checkpoints, and each run's evaluated checkpoints), continued pretraining against
added steps (from each source kind, the source's final score at +0) and score vs fine-tuning LR (one
line per kind at its longest evaluated run; the harness's score-vs-LR curves averaged over the
family's tasks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from megatron_ext.eval.families import FAMILIES
from megatron_ext.objectives import CLM, Objective
from megatron_ext.study.plan import StudyPlan
from megatron_ext.study.report_join import RunGroup
from megatron_ext.study.report_scores import GroupScores, Score
from megatron_ext.study.spec import BiphasicSpec, CptSpec, is_constant_mlm, steps_label

FIGURES_DIR = "figures"
"""The report folder's sub-folder of figures."""


@dataclass(frozen=True, kw_only=True)
class Series:
    """One line of a figure's subplot."""

    label: str
    points: tuple[tuple[float, Score], ...]
    """``(x, score)``, by x."""
    color: str
    """Lines with the same key share a colour across subplots."""
    dashed: bool = False


@dataclass(frozen=True, kw_only=True)
class Figure:
    """One figure of the report: a subplot per family, or the reason it was skipped."""

    name: str
    """File stem under ``figures/`` and key in ``report.json``."""
    title: str
    xlabel: str
    x_axis: Literal["steps", "percent", "tokens", "lr"] = "steps"
    """How x is drawn: counts, a share in %, token counts (B, T), learning rates (log scale)."""
    series: Mapping[str, tuple[Series, ...]] = dataclasses.field(default_factory=dict)
    """Family -> its lines; families without points are absent."""
    skipped: str | None = None

    @property
    def file(self) -> str:
        return f"{FIGURES_DIR}/{self.name}.png"


def _drawable(series: Mapping[str, Sequence[Series]]) -> dict[str, tuple[Series, ...]]:
    """The lines with at least one point, by family; families left without lines are dropped."""
    kept = {family: tuple(s for s in lines if s.points) for family, lines in series.items()}
    return {family: lines for family, lines in kept.items() if lines}


def _drawn(figure: Figure, series: Mapping[str, tuple[Series, ...]], *, too_few: str) -> Figure:
    """``figure`` with ``series``; skipped with ``too_few`` where no line has two points."""
    if max((len(s.points) for lines in series.values() for s in lines), default=0) < 2:
        return dataclasses.replace(figure, skipped=too_few)
    return dataclasses.replace(figure, series=series)


def _by_family(tasks: Mapping[str, Sequence[str]],
               line: Callable[[str], Sequence[Series]]) -> dict[str, tuple[Series, ...]]:
    return _drawable({family: tuple(line(family)) for family in tasks})


def _size_label(plan: StudyPlan, size: str, text: str) -> str:
    return f"{size} {text}" if len(plan.study.sizes) > 1 else text


def _objective_label(objective: Objective) -> str:
    """``MLM`` for MLM at a constant ratio (the paper's runs), else the objective's name (``wwm-40``)."""
    return "MLM" if is_constant_mlm(objective) else objective.name


def clm_share_figure(plan: StudyPlan, scores: GroupScores, tasks: Mapping[str, Sequence[str]]) -> Figure:
    """Score vs the share of CLM steps: the run of the biphasic runs' second objective alone at 0 %,
    each biphasic split, CLM at 100 %; a line per size and budget."""
    study = plan.study
    second = study.biphasic.objective if study.biphasic else BiphasicSpec.__dataclass_fields__["objective"].default
    shares = {second.study_kind: 0.0, CLM().study_kind: 1.0}
    if study.biphasic is not None:
        shares.update({study.biphasic.kind(share): share for share in study.biphasic.clm_shares})
    figure = Figure(name="clm_share", title=f"Score vs share of CLM steps (0 %: {_objective_label(second)}, 100 %: CLM)",
                    xlabel="share of pretraining steps with CLM (%)", x_axis="percent")
    kinds = set(study.scratch_kinds()) & set(shares)
    if len(kinds) < 2:
        has = ", ".join(sorted(kinds)) or "none"
        return dataclasses.replace(figure, skipped=f"the study has fewer than two of the runs it compares "
                                                   f"({', '.join(shares)}); it has {has}")
    lines = [(size.name, budget) for size in study.sizes for budget in study.budgets]

    def family_lines(family: str) -> list[Series]:
        found = []
        for size, budget in lines:
            points = sorted((100 * shares[g.first.kind], scores.final[g.label][family]) for g in scores.groups
                            if g.first.size == size and g.first.train_iters == budget and g.source is None
                            and g.first.kind in shares and family in scores.final.get(g.label, {}))
            found.append(Series(label=_size_label(plan, size, f"{steps_label(budget)} steps"), points=tuple(points),
                                color=f"{size}/{budget}"))
        return found

    return _drawn(figure, _by_family(tasks, family_lines),
                  too_few="no budget has two or more of those runs evaluated on every task of a family")


def tokens_figure(plan: StudyPlan, scores: GroupScores, tasks: Mapping[str, Sequence[str]]) -> Figure:
    """Score vs pretraining tokens for the single-objective runs (MLM, CLM): per kind, a solid line
    through the budgets' final checkpoints and a dashed one through each run's evaluated checkpoints."""
    kinds = [objective.kind for objective in plan.study.objectives]
    figure = Figure(name="tokens", title="Score vs pretraining tokens, MLM and CLM",
                    xlabel="pretraining tokens", x_axis="tokens")
    if not kinds:
        return dataclasses.replace(figure, skipped="the study has no single-objective (MLM or CLM) runs")
    scratch = [g for g in scores.groups if g.source is None and g.first.kind in kinds]

    def family_lines(family: str) -> list[Series]:
        found = []
        for size in plan.study.sizes:
            for kind in kinds:
                groups = [g for g in scratch if g.first.size == size.name and g.first.kind == kind]
                finals = [(g.first.train_iters * g.first.tokens_per_step, scores.final[g.label][family])
                          for g in groups if family in scores.final.get(g.label, {})]
                label = _size_label(plan, size.name, kind)
                found.append(Series(label=f"{label} (final checkpoints)", points=tuple(sorted(finals)),
                                    color=f"{size.name}/{kind}"))
                for group in groups:
                    steps = {step: at for (of, step), at in scores.at_step.items() if of == group.label}
                    if any(step != group.first.train_iters for step in steps):
                        points = sorted((tokens, by_key[family]) for tokens, by_key in steps.values()
                                        if family in by_key)
                        found.append(Series(label=f"{group.label} checkpoints", points=tuple(points),
                                            color=f"{size.name}/{kind}", dashed=True))
        return found

    return _drawn(figure, _by_family(tasks, family_lines),
                  too_few="no MLM or CLM run is evaluated at two or more token counts (budgets' final checkpoints "
                          "or RUN@STEP checkpoints)")


def cpt_figure(plan: StudyPlan, scores: GroupScores, tasks: Mapping[str, Sequence[str]]) -> Figure:
    """Continued pretraining against added steps: a line per source (CLM, MLM ...) through its
    continuations' final checkpoints, starting at the source's final score at +0."""
    objective = plan.study.cpt.objective if plan.study.cpt else CptSpec.__dataclass_fields__["objective"].default
    figure = Figure(name="cpt", title=f"Continued pretraining ({_objective_label(objective)}) from each source vs "
                                      "added steps",
                    xlabel="continued-pretraining steps added")
    cpt = [g for g in scores.groups if g.source is not None]
    if not cpt:
        return dataclasses.replace(figure, skipped="no CPT runs in this study")

    def family_lines(family: str) -> list[Series]:
        found = []
        for source in dict.fromkeys(g.source for g in cpt):
            points = [(float(g.first.train_iters), scores.final[g.label][family]) for g in cpt
                      if g.source == source and family in scores.final.get(g.label, {})]
            if points and family in scores.final.get(source, {}):
                points.append((0.0, scores.final[source][family]))
            kind = next(g for g in scores.groups if g.label == source).first.kind
            found.append(Series(label=f"from {kind} ({source})", points=tuple(sorted(points)), color=source))
        return found

    series = _by_family(tasks, family_lines)
    if not any(x > 0 for lines in series.values() for s in lines for x, _ in s.points):
        return dataclasses.replace(figure, skipped="no CPT run is evaluated on every task of a family")
    return dataclasses.replace(figure, series=series)


def lr_figure(plan: StudyPlan, scores: GroupScores, tasks: Mapping[str, Sequence[str]]) -> Figure:
    """Score vs fine-tuning LR, one line per kind (per size and CPT source) at its longest evaluated
    run: the harness's test means per LR averaged over the family's tasks (and pretraining seeds)."""
    figure = Figure(name="lr_sensitivity", title="Score vs fine-tuning learning rate (mean test score)",
                    xlabel="fine-tuning learning rate", x_axis="lr")
    longest: dict[tuple, RunGroup] = {}
    for group in scores.groups:
        if group.label in scores.lr_curves:
            key = (group.first.size, group.first.kind, group.source)
            if key not in longest or group.first.train_iters > longest[key].first.train_iters:
                longest[key] = group

    def family_lines(family: str) -> list[Series]:
        return [Series(label=group.label, color=group.label,
                       points=tuple((lr, Score(mean=mean, ci95=None, n=len(group.runs), over="pretraining seeds"))
                                    for lr, mean in scores.lr_curves[group.label].get(family, {}).items()))
                for group in longest.values()]

    # A zero-shot family (STS) has no LR: its one run is not a point of this figure.
    series = _by_family({family: names for family, names in tasks.items()
                         if family not in FAMILIES or not FAMILIES[family].zero_shot},
                        family_lines)
    if not series:
        return dataclasses.replace(figure, skipped="no study run is evaluated on every task of a family")
    return _drawn(figure, series, too_few="the evaluations have one fine-tuning LR")


FIGURES = (clm_share_figure, tokens_figure, cpt_figure, lr_figure)
"""The report's figures, in order."""
