"""``megatron-ext-study-report`` in a checkout: megatron_ext/cli/study_report.py."""

from megatron_ext.cli.study_report import main

if __name__ == "__main__":
    raise SystemExit(main())
