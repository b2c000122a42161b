"""Runs that show the effect of Megatron-named settings no other test changes from their default
(``megatron_flags.MEGATRON_FLAGS_HERE`` names these): the data loader's workers, the checkpoints kept."""

from __future__ import annotations

from megatron_ext.training.recipe import run_config_from_dict
from helpers import tiny_recipe


def test_num_workers_start_loader_processes(tmp_path, tiny_corpus, monkeypatch):
    """``--num-workers`` 2 (0 here, Megatron-LM's 2) is the DataLoader's worker count: the rows come
    from worker processes, and the run trains as one that loads in the training process."""
    import torch.utils.data as torch_data

    from megatron_ext.training.loop import pretrain

    started = []
    real_loader = torch_data.DataLoader

    def recording_loader(*args, **kwargs):  # the real loader, its worker count noted
        started.append(kwargs.get("num_workers", 0))
        return real_loader(*args, **kwargs)

    monkeypatch.setattr(torch_data, "DataLoader", recording_loader)
    losses = {}
    for workers in (0, 2):
        started.clear()
        run = tmp_path / f"workers{workers}"
        config = run_config_from_dict(tiny_recipe(tiny_corpus, run, data={"num_workers": workers},
                                                  training={"train_iters": 5, "eval_interval": 0, "log_interval": 5},
                                                  checkpoint={"save_interval": 5}))
        losses[workers] = pretrain(config).losses
        assert started and set(started) == {workers}
    assert losses[0] == losses[2]



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
