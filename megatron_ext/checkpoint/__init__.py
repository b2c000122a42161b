"""Checkpoints: the artifact every stage above training reads (resume, continued pretraining,
Hugging Face export, evaluation). ``config``: the run config's ``checkpoint:`` section (no
Megatron import); ``reader``: the read side, :class:`~megatron_ext.checkpoint.reader.Checkpoint`
(resolving, listing, verifying, loading; the layout on disk); ``writer``: the write side, the save
engine and its asynchronous writers, publishing atomically; ``storage``: a full or read-only disk;
``resume``: the resume policy; ``lock``: one trainer per save directory."""
