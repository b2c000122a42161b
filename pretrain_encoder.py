"""``python pretrain_encoder.py`` and ``torchrun ... pretrain_encoder.py`` in a checkout: the trainer,
``megatron_ext/cli/pretrain_encoder.py`` (installed: ``megatron-ext-pretrain``, or
``python -m megatron_ext.cli.pretrain_encoder``, which the launch scripts run)."""

from megatron_ext.cli.pretrain_encoder import main

if __name__ == "__main__":
    raise SystemExit(main())
