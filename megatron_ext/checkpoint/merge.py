"""Merging checkpoints: one model from several trained off a common trunk, as mmBERT (arXiv
2509.06888) made its released models from decay branches of one pretraining run.

Methods (pure functions over state dicts, then :func:`merge_checkpoints` over real checkpoints):

- ``uniform``: the (weighted) average of the parents' weights, the weights normalised to sum 1.
- ``ties``: TIES-merging (Yadav et al. 2023, arXiv 2306.01708) against ``base``, the checkpoint the
  parents branched from (the trunk at the branch step). Task vectors ``tau_i = parent_i - base``;
  *trim*: each keeps its ``density`` largest-magnitude entries, the rest set to 0; *elect*: the sign
  per entry is the sign of the sum of the trimmed ``tau_i`` (weighted: of ``w_i tau_i``); *disjoint
  mean*: the (weighted) mean over the parents whose trimmed entry is nonzero and has the elected
  sign (0 where the sum is 0 or none agrees); merged ``= base + lambda x`` that mean.

Only floating-point tensors are merged (in float64, rounded back to the saved dtype); any other
entry must be equal in every input, else refused naming the key. Inputs must be one architecture
(``model_config.json``), one tokenizer, and hold the same keys and shapes: refused in one line
naming the input and what differs.

Output: a save directory holding one weights-only checkpoint, ``iter_0000000`` (no optimizer state,
an empty trainer state: like an import from Hugging Face, it is a starting point, not a run to
resume), and ``merge.json``, the provenance (method, parents and their steps, base, weights,
density, lambda, sign conflicts), also recorded as ``merge`` in the checkpoint's ``run_config.json``
beside what the parents last trained (``trained_objective``: exports record it; parents whose outputs
predict at other positions, MNTP and MLM, are refused).
It starts further training as ``checkpoint: {load: DIR, finetune: true}`` (fresh optimizer and
schedule from step 0) and exports and evaluates like any checkpoint. The parents' state dicts are
held in host memory, with a few float64 copies of one tensor at a time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from megatron_ext.checkpoint.reader import TOKENIZER_FINGERPRINT, TRAINED_OBJECTIVE, Checkpoint
from megatron_ext.checkpoint.single_process import (load_megatron_checkpoint, save_weights,
                                                    single_process_model_parallel)
from megatron_ext.config_loading import UserError
from megatron_ext.fileio import is_empty_dir_or_absent, publish_dir, staged_dir

METHODS = ("uniform", "ties")
DEFAULT_DENSITY = 0.2
"""TIES's share of each task vector kept: the paper's top-k with k = 20 % (Yadav et al. 2023,
Sec. 5-6, its default across experiments). mergekit's ``ties`` instead defaults ``density`` to 1.0
(no trimming: ``generalized_task_arithmetic.py``), leaving the choice to each merge's config."""
DEFAULT_LAMBDA = 1.0
"""TIES's scale of the merged task vector: the paper picks it on validation data and reports 1 as
the value that works without any (as does mergekit, which applies no scale in ``ties``)."""
PROVENANCE = "merge.json"
"""Beside the merged checkpoint in the output directory: how it was made."""
MERGE_KEY = "merge"
"""Key of the merged checkpoint's ``run_config.json`` holding the same provenance."""

StateDict = Mapping[str, Any]


@dataclass(frozen=True, kw_only=True)
class MergeConfig:
    """How to merge (``--method``, ``--weights``, ``--density``, ``--lambda``)."""

    method: Literal["uniform", "ties"]
    weights: tuple[float, ...] | None = None
    """One per parent, > 0, normalised to sum 1 (None: equal)."""
    density: float | None = None
    """TIES: share of each task vector kept, in (0, 1] (None: :data:`DEFAULT_DENSITY`)."""
    scale: float | None = None
    """TIES: lambda, the merged task vector's scale (None: :data:`DEFAULT_LAMBDA`)."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise UserError(f"--method {self.method!r}: expected one of {', '.join(METHODS)}")
        if self.weights is not None:
            object.__setattr__(self, "weights", tuple(float(w) for w in self.weights))
            if not self.weights or any(not math.isfinite(w) or w <= 0 for w in self.weights):
                raise UserError(f"--weights {list(self.weights)}: expected one positive number per parent")
        if self.method == "uniform":
            given = [flag for flag, value in (("--density", self.density), ("--lambda", self.scale)) if value is not None]
            if given:
                raise UserError(f"{' and '.join(given)} {'belong' if len(given) > 1 else 'belongs'} to --method ties; "
                                "uniform averages the parents")
            return
        object.__setattr__(self, "density", DEFAULT_DENSITY if self.density is None else float(self.density))
        object.__setattr__(self, "scale", DEFAULT_LAMBDA if self.scale is None else float(self.scale))
        if not 0 < self.density <= 1:
            raise UserError(f"--density {self.density}: expected a share of each task vector in (0, 1]")
        if not math.isfinite(self.scale):
            raise UserError(f"--lambda {self.scale}: expected a finite number")


@dataclass(frozen=True, kw_only=True)
class MergeStats:
    """What a merge did, for its summary line."""

    tensors: int
    """Floating-point tensors merged."""
    parameters: int
    """Their entries."""
    changed: int | None = None
    """TIES: entries where at least one trimmed task vector is nonzero."""
    conflicts: int | None = None
    """TIES: those of them where the trimmed task vectors' nonzero entries differ in sign."""

    @property
    def conflict_share(self) -> float | None:
        """TIES: the share of ``changed`` entries with a sign conflict (None: not TIES, or none changed)."""
        return self.conflicts / self.changed if self.changed else None


# --- Pure functions over state dicts -------------------------------------------------------------


def normalised_weights(weights: Sequence[float] | None, count: int) -> tuple[float, ...]:
    """``weights`` (one per parent) scaled to sum 1; None: equal weights."""
    if weights is None:
        return (1.0 / count,) * count
    if len(weights) != count:
        raise UserError(f"--weights: {len(weights)} given for {count} parents; give one per parent")
    total = math.fsum(weights)
    return tuple(w / total for w in weights)


def check_same_layout(states: Sequence[StateDict], names: Sequence[str]) -> None:
    """``UserError`` naming the input and the key unless every state dict has the first one's keys,
    and its floating-point tensors the same shapes and dtypes."""
    reference, first = states[0], names[0]
    for state, name in zip(states[1:], names[1:]):
        missing, extra = sorted(reference.keys() - state.keys()), sorted(state.keys() - reference.keys())
        if missing or extra:
            where = f"lacks {missing[0]}" if missing else f"has {extra[0]}"
            raise UserError(f"{name} {where}, which {first} {'has' if missing else 'lacks'}: inputs of a merge "
                            "must hold the same tensors")
        for key, value in reference.items():
            other = state[key]
            if isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor) and \
                    (value.shape != other.shape or value.dtype != other.dtype):
                raise UserError(f"{name}: {key} is {tuple(other.shape)} {other.dtype}, {tuple(value.shape)} "
                                f"{value.dtype} in {first}: inputs of a merge must have the same shapes")


def _is_merged(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def _merge_each(states: Sequence[StateDict], names: Sequence[str],
                merge: Callable[[list[torch.Tensor]], torch.Tensor]) -> tuple[dict[str, Any], int, int]:
    """``{key: merge(the inputs' tensors)}`` for floating-point tensors, the common value for any
    other entry (refused, named, where the inputs differ); with the tensors and entries merged."""
    check_same_layout(states, names)
    merged: dict[str, Any] = {}
    tensors = parameters = 0
    for key, value in states[0].items():
        if _is_merged(value):
            merged[key] = merge([state[key] for state in states]).to(value.dtype)
            tensors, parameters = tensors + 1, parameters + value.numel()
            continue
        for state, name in zip(states[1:], names[1:]):
            if not _equal(state[key], value):
                raise UserError(f"{name}: {key} differs from {names[0]}'s and is not a floating-point weight "
                                "(only those are merged; any other entry must be equal in every input)")
        merged[key] = value
    return merged, tensors, parameters


def _names(count: int, names: Sequence[str] | None, *, base: bool = False) -> list[str]:
    if names is not None:
        return list(names)
    return (["base"] if base else []) + [f"parent {i + 1}" for i in range(count)]


def uniform_merge(parents: Sequence[StateDict], weights: Sequence[float] | None = None, *,
                  names: Sequence[str] | None = None) -> tuple[dict[str, Any], MergeStats]:
    """The (weighted) average of ``parents`` per floating-point tensor; ``names``: how errors name
    the parents (default ``parent 1``, ...)."""
    if not parents:
        raise UserError("a merge needs at least one parent")
    shares = normalised_weights(weights, len(parents))

    def average(tensors: list[torch.Tensor]) -> torch.Tensor:
        total = torch.zeros(tensors[0].shape, dtype=torch.float64, device=tensors[0].device)
        for share, tensor in zip(shares, tensors):
            total += share * tensor.to(torch.float64)
        return total

    merged, tensors, parameters = _merge_each(parents, _names(len(parents), names), average)
    return merged, MergeStats(tensors=tensors, parameters=parameters)


def trim(delta: torch.Tensor, density: float) -> torch.Tensor:
    """``delta`` with only its ``ceil(density x numel)`` largest-magnitude entries kept (TIES's trim,
    per tensor as mergekit does; the paper ranks the whole task vector at once); the rest are 0.
    Entries of equal magnitude rank by position (the first kept), so the result is deterministic."""
    keep = math.ceil(round(density * delta.numel(), 6))  # 0.2 x 30 is 6.000000000000001 in floats
    if keep >= delta.numel():
        return delta.clone()
    flat = delta.flatten()
    order = torch.sort(flat.abs(), descending=True, stable=True).indices
    trimmed = torch.zeros_like(flat)
    trimmed[order[:keep]] = flat[order[:keep]]
    return trimmed.view_as(delta)


def ties_merge(base: StateDict, parents: Sequence[StateDict], *, density: float = DEFAULT_DENSITY,
               scale: float = DEFAULT_LAMBDA, weights: Sequence[float] | None = None,
               names: Sequence[str] | None = None) -> tuple[dict[str, Any], MergeStats]:
    """TIES-merging of ``parents`` against ``base`` (module docstring); ``names``: how errors name
    the base and the parents (default ``base``, ``parent 1``, ...)."""
    if not parents:
        raise UserError("a merge needs at least one parent")
    MergeConfig(method="ties", weights=weights, density=density, scale=scale)  # the checks
    shares = torch.tensor(normalised_weights(weights, len(parents)), dtype=torch.float64)
    counts = {"changed": 0, "conflicts": 0}

    def ties(tensors: list[torch.Tensor]) -> torch.Tensor:
        origin = tensors[0].to(torch.float64)
        trimmed = torch.stack([trim(t.to(torch.float64) - origin, density) for t in tensors[1:]])
        share = shares.to(trimmed.device).view(-1, *([1] * origin.dim()))  # one per parent, broadcast
        weighted = trimmed * share
        elected = torch.sign(weighted.sum(dim=0))  # 0 where the trimmed changes cancel: none agrees
        agree = (torch.sign(trimmed) == elected) & (trimmed != 0)
        # where no parent agrees, the sum is 0 too: the mean is 0
        weight = (share * agree).sum(dim=0)
        mean = (weighted * agree).sum(dim=0) / torch.where(weight > 0, weight, 1.0)
        counts["changed"] += int((trimmed != 0).any(dim=0).sum())
        counts["conflicts"] += int(((trimmed > 0).any(dim=0) & (trimmed < 0).any(dim=0)).sum())
        return origin + scale * mean

    merged, tensors, parameters = _merge_each([base, *parents], _names(len(parents), names, base=True), ties)
    return merged, MergeStats(tensors=tensors, parameters=parameters, **counts)


# --- Real checkpoints ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MergeResult:
    """What :func:`merge_checkpoints` wrote."""

    output_dir: Path
    """The save directory to give ``checkpoint.load`` (with ``finetune: true``), export or evaluate."""
    checkpoint: Path
    """The merged checkpoint itself (``<output_dir>/iter_0000000``)."""
    stats: MergeStats
    provenance: dict
    """What ``merge.json`` holds."""


def _open(location: str | os.PathLike, role: str) -> Checkpoint:
    try:
        return Checkpoint.open(location)
    except UserError as error:
        raise UserError(f"{role} {location}: {error}") from error


def _identity(checkpoint: Checkpoint) -> tuple[dict, str]:
    """The architecture (as JSON) and the tokenizer (its content fingerprint, else its reference)
    that make the weights of ``checkpoint`` mean what they mean."""
    model = json.loads(json.dumps(dataclasses.asdict(checkpoint.model_config())))
    tokenizer = checkpoint.tokenizer_fingerprint() or json.dumps(dataclasses.asdict(checkpoint.tokenizer_config()))
    return model, tokenizer


def _check_same_model(checkpoints: Sequence[Checkpoint], roles: Sequence[str]) -> None:
    """``UserError`` naming the input and the field unless all are one architecture and tokenizer."""
    (model, tokenizer), first = _identity(checkpoints[0]), f"{roles[0]} {checkpoints[0]}"
    for checkpoint, role in zip(checkpoints[1:], roles[1:]):
        other_model, other_tokenizer = _identity(checkpoint)
        for key in sorted(model.keys() | other_model.keys()):
            if model.get(key) != other_model.get(key):
                raise UserError(f"{role} {checkpoint}: model_config.json {key} is {other_model.get(key)!r}, "
                                f"{model.get(key)!r} in {first}: inputs of a merge must be one architecture")
        if tokenizer != other_tokenizer:
            raise UserError(f"{role} {checkpoint}: its tokenizer ({checkpoint.tokenizer_config().tokenizer_model}) "
                            f"differs from {first}'s ({checkpoints[0].tokenizer_config().tokenizer_model}): inputs "
                            "of a merge must share one tokenizer")


def _common_objective(checkpoints: Sequence[Checkpoint], roles: Sequence[str]) -> dict | None:
    """What the parents last trained (``Checkpoint.trained_objective``), for the merge's exports: one
    reading of the outputs (``prediction_offset``, ``causal``) or a ``UserError`` naming the parent
    that differs; names that differ with the same reading are joined (``mlm-40 + mlm-20``)."""
    objectives = [checkpoint.trained_objective() for checkpoint in checkpoints]
    first = objectives[0]
    for objective, checkpoint, role in zip(objectives[1:], checkpoints[1:], roles[1:]):
        reading = None if objective is None else (objective["prediction_offset"], objective["causal"])
        if reading != (None if first is None else (first["prediction_offset"], first["causal"])):
            raise UserError(f"{role} {checkpoint} last trained {objective and objective['name']}, {roles[0]} "
                            f"{first and first['name']}: their outputs predict tokens at other positions (prediction "
                            "offset, causal), so a merge of them has no one reading")
    if first is None:
        return None
    names = list(dict.fromkeys(objective["name"] for objective in objectives))
    return {**first, "name": " + ".join(names)}


def _check_output(output_dir: Path, inputs: Sequence[Checkpoint], overwrite: bool) -> None:
    for checkpoint in inputs:
        if checkpoint.path.resolve().is_relative_to(output_dir):
            raise UserError(f"--out {output_dir} holds the input {checkpoint}: write the merge elsewhere")
    if not overwrite and not is_empty_dir_or_absent(output_dir):
        raise UserError(f"--out {output_dir} is not empty; pass --overwrite to replace it")


def merge_checkpoints(parents: Sequence[str | os.PathLike], output_dir: str | os.PathLike, *, config: MergeConfig,
                      base: str | os.PathLike | None = None, overwrite: bool = False,
                      log: Callable[[str], None] = print) -> MergeResult:
    """Merge the ``parents`` (each a checkpoint, or a save directory: its newest) by ``config`` into
    a new save directory ``output_dir`` (module docstring), written atomically.

    Args:
        parents: The checkpoints to merge, one or more.
        output_dir: Created; must be absent or empty unless ``overwrite``, and hold no input.
        config: The method and its settings.
        base: TIES: the checkpoint the parents branched from (required); uniform: not taken.
        overwrite: Replace a non-empty ``output_dir``.
        log: Progress lines.
    """
    if not parents:
        raise UserError("give at least one parent checkpoint to merge")
    if config.method == "ties" and base is None:
        raise UserError("--method ties needs --base, the checkpoint the parents branched from (the trunk at the "
                        "branch step): TIES merges the parents' changes from it")
    if config.method == "uniform" and base is not None:
        raise UserError("--base belongs to --method ties; uniform averages the parents' weights")
    weights = normalised_weights(config.weights, len(parents))
    parent_roles = [f"parent {i + 1}" for i in range(len(parents))]
    parent_checkpoints = [_open(path, role) for path, role in zip(parents, parent_roles)]
    opened, roles = parent_checkpoints, parent_roles
    if base is not None:
        opened, roles = [_open(base, "--base"), *opened], ["--base", *roles]
    output_dir = Path(output_dir).resolve()
    _check_output(output_dir, opened, overwrite)
    _check_same_model(opened, roles)
    objective = _common_objective(parent_checkpoints, parent_roles)

    names = [f"{role} {checkpoint}" for role, checkpoint in zip(roles, opened)]
    states = []
    with single_process_model_parallel():
        for checkpoint, name in zip(opened, names):
            log(f"loading {name}")
            states.append({key: value.detach().cpu() if isinstance(value, torch.Tensor) else value
                           for key, value in load_megatron_checkpoint(checkpoint).state_dict().items()})
        log(f"merging by {config.method}")
        if config.method == "ties":
            merged, stats = ties_merge(states[0], states[1:], density=config.density, scale=config.scale,
                                       weights=config.weights, names=names)
        else:
            merged, stats = uniform_merge(states, config.weights, names=names)
        del states

        def described(checkpoint: Checkpoint) -> dict:
            return {"path": str(checkpoint.path.resolve()), "step": checkpoint.step}

        provenance = {
            "method": config.method,
            "parents": [{**described(c), "weight": w} for c, w in zip(parent_checkpoints, weights)],
            "base": described(opened[0]) if base is not None else None,
            "density": config.density, "lambda": config.scale,
            "tensors": stats.tensors, "parameters": stats.parameters, "sign_conflict_share": stats.conflict_share,
        }
        model_config, _ = _identity(opened[0])
        tokenizer_reference = dataclasses.asdict(opened[0].tokenizer_config())
        fingerprint = opened[0].tokenizer_fingerprint()
        with staged_dir(output_dir) as tmp:
            log(f"saving the merged checkpoint into {output_dir}")
            checkpoint = save_weights(
                tmp, opened[0].model_config(), merged,
                run_config={"model": model_config, "tokenizer": tokenizer_reference, TRAINED_OBJECTIVE: objective,
                            MERGE_KEY: provenance},
                model_config=model_config,
                tokenizer_reference={**tokenizer_reference, **({TOKENIZER_FINGERPRINT: fingerprint} if fingerprint else {})})
            (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
            publish_dir(tmp, output_dir, overwrite=overwrite, identical_ok=False)
    return MergeResult(output_dir=output_dir, checkpoint=output_dir / checkpoint.name, stats=stats,
                       provenance=provenance)
