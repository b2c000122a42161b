"""Tokenize raw corpora into Megatron-Core indexed datasets (``.bin``/``.idx``).

The implementation is ``megatron_ext/cli/preprocess_data.py``; ``pip install -e .`` (``make setup``) also
installs it as the ``megatron-ext-preprocess-data`` command.
"""

import sys

from megatron_ext.cli.preprocess_data import main

if __name__ == "__main__":
    sys.exit(main())
