"""Where the installed package's launch scripts are, for submitting them by hand:

    sbatch "$(python -m megatron_ext.launch script slurm.sbatch)" ...
    python -m megatron_ext.launch scripts          # every launch script, one path a line
"""

from __future__ import annotations

import argparse
import sys

from megatron_ext.config_loading import UserError
from megatron_ext.launch.programs import SCRIPTS_DIR, script


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_ext.launch", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("script", help="the path of one launch script").add_argument("name")
    commands.add_parser("scripts", help="every launch script's path")
    args = parser.parse_args(argv)
    try:
        paths = [script(args.name)] if args.command == "script" else sorted(
            p for p in SCRIPTS_DIR.iterdir() if not p.name.startswith(("_", ".")))
    except UserError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    print("\n".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
