"""A loop that keeps its DataLoader keeps its loader workers: re-plans and their predictions are made for them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

import planner
from planner.runlog import read_run_log
from runtime.replan import Replanner

RUN = Path(__file__).resolve().parents[2] / "tests" / "data" / "h100x2_resnet50_loader_skew_8_workers_341_171"


def _epoch(epoch: int) -> tuple[planner.Profile, planner.Plan, list[planner.StepStats]]:
    """A recorded 2x H100 launch whose rank 0 starved on its loader; rank 1's compute as its own (peer-free)."""
    plan = planner.Plan.load(f"{RUN}_plan.json")
    stats = list(read_run_log(f"{RUN}_run.jsonl").epochs[epoch].ranks)
    s = stats[1]
    assert s.compute_s_median is not None and s.compute_s_mad is not None
    stats[1] = replace(s, compute_s=s.compute_s_median, compute_s_std=1.4826 * s.compute_s_mad,
                       interference_s=s.compute_s - s.compute_s_median)
    return planner.Profile.load(f"{RUN}_profile.json"), plan, [replace(s, epoch=0) for s in stats]


def test_solve_at_fixed_workers_balances_the_batches_for_them() -> None:
    profile, plan, _ = _epoch(1)
    free = planner.solve(profile, global_batch=plan.global_batch, min_batch=2)
    fixed = [max(1, r.num_workers // 2) for r in free.ranks]
    kept = planner.solve(profile, global_batch=plan.global_batch, min_batch=2, num_workers=fixed)
    assert [r.num_workers for r in kept.ranks] == fixed and sum(kept.batch_sizes) == plan.global_batch
    # No split does better at those workers than the one it found (the same model evaluates every split).
    for d in (-8, -2, 2, 8):
        b = (kept.batch_sizes[0] + d, kept.batch_sizes[1] - d)
        other = planner.evaluate(profile, b, num_workers=fixed, min_batch=2)
        assert other.predicted.step_time_s >= kept.predicted.step_time_s * (1 - 1e-9)
    with pytest.raises(planner.ValidationError, match="num_workers"):
        planner.solve(profile, global_batch=plan.global_batch, num_workers=[1])


@pytest.mark.parametrize("epoch", [1, 2])
def test_a_loop_that_keeps_its_loader_gets_plans_at_its_workers(epoch: int) -> None:
    profile, plan, stats = _epoch(epoch)
    ran = [s.num_workers for s in stats]
    followed = Replanner(profile, plan).decide(stats, epoch=0)
    kept = Replanner(profile, plan, follow_workers=False).decide(stats, epoch=0)
    assert followed.adopted and kept.adopted, (followed.reason, kept.reason)
    assert [r.num_workers for r in kept.plan.ranks] == ran  # the workers that will run
    # The move off the starving rank is still made, predicted for the loaders as they are.
    assert kept.plan.batch_sizes[0] < plan.batch_sizes[0] - 20
    assert kept.predicted_gain is not None and kept.predicted_gain > 0.05


def test_the_setting_is_part_of_the_description_a_replay_rebuilds() -> None:
    profile, plan, _ = _epoch(1)
    rp = Replanner(profile, plan, follow_workers=False)
    assert Replanner.from_description(rp.describe(), plan).follow_workers is False
    assert Replanner.from_description(Replanner(profile, plan).describe(), plan).follow_workers is True
