"""Plot training and validation loss curves of one or more runs to a PNG.

The implementation is ``megatron_ext/cli/plot_loss.py``; ``pip install -e .`` (``make setup``) also
installs it as the ``megatron-ext-plot-loss`` command.
"""

import sys

from megatron_ext.cli.plot_loss import main

if __name__ == "__main__":
    sys.exit(main())
