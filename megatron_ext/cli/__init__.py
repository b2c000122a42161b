"""The command-line tools (``tools/*.py`` and the ``megatron-ext-*`` commands): one ``main(argv=None)`` each.

Importing this package (which every tool and the trainer, ``pretrain_encoder``, do before Megatron is
imported) keeps the third-party warnings each rank would repeat to one (``entry.THIRD_PARTY_WARNINGS``).
"""

from megatron_ext.cli.entry import third_party_warnings_once

third_party_warnings_once()
