"""Plans in multiples of M (SolveOptions.batch_multiple): every rank's batch and micro-batch a multiple of M."""

from __future__ import annotations

from pathlib import Path

import pytest

import planner
from planner.cli import main
from planner.errors import ValidationError
from runtime.replan import Replanner

MINIMAL = Path(planner.__file__).parent / "examples" / "minimal_profile.json"


def _profile() -> planner.Profile:
    return planner.Profile.load(MINIMAL)


def _multiples(plan: planner.Plan, M: int) -> bool:
    return all(r.batch_size % M == 0 and all(m % M == 0 for m in r.micro_batches) for r in plan.ranks)


@pytest.mark.parametrize("M", [8, 16, 48])
def test_every_batch_is_a_multiple_and_the_step_is_near_the_free_optimum(M: int) -> None:
    profile = _profile()
    B = 10 * M * 2
    free = planner.solve(profile, global_batch=B)
    plan = planner.solve(profile, global_batch=B, batch_multiple=M)
    assert sum(plan.batch_sizes) == B and _multiples(plan, M), plan.batch_sizes
    assert plan.options.batch_multiple == M and f"in multiples of {M}" in str(plan.solver["method"])
    # One unit of M moved is the most the rounding can cost: within the slower rank's time for M more samples.
    slow = max(free.ranks, key=lambda r: r.predicted_step_time_s)
    per_sample = slow.predicted_step_time_s / slow.batch_size
    assert plan.predicted.step_time_s <= free.predicted.step_time_s + M * per_sample
    assert plan.predicted.step_time_s >= free.predicted.step_time_s * (1 - 1e-9)  # never beats the free optimum


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_micro_batches_are_multiples_when_a_rank_accumulates(mode: str) -> None:
    plan = planner.solve(_profile(), global_batch=512, batch_multiple=16, max_micro_batch=100, mode=mode)
    assert sum(plan.batch_sizes) == 512 and _multiples(plan, 16)
    assert plan.accumulates and all(m <= 100 for r in plan.ranks for m in r.micro_batches)
    if mode == "fsdp":
        assert len({r.accumulation_steps for r in plan.ranks}) == 1


def test_the_kept_equal_split_is_in_multiples_too() -> None:
    plan = planner.solve(_profile(), global_batch=80, batch_multiple=8, min_gain=0.99)
    assert plan.solver["method"].startswith("equal (") and list(plan.batch_sizes) == [40, 40]
    odd = planner.solve(_profile(), global_batch=72, batch_multiple=8, min_gain=0.99)
    assert list(odd.batch_sizes) == [40, 32] and _multiples(odd, 8)


def test_a_global_batch_that_no_multiple_meets_is_refused_with_the_nearest_that_work() -> None:
    profile = _profile()
    with pytest.raises(ValidationError, match=r"global batch 510 is not a multiple of --batch-multiple 8: the "
                                              r"nearest global batches that work are 504 and 512$"):
        planner.solve(profile, global_batch=510, batch_multiple=8)
    with pytest.raises(ValidationError, match=r"global batch 20 cannot give 2 ranks a multiple of --batch-multiple "
                                              r"16 each .* the smallest global batch that works is 32$"):
        planner.solve(profile, global_batch=20, batch_multiple=16)
    with pytest.raises(ValidationError, match="batch_multiple must be >= 1"):
        planner.solve(profile, global_batch=512, batch_multiple=0)


def test_plan_cli_batch_multiple(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--profile", str(MINIMAL), "--global-batch", "510", "--batch-multiple", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: global batch 510 is not a multiple of --batch-multiple 8: the nearest global batches "
                   "that work are 504 and 512"]
    assert main(["plan", "--profile", str(MINIMAL), "--global-batch", "480", "--batch-multiple", "48", "--json"]) == 0
    plan = planner.Plan.from_dict(__import__("json").loads(capsys.readouterr().out), path="stdout")
    assert _multiples(plan, 48) and sum(plan.batch_sizes) == 480


def test_a_replan_keeps_the_plans_multiple() -> None:
    profile = _profile()
    plan = planner.solve(profile, global_batch=512, batch_multiple=16)
    stats = []
    for r, rp in zip(plan.ranks, profile.by_rank, strict=True):  # rank 1 runs 3x slower than profiled
        c = (1.0, 3.0)[r.rank] * planner.curves.fit_envelope(rp.compute)(r.batch_size)
        stats.append(planner.StepStats(rank=r.rank, epoch=0, num_steps=50, batch_size=r.batch_size,
                                       num_workers=r.num_workers, data_wait_s=0.0, compute_s=c,
                                       step_time_s=c + 0.002, compute_s_std=0.02 * c))
    d = Replanner(profile, plan, smoothing=0.5).decide(stats, epoch=0)
    assert d.adopted and d.new_plan is not None
    assert _multiples(d.new_plan, 16) and d.new_plan.batch_sizes != plan.batch_sizes
