"""What a run costs the hardware, before and while it runs: one room for the numbers the trainer, its
dry run, the study planner and the benchmarks share.

- ``devices.py``: each device kind's dense peak FLOP/s and memory (datasheets), and the rule that names
  a device's kind;
- ``flops.py``: training FLOPs per token and the MFU convention they are stated in;
- ``memory.py``: the memory model (bytes per rank at the peak of a step);
- ``measured_speeds.py``: the measured-speed table (what the benchmarks measured, the committed
  records shipped in ``megatron_ext/measured/``);
- ``cost.py``: the cost model (GPU-hours and wall time of a run from those speeds).

Below ``training/``: a run's config (``training.config.RunConfig``) is read by its fields, never
imported. The package imports nothing here, so that a light reader (``benchmarks/gpu_suite.py``: the
device kind rule) loads only the module it names.
"""
