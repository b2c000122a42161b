"""``megatron-ext-train-tokenizer`` in a checkout: megatron_ext/cli/train_tokenizer.py."""

from megatron_ext.cli.train_tokenizer import main

if __name__ == "__main__":
    raise SystemExit(main())
