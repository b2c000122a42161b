"""Convert a Hugging Face decoder into a Megatron checkpoint for continued pretraining (CPT).

The implementation is ``megatron_ext/cli/import_hf_checkpoint.py``; ``pip install -e .`` (``make setup``) also
installs it as the ``megatron-ext-import-hf-checkpoint`` command.
"""

import sys

from megatron_ext.cli.import_hf_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
