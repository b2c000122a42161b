"""Downstream evaluation by fine-tuning, as in the paper: the tasks (the offline mini-suite,
:mod:`.suite`; the paper's benchmarks, :mod:`.benchmarks`; both read through :mod:`.task_io`), the
fine-tuning protocol and task families (:mod:`.protocol`, :mod:`.families`), the LR x seed grid
and its reports (:mod:`.harness`, shared by N workers through :mod:`megatron_ext.claims`) and the ranking of
models (:mod:`.ranking`)."""
