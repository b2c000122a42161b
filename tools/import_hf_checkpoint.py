"""``megatron-ext-import-hf-checkpoint`` in a checkout: megatron_ext/cli/import_hf_checkpoint.py."""

from megatron_ext.cli.import_hf_checkpoint import main

if __name__ == "__main__":
    raise SystemExit(main())
