"""Checkpoints: the artifact every stage above training reads (resume, continued pretraining,
Hugging Face export, evaluation). ``config``: the run config's ``checkpoint:`` section (no
Megatron import); ``megatron_io``: Megatron distributed checkpoints written atomically, the tracker,
optimizer-state formats, the tokenizer reference and the asynchronous saver; ``resolved``: one
checkpoint resolved once, as export, evaluation and resume read it; ``resume``: the resume policy."""
