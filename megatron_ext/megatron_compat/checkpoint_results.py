"""megatron-core 0.19.2's checkpoint writers report their results through a module-level queue that
it creates on first use and never shuts down (``filesystem_async.get_write_results_queue``):
:class:`ResultsQueue` owns it instead. ``checkpoint.writer`` holds the one instance and acquires it
while any saver is open."""

from __future__ import annotations

import os

from megatron_ext import processes


class ResultsQueue:
    """The queue through which Megatron's checkpoint writers report, owned here.

    Megatron-Core 0.19.2 creates it on first use (``filesystem_async.get_write_results_queue``)
    with a spawn-context ``Manager()`` that nothing ever shuts down, for synchronous saves too: a
    ~700 MB process alive after the run and, after ``kill -9`` of the trainer, forever (NVRx's
    writer, a copy of that module, does the same). This one is installed in their place while any
    saver is open. Asynchronous saves report from their writer process, so while an asynchronous
    saver is open it is a manager's queue that dies with the trainer
    (``processes.die_with_parent``) and is shut down when the last such saver closes. A synchronous
    save reports from this process (``execute_sync``): a plain queue serves it, without the
    manager's process, which would import torch to unpickle the write results (~5 s of every
    run's start and end on a CPU)."""

    def __init__(self) -> None:
        self._users = 0
        self._across_processes = 0
        self._manager = None
        self._queue = None

    def acquire(self, *, across_processes: bool) -> None:
        """A saver opens; ``across_processes``: its writes report from another process."""
        self._users += 1
        self._across_processes += across_processes
        if across_processes and self._manager is None:
            import multiprocessing
            from multiprocessing.managers import SyncManager

            self._manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
            with processes.helpers_ignore_stop_signals():  # alive for the save a stop signal asks for
                self._manager.start(initializer=processes.die_with_parent, initargs=(os.getpid(),))
            self._queue = self._manager.Queue()
        elif self._queue is None:
            import queue

            self._queue = queue.Queue()
        self._install(self._queue)  # again for each saver: NVRx's is imported by its first saver

    def release(self, *, across_processes: bool) -> None:
        self._users -= 1
        self._across_processes -= across_processes
        if self._manager is not None and self._across_processes == 0:
            self._manager.shutdown()
            self._manager = self._queue = None
            if self._users:
                import queue

                self._queue = queue.Queue()
        if self._users == 0:
            self._queue = None
        self._install(self._queue)

    @staticmethod
    def _install(results_queue) -> None:
        for module in _writer_modules():
            module._results_queue = results_queue


def _writer_modules() -> list:
    """The checkpoint writer modules loaded in this process that hold a results queue: Megatron's,
    and NVRx's once an ``nvrx`` saver has imported it."""
    import sys

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    nvrx = sys.modules.get("nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async")
    return [filesystem_async] + ([nvrx] if nvrx is not None else [])


