"""megatron_ext: pretrain text encoders (MLM, CLM, biphasic CLM->MLM) on NVIDIA Megatron-Core.

Implements the system of "Should We Still Pretrain Encoders with Masked Language Modeling?"
(Gisserot-Boukhlef et al., arXiv 2507.00994) as a thin extension over Megatron-Core.
"""

__version__ = "0.1.0"
