"""The study's report: the paper's tables (per-family scores with CIs, per-task rankings) and figures.

The implementation is ``megatron_ext/cli/study_report.py``; ``pip install -e .`` (``make setup``) also
installs it as the ``megatron-ext-study-report`` command.
"""

import sys

from megatron_ext.cli.study_report import main

if __name__ == "__main__":
    sys.exit(main())
