"""`planner train` applies a plan's measured launch setting before the process group starts (planner/cli/cmd_train.py),
never over a value the user set; without one (or off NCCL) DDP keeps the default group (planner/cli/train.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from planner.cli.cmd_train import apply_launch_env
from planner.cli.distenv import DistEnv
from planner.cli.steps import launch_group
from planner.plan import Plan, Predicted, RankPlan


def _plan(launch_env: dict[str, str]) -> Plan:
    ranks = tuple(RankPlan(rank=i, batch_size=4, share=0.5, num_workers=0, predicted_step_time_s=0.1,
                           bottleneck="compute") for i in range(2))
    pred = Predicted(step_time_s=0.1, samples_per_s=80.0, equal_split_samples_per_s=80.0, ideal_samples_per_s=80.0)
    return Plan(world_size=2, global_batch=8, ranks=ranks, predicted=pred, launch_env=launch_env)


def test_apply_sets_what_is_unset_and_keeps_the_users(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("NCCL_MIN_CTAS", raising=False)
    monkeypatch.setenv("NCCL_MAX_CTAS", "8")
    apply_launch_env({"NCCL_MIN_CTAS": "2", "NCCL_MAX_CTAS": "2"})
    import os

    assert os.environ["NCCL_MIN_CTAS"] == "2" and os.environ["NCCL_MAX_CTAS"] == "8"
    assert "NCCL_MAX_CTAS=8 is set in the environment" in capsys.readouterr().err


def test_launch_group_is_the_default_off_nccl_or_without_a_setting() -> None:
    env = DistEnv(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"), backend="gloo")
    assert launch_group(_plan({}), env) is None
    assert launch_group(_plan({"NCCL_MAX_CTAS": "2"}), env) is None  # gloo: nothing to configure


def test_launch_group_is_made_once_per_setting_and_default_group(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Any) -> None:
    """`planner bench` trains once per strategy and round in one process: the configured group is reused, not
    made (and leaked) per call; a new default group (a re-initialized job) gets its own."""
    import torch.distributed as dist

    import profiler.comm

    made: list[dict[str, str]] = []
    monkeypatch.setattr(profiler.comm, "nccl_group_for", lambda e: made.append(dict(e)) or object())
    monkeypatch.delenv("NCCL_MAX_CTAS", raising=False)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="nccl")
    for attempt in range(2):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store{attempt}", rank=0, world_size=1)
        try:
            a = launch_group(_plan({"NCCL_MAX_CTAS": "2"}), env)
            assert launch_group(_plan({"NCCL_MAX_CTAS": "2"}), env) is a
            b = launch_group(_plan({"NCCL_MAX_CTAS": "4"}), env)
            assert b is not a
        finally:
            dist.destroy_process_group()
        assert made == [{"NCCL_MAX_CTAS": "2"}, {"NCCL_MAX_CTAS": "4"}] * (attempt + 1)
