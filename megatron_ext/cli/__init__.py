"""The command-line tools (``tools/*.py`` and the ``megatron-ext-*`` commands): one ``main(argv=None)`` each."""
