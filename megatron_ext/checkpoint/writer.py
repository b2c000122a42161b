"""Writing checkpoints: the save engine (synchronous, or Megatron's asynchronous writers) and the
atomic publication of what it wrote. The layout written, and how it is read back:
``checkpoint/reader.py``.

Atomicity: every rank writes into ``iter_0000100.tmp-<id>``; after Megatron's closing barrier
rank 0 adds the JSON files, the completion marker last, fsyncs, renames the directory to its
final name, then replaces the tracker (temp file + ``os.replace``) and prunes old checkpoints
(renamed aside before deletion; never the steps a run keeps for others, ``keep_steps``). A crash
at any point leaves the previous checkpoints intact, and the reader only lists ``iter_NNNNNNN``
directories holding both the marker and Megatron's ``metadata.json``. Leftovers
(``.tmp-``/``.trash-``) are removed by the next save. One training run per save directory;
checkpoints are ordered by step (``checkpoint/lock.py`` keeps a second trainer out).
Before the marker, the shards are checked against ``.metadata`` and every file's size is recorded
in the marker (the manifest): a damaged checkpoint is told from one being written. A save that
fails because the disk is full is one line (``checkpoint/storage.py``).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from torch.distributed.checkpoint.api import CheckpointException

from megatron_ext import hardware, processes
from megatron_ext.megatron_compat import cuda_on_cpu
from megatron_ext.megatron_compat.checkpoint_results import ResultsQueue
from megatron_ext.checkpoint import storage
from megatron_ext.checkpoint.config import check_nvrx_async_writer
from megatron_ext.checkpoint.reader import (COMPLETE, MANIFEST_KEY, MODEL_CONFIG, RUN_CONFIG, TOKENIZER_REFERENCE,
                                            WEIGHTS_STEP, OptimizerCheckpointState, complete_checkpoints,
                                            latest_checkpoint, missing_shards)
from megatron_ext.config_loading import UserError

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron's tracker in a save directory: the newest step (written, never read here)."""
_LEFTOVER = re.compile(
    r"^(iter_\d{7,}\.(tmp|trash)|latest_checkpointed_iteration\.txt\.tmp)-[0-9a-f]+$"
)


def save_checkpoint(
    save_dir: str | os.PathLike,
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: OptimizerCheckpointState | None,
    trainer_state: dict,
    run_config: dict,
    model_config: dict,
    tokenizer_reference: dict,
    keep_last: int,
    keep_steps: tuple[int, ...] = (),
    weights_step: int | None = None,
) -> Path:
    """Write ``<save_dir>/iter_<step>`` atomically on every rank (a collective) and return it.

    Args:
        save_dir: Directory of checkpoints; created if missing.
        step: Optimizer steps done; names the checkpoint. A checkpoint of the same step is
            replaced.
        model: The model (its ``sharded_state_dict()`` is saved).
        optimizer: The engine's optimizer state (its format is recorded with it); None saves
            weights only.
        trainer_state: Rank 0's loop state (consumed samples, RNG states, ...). Any value
            ``torch.load(weights_only=True)`` accepts (containers, numbers, strings, bytes,
            tensors, numpy arrays: checked here). ``step`` is added (or must equal ``step``).
        run_config: The resolved run configuration, JSON-serialisable.
        model_config: The architecture of the saved weights (``EncoderModelConfig`` fields): the run
            config's model section with the RoPE base the last step trained with (a phase's
            ``rotary_base``), what exports and evaluation build the model from.
        tokenizer_reference: Which tokenizer the weights expect, JSON-serialisable.
        keep_last: Keep this many newest complete checkpoints (the new one included); 0: all.
        keep_steps: Steps never pruned, besides those (the checkpoints other runs branch from).
        weights_step: The step whose training the weights hold when it is not ``step``: a save right
            after a rollback (``training.recovery``) holds an earlier step's weights at the newer step
            number. Recorded in the completion marker (``Checkpoint.weights_step``).
    """
    with CheckpointSaver(async_save=False) as saver:
        return saver.save(save_dir, step=step, model=model, optimizer=optimizer, trainer_state=trainer_state,
                          run_config=run_config, model_config=model_config,
                          tokenizer_reference=tokenizer_reference, keep_last=keep_last,
                          keep_steps=keep_steps, weights_step=weights_step)


class CheckpointSaver:
    """Writes checkpoints, synchronously or with Megatron's asynchronous save (written by
    Megatron-Core's own writer or NVIDIA's resiliency package, ``async_strategy``).

    Asynchronous (``checkpoint.async_save``): the call returns once the state is staged (copied to
    host memory on GPU; on CPU the writer is a forked process, whose memory is a snapshot) and a
    background process writes the shards while training goes on. The checkpoint is published
    (marker, rename, tracker) only when every rank's writer has finished, from
    :meth:`poll` or :meth:`wait`, so the tracker never names an incomplete checkpoint: a run
    killed while a save is in flight leaves a ``.tmp-`` directory that is ignored and removed
    by the next save. Saves publish in order: a new save first waits for the previous one.
    """

    def __init__(self, *, async_save: bool, async_strategy: str = "mcore", persistent_writer: bool | None = None):
        """``async_strategy`` (``checkpoint.async_strategy``): ``mcore``, Megatron-Core's own
        asynchronous writer, or ``nvrx``, the one of ``nvidia-resiliency-ext`` (``UserError`` in one
        line where it cannot run, ``checkpoint.config.nvrx_problem``); with ``async_save`` only.
        ``persistent_writer``: a persistent worker instead of a process forked per save (default:
        ``hardware.persistent_checkpoint_writer()``, the worker on GPU only)."""
        cuda_on_cpu.check_megatron_runs_here("saving a checkpoint")
        if async_strategy not in ASYNC_STRATEGIES:
            raise ValueError(f"async_strategy must be one of {ASYNC_STRATEGIES}, got {async_strategy!r}")
        self._queue = None
        self._closed = False
        self.async_strategy = async_strategy
        self.persistent_writer = False
        """Whether asynchronous saves go to a persistent worker (else: a process forked per save)."""
        self._pending: list[_PendingSave] = []
        """Asynchronous saves started, oldest first (what a failed finalisation was writing)."""
        # The writer's modules before the results queue, which goes into NVRx's writer too.
        queue_class = _async_calls_queue_class(async_strategy) if async_save else None
        self._async_save = async_save
        _results_queue.acquire(across_processes=async_save)  # synchronous saves report through it too
        if not async_save:
            return
        try:
            if persistent_writer is None:
                persistent_writer = hardware.persistent_checkpoint_writer()
            self.persistent_writer = persistent_writer
            self._queue = queue_class(persistent=persistent_writer)
            if persistent_writer:  # started now, not at the first save: its start-up (~30 s on an
                # H100) leaves the save's stall, and it ignores the stop signals a scheduler sends
                with processes.helpers_ignore_stop_signals():
                    queue_class.warmup_persistent_caller(dist.get_rank() if dist.is_initialized() else 0)
        except BaseException:
            self.close(abort=True)  # no manager or worker left behind by a saver never returned
            raise

    def __enter__(self) -> "CheckpointSaver":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(abort=exc_type is not None)

    def close(self, *, abort: bool = False) -> None:
        """End the writers and the results queue, so that no process of the saver outlives it.

        ``abort`` False: wait for every save in flight and publish it (a collective), then stop
        the persistent worker. True (after an error, when other ranks may not join a collective):
        kill the writers; a save in flight stays an unpublished ``.tmp-`` directory, which the
        next save removes. Megatron's own clean-up runs from ``__del__`` at interpreter shutdown,
        after multiprocessing has already terminated the worker, and then waits forever on its
        queue: it must be called here, while the worker is alive. Idempotent."""
        if self._closed:
            return
        self._closed = True
        queue, self._queue = self._queue, None
        try:
            if queue is not None and not abort and queue.get_num_unfinalized_calls():
                self._queue = queue
                try:
                    self._finalize(blocking=True)
                finally:
                    self._queue = None
        finally:
            if queue is not None:
                if not queue.persistent:  # the forked writers of saves an abort or a failed finalize left
                    for active in queue.async_calls:
                        active.async_caller.close(abort=True)
                queue.async_calls.clear()  # (the persistent worker is stopped, and joined, below)
                if queue.persistent and self.async_strategy == "nvrx":
                    _stop_nvrx_persistent_writer(queue, abort=abort)
                elif queue.persistent:
                    _stop_persistent_writer(abort=abort)
            _results_queue.release(across_processes=self._async_save)

    def save(self, save_dir: str | os.PathLike, *, step: int, model: torch.nn.Module,
             optimizer: OptimizerCheckpointState | None, trainer_state: dict, run_config: dict,
             model_config: dict, tokenizer_reference: dict, keep_last: int,
             keep_steps: tuple[int, ...] = (), weights_step: int | None = None) -> Path:
        """Start writing ``<save_dir>/iter_<step>`` (arguments: :func:`save_checkpoint`); returns
        its final path, complete on return unless the save is asynchronous."""
        if self._closed:
            raise RuntimeError("this CheckpointSaver is closed")
        if not dist.is_initialized():
            raise RuntimeError("save_checkpoint is a collective: initialise torch.distributed first "
                               "(megatron_ext.process_group.init_process_group_and_model_parallel)")
        if step < 0:
            raise UserError(f"checkpoint step must be >= 0, got {step}")
        if keep_last < 0:
            raise UserError(f"keep_last must be >= 1, or 0 to keep every checkpoint; got {keep_last}")
        if weights_step is not None and not 0 <= weights_step <= step:
            raise UserError(f"weights_step must be in [0, {step}] (the checkpoint's step), got {weights_step}")
        trainer_state = _checked_trainer_state(trainer_state, step)
        files = {RUN_CONFIG: _to_json("run_config", run_config),
                 MODEL_CONFIG: _to_json("model_config", model_config),
                 TOKENIZER_REFERENCE: _to_json("tokenizer_reference", tokenizer_reference)}
        self.wait()
        save_dir = Path(save_dir)
        final = save_dir / f"iter_{step:07d}"

        announced: list[Path | None] = [None]
        if dist.get_rank() == 0:
            save_dir.mkdir(parents=True, exist_ok=True)
            _remove_leftovers(save_dir)
            announced[0] = save_dir / f"{final.name}.tmp-{uuid.uuid4().hex[:12]}"
            announced[0].mkdir()
        dist.broadcast_object_list(announced, src=0)  # also: no rank writes before the dir exists
        tmp = announced[0]

        model_state = model.sharded_state_dict()
        state = {"model": model_state, "iteration": step, "trainer_state": trainer_state}
        content_metadata = None
        if optimizer is not None:
            state["optimizer"] = optimizer.sharded_state_dict(model_state)
            content_metadata = optimizer.format()
        info = {"step": step, "has_optimizer": optimizer is not None}
        if weights_step is not None and weights_step != step:
            info[WEIGHTS_STEP] = weights_step
        pending = _PendingSave(step=step, tmp=tmp, save_dir=save_dir, needed_bytes=_needed_bytes(save_dir, state))

        def publish() -> None:
            _publish_checkpoint(tmp, final, files=files, info=info, keep_last=keep_last, keep_steps=keep_steps)

        with pending.failures_explained():
            request = dist_checkpointing.save(state, str(tmp), content_metadata=content_metadata,
                                              async_sharded_save=self._queue is not None,
                                              async_strategy=self.async_strategy)
            if request is None:  # synchronous: returned after a barrier, all shards written
                publish()
                return final
        request.add_finalize_fn(publish)  # runs on every rank once every rank's writer is done
        self._queue.schedule_async_request(request)
        self._pending.append(pending)
        return final

    def poll(self) -> None:
        """Publish the asynchronous saves that have finished on every rank (a collective: call it
        on every rank, e.g. after each step)."""
        if self._queue is not None and self._queue.get_num_unfinalized_calls():
            self._finalize(blocking=False)

    def wait(self) -> None:
        """Block until every asynchronous save is written and published (a collective)."""
        if self._queue is not None and self._queue.get_num_unfinalized_calls():
            self._finalize(blocking=True)

    def _finalize(self, *, blocking: bool) -> None:
        """Publish the finished asynchronous saves; a failure is explained for the oldest in flight."""
        oldest = self._pending[0] if self._pending else _PendingSave(step=-1, tmp=None, save_dir=None,
                                                                     needed_bytes=None)
        with oldest.failures_explained():
            self._queue.maybe_finalize_async_calls(blocking=blocking)
        del self._pending[:len(self._pending) - self._queue.get_num_unfinalized_calls()]

    @property
    def in_flight(self) -> int:
        """Asynchronous saves started and not yet published."""
        return 0 if self._queue is None else self._queue.get_num_unfinalized_calls()


ASYNC_STRATEGIES = ("mcore", "nvrx")
"""Megatron's ``async_strategy`` values: who writes asynchronous saves (``CheckpointConfig.async_strategy``)."""


def _async_calls_queue_class(async_strategy: str) -> type:
    """The ``AsyncCallsQueue`` of ``async_strategy``'s writer: ``dist_checkpointing.save`` returns a
    request of that package's ``AsyncRequest``, which only its own queue schedules."""
    if async_strategy == "mcore":
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        return AsyncCallsQueue
    check_nvrx_async_writer()
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async  # noqa: F401  (megatron_compat.checkpoint_results)
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue

    return AsyncCallsQueue


_results_queue = ResultsQueue()
_PERSISTENT_WRITER_STOP_SECONDS = 120


def _stop_writer_process(worker, queue, *, abort: bool) -> None:
    """End a persistent writer process (Megatron's or NVRx's): unless ``abort``, ask it to finish
    the saves queued before (``"DONE"`` on its ``queue`` ends its loop) and wait a bounded time;
    kill it if it is still alive."""
    if not abort and worker.is_alive():
        queue.put("DONE")
        worker.join(timeout=_PERSISTENT_WRITER_STOP_SECONDS)
        if worker.is_alive():
            logger.warning("the persistent checkpoint writer did not stop within %d s; killing it",
                           _PERSISTENT_WRITER_STOP_SECONDS)
    if worker.is_alive():
        worker.kill()
        worker.join()


def _stop_persistent_writer(*, abort: bool) -> None:
    """Stop Megatron's persistent writer process (GPU) without ever waiting forever: its own
    ``close()`` joins a queue that a dead worker never drains."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, PersistentAsyncCaller

    caller = AsyncCallsQueue._persistent_caller  # None when no save was scheduled (the worker may run)
    AsyncCallsQueue._persistent_caller = None
    worker = PersistentAsyncCaller._persistent_process
    if worker is None:
        return
    _stop_writer_process(worker, PersistentAsyncCaller._persistent_queue, abort=abort)
    # What Megatron's close() resets, so that a later asynchronous saver starts a new worker.
    if caller is not None:
        caller.process = None
    PersistentAsyncCaller._persistent_process = PersistentAsyncCaller._persistent_queue = None
    PersistentAsyncCaller._persistent_preload_q = PersistentAsyncCaller._persistent_comp_q = None


def _stop_nvrx_persistent_writer(queue, *, abort: bool) -> None:
    """Stop NVRx's persistent writer process of ``queue`` (and a pre-started one no save used)
    without ever waiting forever: its own ``close()`` joins a queue that a dead worker never drains."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue

    callers = [queue.persistent_caller, AsyncCallsQueue._warmup_persistent_caller]
    queue.persistent_caller = AsyncCallsQueue._warmup_persistent_caller = None  # NVRx's __del__: nothing left to do
    for caller in callers:
        worker = None if caller is None else caller.process
        if worker is None:
            continue
        _stop_writer_process(worker, caller.queue, abort=abort)
        caller.process = None


def _publish_checkpoint(tmp: Path, final: Path, *, files: dict[str, str], info: dict, keep_last: int,
                        keep_steps: tuple[int, ...]) -> None:
    """Rank 0 completes ``tmp`` (our files, its manifest in the marker, written last, fsyncs) once
    the shards ``.metadata`` names are all there, renames it to ``final`` and moves the tracker;
    every rank leaves once rank 0 has said how that went (a broadcast), raising its error if any."""
    failure: list[BaseException | None] = [None]
    if dist.get_rank() == 0:
        try:
            for name, text in files.items():
                (tmp / name).write_text(text)
            for path in sorted(tmp.iterdir()):  # Megatron's writers fsync their shards; the rest here
                _fsync(path)
            # Verified before it counts: a checkpoint published short of a shard would be found
            # damaged only at the resume that needs it.
            if missing := missing_shards(tmp):
                raise IncompleteSaveError(f"{tmp}: {missing} after every rank's writer finished")
            marker = {**info, MANIFEST_KEY: _manifest(tmp, leave_out=COMPLETE)}
            (tmp / COMPLETE).write_text(json.dumps(marker) + "\n")
            _fsync(tmp / COMPLETE)
            _fsync(tmp)
            _publish(tmp, final)
            _write_tracker(final.parent, info["step"])
            _prune(final.parent, keep_last, keep=final, keep_steps=keep_steps)
        except (OSError, IncompleteSaveError) as error:
            failure[0] = error
    dist.broadcast_object_list(failure, src=0)  # every rank stops when rank 0 could not publish
    if failure[0] is not None:
        raise failure[0]


class IncompleteSaveError(RuntimeError):
    """A checkpoint's shard files are missing or short although every writer reported success."""


@dataclass(frozen=True, kw_only=True)
class _PendingSave:
    """A save started: where it writes, and how its failure reads."""

    step: int
    tmp: Path | None
    """Its ``.tmp-`` folder (None: unknown, a failure is passed on as it is)."""
    save_dir: Path | None
    needed_bytes: int | None
    """About what it writes (``_needed_bytes``), for the message and the free-space diagnosis."""

    @contextlib.contextmanager
    def failures_explained(self):
        """Turn a failed write or publication into one line: a ``CheckpointStorageError`` when the
        disk is full, over quota or read-only, else a ``RuntimeError`` carrying the root cause
        (never Megatron's flattened tracebacks). Rank 0 removes the partial folder first."""
        try:
            yield
        except _SAVE_ERRORS as error:
            if self.save_dir is None:
                raise
            problem = storage.storage_problem(error, self.save_dir, needed_bytes=self.needed_bytes)
            if dist.get_rank() == 0 and self.tmp is not None and self.tmp.exists():
                shutil.rmtree(self.tmp)  # what it held is lost anyway; the space it takes is not
            if problem is None:
                raise RuntimeError(f"saving step {self.step} into {self.save_dir} failed: "
                                   f"{storage.one_line(error)}") from error
            raise storage.storage_error(step=self.step, save_dir=self.save_dir, problem=problem,
                                        needed_bytes=self.needed_bytes,
                                        previous=latest_checkpoint(self.save_dir)) from error


# What a failed write raises: Megatron's writers report ``RuntimeError: Worker failure`` inside
# torch's ``CheckpointException``; the files written here raise ``OSError``.
_SAVE_ERRORS = (CheckpointException, CheckpointingException, RuntimeError, OSError)


def _needed_bytes(save_dir: Path, state: dict) -> int:
    """About how many bytes the save of ``state`` writes: the newest complete checkpoint's size,
    else this rank's tensors times the number of ranks."""
    previous = latest_checkpoint(save_dir)
    if previous is not None:
        return storage.directory_bytes(previous)
    local = 0
    for item in nested_values(state):
        data = getattr(item, "data", None)
        if isinstance(data, torch.Tensor):
            local += data.numel() * data.element_size()
    return local * (dist.get_world_size() if dist.is_initialized() else 1)



def _checked_trainer_state(trainer_state: dict, step: int) -> dict:
    if trainer_state.get("step", step) != step:
        raise UserError(f"trainer_state['step']={trainer_state['step']} differs from step={step}")
    state = {**trainer_state, "step": step}
    # The common state is read back with weights_only=True: refuse now what resuming would.
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as error:
        raise UserError(
            "trainer_state holds a value torch.load(weights_only=True) refuses (use containers, "
            f"numbers, strings, bytes, tensors or numpy arrays): {error}"
        ) from error
    return state


def _to_json(what: str, value: dict) -> str:
    try:
        return json.dumps(value, indent=2) + "\n"
    except (TypeError, ValueError) as error:
        raise UserError(f"{what} must be JSON-serialisable: {error}") from error



def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _discard(path: Path) -> None:
    """Delete a checkpoint directory without ever leaving a half-deleted ``iter_*``."""
    trash = path.with_name(f"{path.name}.trash-{uuid.uuid4().hex[:12]}")
    path.rename(trash)
    shutil.rmtree(trash)


def _publish(tmp: Path, final: Path) -> None:
    if final.exists():  # same step saved again (e.g. the end of a resumed run)
        _discard(final)
    tmp.rename(final)
    _fsync(final.parent)


def _write_tracker(save_dir: Path, step: int) -> None:
    tmp = save_dir / f"{TRACKER}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.write_text(f"{step}\n")
    _fsync(tmp)
    os.replace(tmp, save_dir / TRACKER)
    _fsync(save_dir)


def _prune(save_dir: Path, keep_last: int, *, keep: Path, keep_steps: tuple[int, ...]) -> None:
    """Delete the complete checkpoints older than the ``keep_last`` newest, except ``keep`` and
    those of ``keep_steps``; ``keep_last`` 0 deletes none (Megatron-LM's way)."""
    if keep_last == 0:
        return
    kept = {f"iter_{step:07d}" for step in keep_steps}
    for path in complete_checkpoints(save_dir)[:-keep_last]:
        if path != keep and path.name not in kept:
            _discard(path)


def _remove_leftovers(save_dir: Path) -> None:
    """Remove what a crash left of a save, a deletion or a tracker update."""
    for path in save_dir.iterdir():
        if _LEFTOVER.match(path.name):
            logger.warning("removing %s, left by an interrupted checkpoint save", path)
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def _manifest(checkpoint: Path, *, leave_out: str) -> dict[str, int]:
    """``{file name: size}`` of every file of ``checkpoint`` except ``leave_out`` (the marker)."""
    return {path.name: path.stat().st_size for path in sorted(checkpoint.iterdir())
            if path.is_file() and path.name != leave_out}
