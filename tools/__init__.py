"""The checkout's tools: a wrapper per ``megatron-ext-*`` command (run by its path, ``python
tools/preprocess_data.py``), and the docs' renderer and checker, which import each other as
``tools.check_docs`` and so run as ``python -m tools.render_docs`` / ``python -m tools.check_docs``."""
