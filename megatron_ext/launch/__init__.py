"""The launch layer: every job of a study (a training segment, an evaluation grid), and the GPU
suite of a checkout (``python -m benchmarks.gpu_suite --launcher NAME``), goes through one
:class:`Launcher` interface, implemented once per scheduler.

- :mod:`megatron_ext.launch.job`: :class:`Job`, :class:`Resources`, :class:`JobState`, :class:`Launcher`.
- :mod:`megatron_ext.launch.local`: this machine, one job at a time (torchrun for several processes).
- :mod:`megatron_ext.launch.slurm`: SLURM batch jobs (dependencies, arrays, requeue).
- ``scripts/``: the launch scripts the launchers start (``examples/launch/`` shows the same files);
  ``python -m megatron_ext.launch script NAME`` prints where one is installed.

Adding a launcher: one module defining a :class:`Launcher` subclass as ``LAUNCHER``, and one line
in :data:`LAUNCHERS`. Its name is then a ``--launcher`` choice of ``run_study`` and a key of a
study's ``resources:`` (its extra flags).
"""

from megatron_ext.launch.job import Job, JobEvents, JobState, Launcher, Resources
from megatron_ext.launch.programs import SCRIPTS_DIR, TRAINER, script
from megatron_ext.launch.registry import LAUNCHERS, launcher_class

__all__ = ["LAUNCHERS", "SCRIPTS_DIR", "TRAINER", "Job", "JobEvents", "JobState", "Launcher", "Resources",
           "launcher_class", "script"]
