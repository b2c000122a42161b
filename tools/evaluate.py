"""Fine-tune encoders on the evaluation tasks over the paper's LR x seed grid and report like the paper.

The implementation is ``megatron_ext/cli/evaluate.py``; ``pip install -e .`` (``make setup``) also
installs it as the ``megatron-ext-evaluate`` command.
"""

import sys

from megatron_ext.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
