"""``megatron-ext-fill-mask`` in a checkout: megatron_ext/cli/fill_mask.py."""

from megatron_ext.cli.fill_mask import main

if __name__ == "__main__":
    raise SystemExit(main())
