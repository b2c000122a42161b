"""``megatron-ext-run-study`` in a checkout: megatron_ext/cli/run_study.py."""

from megatron_ext.cli.run_study import main

if __name__ == "__main__":
    raise SystemExit(main())
