"""``megatron-ext-fetch-sample-data`` in a checkout: megatron_ext/cli/fetch_sample_data.py."""

from megatron_ext.cli.fetch_sample_data import main

if __name__ == "__main__":
    raise SystemExit(main())
