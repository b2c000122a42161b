"""Train a byte-level BPE tokenizer for encoders (bos, eos, pad and mask tokens) on a corpus.

The implementation is ``megatron_ext/cli/train_tokenizer.py``; ``pip install -e .`` (``make setup``) also
installs it as the ``megatron-ext-train-tokenizer`` command.
"""

import sys

from megatron_ext.cli.train_tokenizer import main

if __name__ == "__main__":
    sys.exit(main())
