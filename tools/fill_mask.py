"""Fill in masked words with an exported encoder, using plain Hugging Face transformers.

The implementation is ``megatron_ext/cli/fill_mask.py``; ``pip install -e .`` (``make setup``) also
installs it as the ``megatron-ext-fill-mask`` command.
"""

import sys

from megatron_ext.cli.fill_mask import main

if __name__ == "__main__":
    sys.exit(main())
