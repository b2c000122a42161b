"""The benchmarks of a checkout (benchmarks/README.md): each module a program run from the
repository's root as ``python -m benchmarks.<name>``, writing its record under ``benchmarks/results/``.
Not part of the installed package: they time the checkout's ``megatron_ext`` beside what it is
compared with."""
