"""``megatron-ext-plot-loss`` in a checkout: megatron_ext/cli/plot_loss.py."""

from megatron_ext.cli.plot_loss import main

if __name__ == "__main__":
    raise SystemExit(main())
