"""Build the offline evaluation mini-suite (SC, TC, QA, IR tasks from real registry text) as JSONL.

The implementation is ``megatron_ext/cli/build_eval_suite.py``; ``pip install -e .`` (``make setup``) also
installs it as the ``megatron-ext-build-eval-suite`` command.
"""

import sys

from megatron_ext.cli.build_eval_suite import main

if __name__ == "__main__":
    sys.exit(main())
