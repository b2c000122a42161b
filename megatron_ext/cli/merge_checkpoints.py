"""Merge checkpoints trained off one trunk (decay branches) into one model, as mmBERT (arXiv
2509.06888) made its released models: a uniform (weighted) average, or TIES-merging (Yadav et al.
2023, arXiv 2306.01708) against the trunk checkpoint the branches started from.

    python tools/merge_checkpoints.py --method uniform runs/decay_en/ckpt runs/decay_all/ckpt \
        --out runs/merged_uniform
    python tools/merge_checkpoints.py --method ties --base runs/trunk/ckpt/iter_0040000 \
        runs/decay_en/ckpt runs/decay_all/ckpt --density 0.2 --out runs/merged_ties

Each parent (and --base) is a checkpoint directory, or a save directory (its newest). The parents
must be one architecture (model_config.json) with one tokenizer and the same tensors; only
floating-point weights are merged. --out becomes a save directory holding one weights-only
checkpoint (iter_0000000: no optimizer state) and merge.json (method, parents and steps, base,
weights, density, lambda). Train on from it with checkpoint.load: OUT and checkpoint.finetune: true;
export it with tools/export_hf_checkpoint.py --checkpoint OUT. Details: megatron_ext/checkpoint/merge.py.
"""

from __future__ import annotations

import argparse
import sys

from megatron_ext.cli.entry import ArgumentParser, entry_point


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("parents", nargs="+", metavar="PARENT", help="checkpoints to merge (a checkpoint, or a save directory: its newest)")
    add("--method", choices=("uniform", "ties"), required=True,
        help="uniform: the (weighted) average; ties: TIES-merging of the changes from --base")
    add("--base", default=None, help="ties: the checkpoint the parents branched from (the trunk at the branch step)")
    add("--weights", type=float, nargs="+", default=None,
        help="one weight per parent, normalised to sum 1 (default: equal)")
    add("--density", type=float, default=None,
        help="ties: share of each parent's change kept, largest magnitudes first (default 0.2, the paper's top-20%%)")
    add("--lambda", dest="scale", type=float, default=None,
        help="ties: scale of the merged change added to --base (default 1.0)")
    add("--out", required=True, help="save directory to create for the merged checkpoint")
    add("--overwrite", action="store_true", help="replace a non-empty --out")
    return parser


@entry_point("merge_checkpoints.py")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_ext.checkpoint.merge import MergeConfig, merge_checkpoints

    config = MergeConfig(method=args.method, weights=args.weights, density=args.density, scale=args.scale)
    result = merge_checkpoints(args.parents, args.out, config=config, base=args.base, overwrite=args.overwrite,
                               log=lambda line: print(line, flush=True))
    stats = result.stats
    conflicts = "" if stats.conflict_share is None else (
        f"; sign conflicts at {stats.conflict_share:.2%} of the {stats.changed:,} parameters the trimmed changes touch")
    print(f"merged {len(args.parents)} parent(s) by {args.method}: {stats.parameters:,} parameters in "
          f"{stats.tensors} tensors{conflicts} -> {result.checkpoint}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
