"""Train a study: its segments through a launcher (this machine, SLURM), parents before children.

The implementation is ``megatron_ext/cli/run_study.py``; ``pip install -e .`` (``make setup``) also
installs it as the ``megatron-ext-run-study`` command.
"""

import sys

from megatron_ext.cli.run_study import main

if __name__ == "__main__":
    sys.exit(main())
