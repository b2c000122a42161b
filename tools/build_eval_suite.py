"""``megatron-ext-build-eval-suite`` in a checkout: megatron_ext/cli/build_eval_suite.py."""

from megatron_ext.cli.build_eval_suite import main

if __name__ == "__main__":
    raise SystemExit(main())
