"""Plan a study: its runs and the tree of training segments they share (``--dry-run`` prints it).

The implementation is ``megatron_ext/cli/plan_study.py``; ``pip install -e .`` (``make setup``) also
installs it as the ``megatron-ext-plan-study`` command.
"""

import sys

from megatron_ext.cli.plan_study import main

if __name__ == "__main__":
    sys.exit(main())
