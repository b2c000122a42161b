"""Build the demo corpus (Wikipedia articles, news, a public-domain novel) as JSONL.

The implementation is ``megatron_ext/cli/fetch_sample_data.py``; ``pip install -e .`` (``make setup``) also
installs it as the ``megatron-ext-fetch-sample-data`` command.
"""

import sys

from megatron_ext.cli.fetch_sample_data import main

if __name__ == "__main__":
    sys.exit(main())
