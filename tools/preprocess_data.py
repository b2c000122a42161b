"""``megatron-ext-preprocess-data`` in a checkout: megatron_ext/cli/preprocess_data.py."""

from megatron_ext.cli.preprocess_data import main

if __name__ == "__main__":
    raise SystemExit(main())
