"""``megatron-ext-merge-checkpoints`` in a checkout: megatron_ext/cli/merge_checkpoints.py."""

from megatron_ext.cli.merge_checkpoints import main

if __name__ == "__main__":
    raise SystemExit(main())
