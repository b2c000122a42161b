"""``megatron-ext-fetch-benchmarks`` in a checkout: megatron_ext/cli/fetch_benchmarks.py."""

from megatron_ext.cli.fetch_benchmarks import main

if __name__ == "__main__":
    raise SystemExit(main())
