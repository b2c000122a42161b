"""Download the paper's benchmarks from the Hugging Face hub into a folder, for a cluster without network.

The implementation is ``megatron_ext/cli/fetch_benchmarks.py``; ``pip install -e .`` (``make setup``) also
installs it as the ``megatron-ext-fetch-benchmarks`` command.
"""

import sys

from megatron_ext.cli.fetch_benchmarks import main

if __name__ == "__main__":
    sys.exit(main())
