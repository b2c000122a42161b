"""``parallel.distributed_timeout_minutes``: the collective timeout of the run's process groups, so a
hung peer ends the run after that long (Megatron's ``--distributed-timeout-minutes``)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from megatron_ext import process_group
from megatron_ext.config_loading import UserError
from megatron_ext.training.config import ParallelConfig


def _timeout(group) -> datetime.timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def test_the_setting_is_the_collective_timeout_of_the_world_and_megatrons_groups():
    from megatron.core import parallel_state

    parallel = ParallelConfig(distributed_timeout_minutes=3)
    process_group.init_process_group_and_model_parallel(timeout_minutes=parallel.distributed_timeout_minutes)
    try:
        assert _timeout(dist.distributed_c10d._get_default_group()) == datetime.timedelta(minutes=3)
        assert _timeout(parallel_state.get_data_parallel_group()) == datetime.timedelta(minutes=3)
    finally:
        process_group.destroy_process_group_and_model_parallel()
    assert ParallelConfig().distributed_timeout_minutes == 10  # Megatron's default


def test_a_timeout_below_a_minute_is_refused_by_name():
    with pytest.raises(UserError, match="parallel.distributed_timeout_minutes must be >= 1, got 0"):
        ParallelConfig(distributed_timeout_minutes=0)
