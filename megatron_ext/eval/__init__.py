"""Downstream evaluation by fine-tuning, as in the paper: the tasks (the offline mini-suite,
:mod:`.suite`; the paper's benchmarks, :mod:`.hub_datasets`; both read through :mod:`.task_io`), the
task families (:class:`.family.Family`, one module each in :mod:`.families`) under the fine-tuning
protocol (:mod:`.finetuning`), the LR x seed grid (:mod:`.harness`: its entry point; :mod:`.grid`:
runs, records and the workers sharing it through :mod:`megatron_ext.claims`), the aggregation and
ranking of models (:mod:`.aggregation`, :mod:`.ranking`) and the renderer of the summary, shared with
the study's report (:mod:`.render`)."""
