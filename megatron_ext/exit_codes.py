"""Every exit status the trainer and the tools end with (and the file a trainer writes its own to),
in one module that imports nothing, so
that the launch layer (``launch/slurm_batch.py`` runs on a batch host without torch), the trainer
and the docs (``tools/render_docs.py``'s table in docs/clusters.md) read the same numbers.

0 is success and 1 a bug (a traceback); these are the others.
"""

from __future__ import annotations

USER_ERROR_EXIT_CODE = 2
"""Exit status of a run stopped by bad input (argparse's own code for a bad command line). A
``UserError`` subclass may carry another as its ``exit_code`` (:data:`STORAGE_EXIT_CODE`: the
save directory is full)."""

STORAGE_EXIT_CODE = 74
"""Exit status of a run stopped because its save directory is full, over quota or read-only
(sysexits' EX_IOERR): the newest complete checkpoint is intact and the same command resumes once
space is freed. Not requeued automatically: the disk would still be full."""

RESUMABLE_EXIT_CODE = 75
"""Exit status of a run that stopped on request after saving, or that a hung rank stopped
(``training.hang_timeout_minutes``: the newest complete checkpoint is where it resumes)
(sysexits' EX_TEMPFAIL: try again). ``examples/launch/slurm.sbatch`` requeues the job on it and on
nothing else."""

STOPPED_UNSAVED_EXIT_CODE = 76
"""Exit status of a run that stopped on request with nothing to resume from (``checkpoint.save``
unset): a rerun would start over, so a launcher must not requeue it."""

INTERRUPTED_EXIT_CODE = 130
"""Exit status of a program stopped by Ctrl-C without finishing (128 + SIGINT, as a shell reports
it): a tool interrupted (what it finished is kept, nothing is half-written), a trainer interrupted
during start-up or by a third Ctrl-C (the save in flight is lost; the previous checkpoint is where
the same command resumes)."""

EXIT_STATUS_ENV = "MEGATRON_EXT_EXIT_STATUS_FILE"
"""When set, global rank 0 writes its exit status there (one line: the code, then a reason;
``training.stop.write_exit_status``). torchrun reports 1 whenever a worker exits non-zero, so a
launch script behind it reads the trainer's own status from this file (``examples/launch/slurm.sbatch``
requeues on :data:`RESUMABLE_EXIT_CODE`)."""

STOP_HANDLERS_SUFFIX = ".stop-handlers"
"""When :data:`EXIT_STATUS_ENV` is set, global rank 0 creates ``<status file>.stop-handlers`` once
the trainer's stop handlers are installed (``training.stop.StopPolicy.signals_handled``): from then
on a stop signal to the job's processes stops the run at a checkpoint. ``slurm.sbatch`` passes the
signals its batch shell receives on to the step only after that (before, the processes of the step
ignore them, and srun gives up a step it is still creating when a signal comes)."""
