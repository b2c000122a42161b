"""``megatron-ext-evaluate`` in a checkout: megatron_ext/cli/evaluate.py."""

from megatron_ext.cli.evaluate import main

if __name__ == "__main__":
    raise SystemExit(main())
