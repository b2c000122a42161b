"""Reading checkpoints: finding them in a save directory, verifying their files, and loading them.

Layout (Megatron-LM's names; ``checkpoint/writer.py`` writes it atomically)::

    <save>/iter_0000100/                  one checkpoint
        .metadata, __<rank>_<n>.distcp,   Megatron dist checkpoint (torch_dist backend): weights
        metadata.json                     under ``model.sharded_state_dict()`` keys, the
                                          optimizer's state in Megatron's layout (its format
                                          recorded as Megatron's ``content_metadata``), and a
                                          common state (``iteration``, ``trainer_state``, the
                                          optimizer's param groups and step)
        run_config.json                   the run's resolved config
        tokenizer_reference.json          the tokenizer the weights expect
        checkpoint_complete.json          written last: marks a complete checkpoint, and records
                                          every other file with its size (the manifest)
    <save>/latest_checkpointed_iteration.txt   Megatron's tracker: the newest step

Tensors are stored whole (global shapes; each rank writes its shards), so a checkpoint saved at
one tensor-parallel size loads at any other, on CPU or GPU alike.

Complete: an ``iter_NNNNNNN`` directory holding both the marker and Megatron's ``metadata.json``
(half-written ``.tmp-`` directories and ``iter_*`` directories lacking either are ignored).
Intact: a complete checkpoint whose files still match the manifest (:meth:`Checkpoint.damage`);
one that does not is *damaged*, told apart from one still being written (no marker yet), and its
error names the intact checkpoints left beside it and ``--load-step``. Checkpoints written before
manifests were recorded are checked against Megatron's ``.metadata`` alone.

Export, evaluation, inference and the resume policy (``checkpoint/resume.py``) all start from a
path that names either one checkpoint or a save directory (then its newest complete checkpoint).
:class:`Checkpoint` resolves that path once, refusing incomplete ones with the reason; its reads
(the run config, the model architecture, the tokenizer reference, the optimizer format, and the
weights) go to that directory without resolving it again.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
from torch.distributed.checkpoint.api import CheckpointException

from megatron_ext.megatron_compat import cuda_on_cpu
from megatron_ext.checkpoint.storage import one_line
from megatron_ext.config_loading import UserError, build_dataclass
from megatron_ext.model.config import EncoderModelConfig
from megatron_ext.tokenizer import TokenizerConfig

logger = logging.getLogger(__name__)

COMPLETE = "checkpoint_complete.json"
WEIGHTS_STEP = "weights_step"
"""The completion marker's key for the step whose training the weights hold, where it is not the
checkpoint's step (a save right after a rollback); absent otherwise."""
RUN_CONFIG = "run_config.json"
MODEL_CONFIG = "model_config.json"
"""The architecture of the saved weights: the run config's model section with the RoPE base the
last saved step trained with (``save_checkpoint``'s ``model_config``)."""
TOKENIZER_REFERENCE = "tokenizer_reference.json"
TOKENIZER_FINGERPRINT = "fingerprint"
"""Key of ``tokenizer_reference.json`` holding the tokenizer's content fingerprint."""
TRAINED_OBJECTIVE = "trained_objective"
"""Key of a run config (one written by ``checkpoint/merge.py``, which has no phases) holding what the
weights last trained (:meth:`Checkpoint.trained_objective`); an export's ``config.json`` records it
under the same key (``hf/exporter.py``)."""
MANIFEST_KEY = "files"
"""Key of the completion marker holding ``{file name: size in bytes}`` of the checkpoint."""
MEGATRON_METADATA = "metadata.json"
"""Written last by ``dist_checkpointing.save``."""
DCP_METADATA = ".metadata"
"""torch.distributed.checkpoint's index of the shard files."""
CHECKPOINT_NAME = re.compile(r"^iter_(\d{7,})$")
EDITABLE = (RUN_CONFIG, MODEL_CONFIG, TOKENIZER_REFERENCE)
"""Files of a checkpoint that may be rewritten after it was saved (checked for presence only:
users and tools may rewrite them, e.g. a moved tokenizer's path)."""
# What a damaged or half-copied dist checkpoint raises while being read.
_READ_ERRORS = (CheckpointingException, CheckpointException, OSError, pickle.UnpicklingError)


class OptimizerCheckpointState(Protocol):
    """How the training engine's optimizer state goes into and out of a distributed checkpoint
    (``training.optim.MegatronOptimizerState``)."""

    def format(self) -> dict:
        """JSON-serialisable description of the layout written (recorded in the checkpoint as
        Megatron's ``content_metadata``; e.g. the distributed optimizer's sharding type)."""

    def sharded_state_dict(self, model_state: dict, *, saved_format: dict | None = None) -> dict:
        """The state to save (``saved_format`` None), or the placeholders to load a state saved in
        ``saved_format`` (:meth:`Checkpoint.optimizer_format`) into."""

    def load_state_dict(self, loaded: dict) -> None:
        """Take the state ``dist_checkpointing.load`` filled in."""


# --- A save directory: which of its checkpoints are complete, and which intact -------------------


def _step_named(path: Path) -> int:
    """The step an ``iter_NNNNNNN`` directory's name gives."""
    return int(CHECKPOINT_NAME.match(path.name)[1])


def incomplete_reason(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint directory; None: it is one."""
    if not (path / COMPLETE).is_file():
        return f"no {COMPLETE} (the save did not finish)"
    if not (path / MEGATRON_METADATA).is_file():
        return f"no {MEGATRON_METADATA} (not a Megatron distributed checkpoint)"
    return None


def complete_checkpoints(save_dir: Path) -> list[Path]:
    """Complete checkpoints under ``save_dir``, oldest first (none: an empty list)."""
    if not save_dir.is_dir():
        return []
    found = [(int(match[1]), path) for path in save_dir.iterdir()
             if (match := CHECKPOINT_NAME.match(path.name)) and path.is_dir()
             and incomplete_reason(path) is None]
    return [path for _, path in sorted(found)]


def latest_checkpoint(load_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``load_dir``; None if there is none (or no dir).
    ``load_dir`` may also be one complete checkpoint, returned as is."""
    load_dir = Path(load_dir)
    if load_dir.is_dir() and incomplete_reason(load_dir) is None:
        return load_dir
    complete = complete_checkpoints(load_dir)
    return complete[-1] if complete else None


def intact_checkpoints(save_dir: Path) -> list[Path]:
    """The complete checkpoints of ``save_dir`` whose files match their manifest, oldest first."""
    return [checkpoint.path for checkpoint in Checkpoint.every(save_dir) if checkpoint.damage() is None]


# --- One checkpoint ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Checkpoint:
    """One complete checkpoint directory (``iter_NNNNNNN``)."""

    path: Path
    """The checkpoint directory itself, never a save directory."""

    @classmethod
    def open(cls, location: str | os.PathLike) -> Checkpoint:
        """The checkpoint ``location`` names: itself, or the newest complete one in a save
        directory. ``UserError`` naming the path and what is missing otherwise."""
        path = Path(location)
        if not path.is_dir():
            raise UserError(f"no complete checkpoint at {path}: not a directory")
        looks_like_one = CHECKPOINT_NAME.match(path.name.split(".")[0]) or any(
            (path / name).exists() for name in (COMPLETE, MEGATRON_METADATA))
        if looks_like_one:
            if reason := incomplete_reason(path):
                raise UserError(f"{path} is not a complete checkpoint: {reason}")
            return cls(path)
        latest = latest_checkpoint(path)
        if latest is None:
            raise UserError(f"no complete checkpoint in {path} (expected iter_NNNNNNN directories "
                            f"holding {COMPLETE})")
        return cls(latest)

    @classmethod
    def latest(cls, location: str | os.PathLike | None) -> Checkpoint | None:
        """Like :meth:`open`, but None where there is no complete checkpoint (or no location)."""
        found = latest_checkpoint(location) if location else None
        return cls(found) if found is not None else None

    @classmethod
    def every(cls, save_dir: str | os.PathLike) -> list[Checkpoint]:
        """The complete checkpoints of a save directory, oldest first (none, or no directory: [])."""
        return [cls(path) for path in complete_checkpoints(Path(save_dir))]

    @classmethod
    def at_step(cls, save_dir: str | os.PathLike, step: int) -> Checkpoint:
        """The complete checkpoint of ``step`` in ``save_dir`` (``checkpoint.load_step``;
        ``UserError`` listing the steps there when it has none)."""
        for path in complete_checkpoints(Path(save_dir)):
            if _step_named(path) == step:
                return cls(path)
        steps = [_step_named(path) for path in intact_checkpoints(Path(save_dir))]
        held = f"its complete checkpoints are at steps {', '.join(map(str, steps))}" if steps else "it holds none"
        raise UserError(f"checkpoint.load_step={step}: no complete checkpoint iter_{step:07d} in {save_dir}; {held}")

    @property
    def step(self) -> int:
        """The number of training steps the checkpoint has completed."""
        return int(self._json(COMPLETE)["step"])

    @property
    def weights_step(self) -> int:
        """The step whose training the weights hold: :attr:`step`, except in a checkpoint saved
        right after a rollback (``training.recovery``), which holds the rolled-back-to step's weights
        at the newer step number. What the weights last trained is read at this step."""
        marker = self._json(COMPLETE)
        return int(marker.get(WEIGHTS_STEP, marker["step"]))

    def _json(self, name: str) -> dict:
        return json.loads((self.path / name).read_text())

    # --- verifying ---

    def damage(self) -> str | None:
        """Why this published checkpoint is damaged: a file its manifest records missing or of
        another size (``EDITABLE`` files: missing only), or the marker unreadable; None: intact."""
        try:
            marker = self._json(COMPLETE)
        except (OSError, ValueError) as error:
            return f"{COMPLETE} is unreadable ({one_line(error)})"
        recorded = marker.get(MANIFEST_KEY)
        if recorded is None:  # written before manifests were recorded
            return missing_shards(self.path)
        for name, size in sorted(recorded.items()):
            path = self.path / name
            if not path.is_file():
                return f"{name} is missing ({size} bytes recorded)"
            if name not in EDITABLE and path.stat().st_size != size:
                return f"{name} has {path.stat().st_size} bytes, {size} recorded"
        return None

    def check_intact(self) -> None:
        """``UserError`` naming the missing or resized file, the intact checkpoints left beside
        it and ``--load-step``, when the files no longer match the manifest saved with them."""
        if problem := self.damage():
            raise self.damaged(problem)

    def damaged(self, problem: str) -> UserError:
        """The one-line error of this checkpoint found damaged by ``problem``: which file is
        missing or unreadable, the intact checkpoints left beside it, and the flag that resumes
        from one of them."""
        others = [path for path in intact_checkpoints(self.path.parent) if path != self.path]
        if others:
            listing = ", ".join(path.name for path in others)
            step = _step_named(others[-1])
            remedy = (f"complete checkpoints left in {self.path.parent}: {listing}; resume from one with "
                      f"--load-step {step} (checkpoint.load_step: {step}; a tool takes its directory)")
        else:
            remedy = (f"no other complete checkpoint is left in {self.path.parent}: restore the file, or start "
                      "over with another --save")
        return UserError(f"checkpoint {self.path} is damaged: {problem}; {remedy}")

    # --- what was saved beside the weights ---

    def run_config(self) -> dict:
        """The resolved run config the training run saved (``run_config.json``)."""
        return self._json(RUN_CONFIG)

    def model_config(self) -> EncoderModelConfig:
        """The architecture of the saved weights (``model_config.json``), with the RoPE base the
        weights were last trained with: a phase's ``rotary_base`` (a long-context phase) replaces the
        run's ``model.rotary_base`` in checkpoints saved during or after it, so exports, evaluation
        and inference read positions as training did.

        A checkpoint written before that file existed has only the run config's model section, the
        architecture of its first step: read when no phase of the run changed the RoPE base, refused
        in one line otherwise (the base of its last step is not recorded)."""
        if (self.path / MODEL_CONFIG).exists():
            return build_dataclass(EncoderModelConfig, self._json(MODEL_CONFIG), f"{self.path / MODEL_CONFIG} model")
        where = f"{self.path / RUN_CONFIG} model"
        run_config = self.run_config()
        if "model" not in run_config:
            raise UserError(f"{where}: missing; expected the saved model section")
        phases = run_config.get("phases")
        # Those versions called a phase's base rope_base.
        if isinstance(phases, list) and any(isinstance(p, dict) and p.get("rope_base") is not None for p in phases):
            raise UserError(f"{self.path}: no {MODEL_CONFIG} (saved by an earlier version) and its run's phases change "
                            f"the RoPE base (rope_base), so the base its weights were last trained with is not "
                            f"recorded; write {MODEL_CONFIG} from the model section of {RUN_CONFIG} with the last "
                            "phase's rope_base as rotary_base")
        return build_dataclass(EncoderModelConfig, run_config["model"], where)

    def tokenizer_config(self) -> TokenizerConfig:
        """The tokenizer the weights expect (``tokenizer_reference.json``: the ``TokenizerConfig``
        fields that rebuild it)."""
        reference = self._json(TOKENIZER_REFERENCE)
        reference.pop(TOKENIZER_FINGERPRINT, None)
        return TokenizerConfig(**reference)

    def tokenizer_fingerprint(self) -> str | None:
        """The content fingerprint of that tokenizer (``EncoderTokenizer.fingerprint``; None for
        checkpoints saved without one)."""
        return self._json(TOKENIZER_REFERENCE).get(TOKENIZER_FINGERPRINT)

    def trained_objective(self) -> dict | None:
        """What the checkpoint's last step trained, ``{"name": "mntp-20", "prediction_offset": -1,
        "causal": False}``: where the output predicting a masked token sits (exports record it for
        ``tools/fill_mask.py``). From the run config's phases at the last step; a merge
        (``checkpoint/merge.py``) records its parents' as ``TRAINED_OBJECTIVE``. None without either
        (an import from Hugging Face)."""
        from megatron_ext.config_loading import coerce
        from megatron_ext.phases import Phase, phase_at, resolve_phases

        run = self.run_config()
        if TRAINED_OBJECTIVE in run:
            return run[TRAINED_OBJECTIVE]
        if not run.get("phases") or "train_iters" not in (run.get("training") or {}):
            return None
        phases = [coerce(raw, Phase, f"{self.path / RUN_CONFIG} phases[{i}]") for i, raw in enumerate(run["phases"])]
        objective = phase_at(resolve_phases(phases, run["training"]["train_iters"]),
                             max(self.weights_step - 1, 0)).objective
        return {"name": objective.name, "prediction_offset": objective.prediction_offset, "causal": objective.causal}

    def optimizer_format(self) -> dict | None:
        """The optimizer format recorded (None: weights only). Checkpoints written before formats
        were recorded get the format of the engine their run config names (the portable engine,
        the only one then, where it names none)."""
        if not self._json(COMPLETE)["has_optimizer"]:
            return None
        try:
            recorded = dist_checkpointing.load_content_metadata(str(self.path))
        except _READ_ERRORS as error:
            raise self.damaged(one_line(error)) from error
        if recorded is None:  # written before formats were recorded: the engine named in its run config
            engine = self._json(RUN_CONFIG).get("training", {}).get("engine", "portable")
            recorded = dict(PORTABLE_ENGINE_FORMAT) if engine == "portable" else {"optimizer": "megatron"}
        return recorded

    # --- loading ---

    def load(self, *, model: torch.nn.Module, optimizer: OptimizerCheckpointState | None = None,
             strict_shapes: bool = True) -> dict:
        """Load the weights into ``model`` (and ``optimizer``'s state) at the current parallel layout;
        returns the ``trainer_state`` saved with it (with ``step``).

        Args:
            model: Built for this run; its tensor-parallel size may differ from the saved one's.
            optimizer: Restored too when given (in a format it can take; see
                :func:`optimizer_format_problem`); None loads weights only.
            strict_shapes: Raise ``UserError`` listing every tensor whose shape differs between
                checkpoint and model (or that only one of them has). False loads the tensors that
                fit, leaves the others as initialised and logs them (weights only).
        """
        cuda_on_cpu.check_megatron_runs_here("loading a checkpoint")
        self.check_intact()
        if optimizer is not None and not self._json(COMPLETE)["has_optimizer"]:
            raise UserError(f"checkpoint {self} holds no optimizer state (saved weights only); "
                            "load it with optimizer=None (e.g. checkpoint.finetune)")
        if optimizer is not None and not strict_shapes:
            raise UserError("strict_shapes=False loads weights only: pass optimizer=None")
        try:
            saved_entries = load_sharded_metadata(str(self.path))
        except _READ_ERRORS as error:
            raise self.damaged(one_line(error)) from error
        metadata = {key: value for key, value in saved_entries.items() if isinstance(value, ShardedTensor)}

        model_state = model.sharded_state_dict()
        fresh_extra_states = _fresh_extra_states(model_state, saved_entries, self)
        if fresh_extra_states:
            logger.warning("checkpoint %s has no Transformer Engine state for %d modules (written with the local "
                           "spec?): their FP8 scaling state starts fresh", self, len(fresh_extra_states))
            model_state = {name: value for name, value in model_state.items() if name not in fresh_extra_states}
        mismatches = _shape_mismatches(model_state, metadata)
        if mismatches:
            listing = "\n".join(
                f"  {key}: checkpoint {saved or 'absent'}, model {current or 'absent'}"
                for key, (saved, current) in sorted(mismatches.items())
            )
            if strict_shapes:
                raise UserError(f"checkpoint {self} does not fit the model "
                                f"({len(mismatches)} tensors differ):\n{listing}")
            logger.warning("not loading %d tensors whose shapes differ:\n%s", len(mismatches), listing)
        unloaded = {name for name, value in model_state.items() if getattr(value, "key", None) in mismatches}
        model_state = {name: value for name, value in model_state.items() if name not in unloaded}

        state = {"model": model_state}
        if optimizer is not None:
            state["optimizer"] = optimizer.sharded_state_dict(model_state, saved_format=self.optimizer_format() or {})
        try:
            loaded = dist_checkpointing.load(state, str(self.path))
        except _READ_ERRORS as error:
            raise self.damaged(one_line(error)) from error
        outcome = model.load_state_dict(loaded["model"], strict=False)
        not_loaded = set(outcome.missing_keys) - set(fresh_extra_states) - unloaded
        if not_loaded or outcome.unexpected_keys:  # the sharded state dict and the module disagree: a bug, not input
            raise RuntimeError(f"loading {self}: missing {sorted(not_loaded)}, unexpected {outcome.unexpected_keys}")
        if optimizer is not None:
            optimizer.load_state_dict(loaded["optimizer"])
        return loaded["trainer_state"]

    def __str__(self) -> str:
        return str(self.path)


EXTRA_STATE = "_extra_state"
"""Suffix of a module's extra state in state dicts (Transformer Engine: FP8 scaling metadata)."""


def _fresh_extra_states(model_state: dict, saved: dict, checkpoint: Checkpoint | Path) -> list[str]:
    """State-dict names of the model's ``_extra_state`` objects that the checkpoint lacks.

    Transformer Engine's modules carry an ``_extra_state`` (FP8 scaling history) that the local
    spec's modules (torch norms, SDPA attention) do not, so a checkpoint of the local spec lacks
    them in a ``te`` model: those are initialised fresh. Any other object the checkpoint lacks is
    refused, named (tensors are checked by shape, ``_shape_mismatches``). Objects only the
    checkpoint holds (a ``te`` checkpoint read by the local spec) are not requested, so not read.
    """
    fresh, absent = [], []
    for name, value in model_state.items():
        if isinstance(value, ShardedObject) and value.unique_key not in saved:
            (fresh if value.key.rsplit(".", 1)[-1] == EXTRA_STATE else absent).append(name)
    if absent:
        raise UserError(f"checkpoint {checkpoint} lacks {len(absent)} entries the model needs: "
                        + ", ".join(model_state[name].unique_key for name in absent))
    return fresh


def _shape_mismatches(
    model_state: dict, metadata: dict
) -> dict[str, tuple[tuple[int, ...] | None, tuple[int, ...] | None]]:
    """``{key: (checkpoint shape, model shape)}`` of the model tensors that differ (None: absent)."""
    expected: dict[str, tuple[int, ...]] = {}
    pending = list(nested_values(model_state))
    while pending:
        item = pending.pop()
        if isinstance(item, ShardedTensorFactory):  # e.g. SwiGLU's fc1, saved as two halves
            built = item.build()
            pending.extend(nested_values(built) if isinstance(built, (dict, list)) else [built])
        elif isinstance(item, ShardedTensor):
            expected[item.key] = tuple(item.global_shape)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # each stage holds its own layers
        stages: list[dict] = [None] * parallel_state.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(stages, expected, group=parallel_state.get_pipeline_model_parallel_group())
        expected = {key: shape for stage in stages for key, shape in stage.items()}
    saved = {key: tuple(value.global_shape) for key, value in metadata.items()
             if not key.startswith("optimizer.")}
    return {key: (saved.get(key), expected.get(key))
            for key in saved.keys() | expected.keys() if saved.get(key) != expected.get(key)}


# --- Shard files and optimizer formats -----------------------------------------------------------


def shard_sizes(checkpoint: Path) -> dict[str, int]:
    """``{shard file: bytes needed}`` from the checkpoint's ``.metadata`` (raises what reading it raises)."""
    from torch.distributed.checkpoint import FileSystemReader

    needed: dict[str, int] = {}
    for info in FileSystemReader(str(checkpoint)).read_metadata().storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    return needed


def missing_shards(checkpoint: Path) -> str | None:
    """What of ``.metadata``'s shard files is missing or short in ``checkpoint`` (a checkpoint
    directory, published or still being written); None: all there."""
    if not (checkpoint / DCP_METADATA).is_file():
        return f"{DCP_METADATA} is missing"
    try:
        needed = shard_sizes(checkpoint)
    except Exception as error:  # whatever unpickling a damaged file raises
        return f"{DCP_METADATA} is unreadable ({one_line(error)})"
    for name, size in sorted(needed.items()):
        path = checkpoint / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size < size:
            return f"{name} has {path.stat().st_size} bytes, {size} expected"
    return None


PORTABLE_ENGINE_FORMAT = {"optimizer": "torch"}
"""The optimizer format of checkpoints written by the portable engine (``training.engine:
portable``, removed after commit b763d8e): torch's AdamW state, which the Megatron engine cannot
take. Their weights still load (continued pretraining, export)."""


def optimizer_format_problem(saved: dict | None, current: dict) -> str | None:
    """Why optimizer state saved in format ``saved`` cannot resume into ``current`` (both from
    ``OptimizerCheckpointState.format()``), or None when it can."""
    if not saved:
        return None  # weights only: nothing to compare
    kind, want = saved.get("optimizer"), current.get("optimizer")
    if kind == PORTABLE_ENGINE_FORMAT["optimizer"]:
        return ("it holds the optimizer state of the portable engine (training.engine: portable), which "
                "megatron_ext no longer has (removed after commit b763d8e); resume it with that version")
    if kind != want:
        return f"it holds optimizer state of kind {kind!r} and this run's optimizer is {want!r}"
    if saved.get("distributed_optimizer") != current.get("distributed_optimizer"):
        return (f"it was saved with parallel.use_distributed_optimizer: {str(saved['distributed_optimizer']).lower()}"
                " and the optimizer state layouts differ; set it back")
    if saved.get("distrib_optim_sharding_type") == "dp_reshardable":
        changed = [f"{name}={saved.get(name)} -> {current.get(name)}"
                   for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size")
                   if saved.get(name) != current.get(name)]
        if changed:
            return (f"its distributed-optimizer state is in the dp_reshardable format, which resumes at another "
                    f"data-parallel size only, and the layout changed ({', '.join(changed)}); resume at the saved "
                    "tensor/pipeline sizes, or save with checkpoint.optimizer_format: fully_reshardable to change them")
    return None
