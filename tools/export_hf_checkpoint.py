"""Export a Megatron checkpoint (pretrain_encoder.py or import_hf_checkpoint.py) to Hugging Face.

The implementation is ``megatron_ext/cli/export_hf_checkpoint.py``; ``pip install -e .`` (``make setup``) also
installs it as the ``megatron-ext-export-hf-checkpoint`` command.
"""

import sys

from megatron_ext.cli.export_hf_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
