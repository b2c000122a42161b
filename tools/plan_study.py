"""``megatron-ext-plan-study`` in a checkout: megatron_ext/cli/plan_study.py."""

from megatron_ext.cli.plan_study import main

if __name__ == "__main__":
    raise SystemExit(main())
