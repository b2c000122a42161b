"""Runs that show the effect of Megatron-named settings no other test changes from their default
(``megatron_flags.MEGATRON_FLAGS_HERE`` names these): the data loader's workers, the checkpoints kept."""

from __future__ import annotations

from megatron_ext.training.recipe import run_config_from_dict
from helpers import tiny_recipe


# A trainer in a process of its own (as a user's): the DataLoader it builds noted, the losses printed.
_RECORDING_TRAINER = """
import json, sys
import torch.utils.data as torch_data
real_loader, started = torch_data.DataLoader, []
def recording_loader(*args, **kwargs):
    started.append(kwargs.get("num_workers", 0))
    return real_loader(*args, **kwargs)
torch_data.DataLoader = recording_loader
from megatron_ext.training.loop import pretrain
from megatron_ext.training.recipe import run_config_from_dict
result = pretrain(run_config_from_dict(json.loads(sys.argv[1])))
print(json.dumps({"started": started, "losses": result.losses}))
"""


def test_num_workers_start_loader_processes(tmp_path, tiny_corpus):
    """``--num-workers`` 2 (0 here, Megatron-LM's 2) is the DataLoader's worker count: the rows come
    from worker processes, and the run trains as one that loads in the training process. Each run is
    a trainer process of its own: forked from a test process that other tests left threads in, a
    worker can die at start (a segmentation fault seen once under xdist)."""
    import json
    import subprocess
    import sys

    outcomes = {}
    for workers in (0, 2):
        run = tmp_path / f"workers{workers}"
        recipe = tiny_recipe(tiny_corpus, run, data={"num_workers": workers},
                             training={"train_iters": 5, "eval_interval": 0, "log_interval": 5},
                             checkpoint={"save_interval": 5})
        done = subprocess.run([sys.executable, "-c", _RECORDING_TRAINER, json.dumps(recipe)], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        outcomes[workers] = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcomes[0]["started"] and set(outcomes[0]["started"]) == {0}
    assert outcomes[2]["started"] and set(outcomes[2]["started"]) == {2}
    assert outcomes[0]["losses"] == outcomes[2]["losses"]


def test_keep_last_zero_keeps_every_checkpoint_as_megatron_lm(tmp_path, tiny_corpus):
    """``--save-interval 2`` over 6 steps saves at 2, 4 and 6; the default ``--keep-last 2`` then
    deletes step 2, ``--keep-last 0`` keeps all three, as Megatron-LM does."""
    from megatron_ext.training.loop import pretrain

    kept = {}
    for keep_last in (2, 0):
        run = tmp_path / f"keep{keep_last}"
        config = run_config_from_dict(tiny_recipe(
            tiny_corpus, run, training={"train_iters": 6, "eval_interval": 0, "log_interval": 6},
            phases=[{"objective": "mlm", "mask_ratio": 0.4, "share": 1.0}],
            checkpoint={"save": str(run / "ckpt"), "save_interval": 2, "keep_last": keep_last}))
        pretrain(config)
        kept[keep_last] = sorted(p.name for p in (run / "ckpt").glob("iter_*"))
    assert kept[2] == ["iter_0000004", "iter_0000006"]
    assert kept[0] == ["iter_0000002", "iter_0000004", "iter_0000006"]
