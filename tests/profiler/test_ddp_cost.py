"""profiler.ddp on 2 CPU gloo ranks: the DDP cost (exposed tail, wait factors) from steps at the equal and the
balanced split, the same on every rank; profiler.comm's launch variants are NCCL-only."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from planner.curves import fit_envelope
from planner.profile import ComputePoint, RankProfile
from profiler.compute import StepRunner, TimedSteps
from profiler.ddp import balanced_batches, common_batch, ddp_equal_batch, measure_ddp_cost
from profiler.workloads.specs import build_workload
from tests._dist import run_distributed


def _rank(rank: int, times_ms: list[float]) -> RankProfile:
    return RankProfile(rank=rank, host="h", device="cpu",
                       compute=tuple(ComputePoint(batch_size=b, step_time_s=t / 1000)
                                     for b, t in zip([8, 16, 32, 64], times_ms)))


def test_balanced_batches_give_the_slow_rank_less_and_stay_within_measured_sizes() -> None:
    ranks = [_rank(0, [2, 3, 5, 9]), _rank(1, [6, 9, 15])]  # rank 1: 3x slower, its sweep stopped at 32
    assert common_batch(ranks) == 16
    # The fast rank reaches its largest batch (64, 9 ms) first; the slow one runs as long at 15 (8.6 ms).
    assert balanced_batches(ranks) == [64, 15]
    near_oom = dataclasses.replace(ranks[0], meta={"sweep_stop": "does not fit"})
    assert balanced_batches([near_oom, ranks[1]])[0] == 32  # the batch under the memory limit is not used
    assert balanced_batches([ranks[0], ranks[0]]) == [64, 64]  # equal ranks: the equal split
    flat = _rank(0, [5, 5, 5, 5])  # launch-bound: any batch fits in the same time
    assert balanced_batches([flat, dataclasses.replace(flat, rank=1)]) == [64, 64]


def _worker(rank: int, world: int, slowdowns: list[float]) -> None:
    workload = build_workload("mlp", "fake")

    def make_runner() -> TimedSteps:
        return StepRunner(workload, "cpu", slowdown=slowdowns[rank])

    # Standalone curves as a profile would hold them, fixed rather than measured: two ranks timing on a 2-core box
    # race each other, and the split below must not depend on that.  Rank 1 is 3x slower (as its runner is) and its
    # sweep stopped at 32, so the balanced split gives it the smaller batch.
    ranks = [_rank(0, [2, 3, 5, 9]), _rank(1, [6, 9, 15])]
    from runtime.collectives import all_gather_json

    cost = measure_ddp_cost(make_runner, ranks, rounds=2, repeats=2)
    got = all_gather_json([cost.exposed_s, list(cost.wait_factors), list(cost.balanced.batch_sizes),
                           list(cost.span_factors)])
    assert all(g == got[0] for g in got), got  # every rank holds the same numbers
    assert cost.equal.batch_sizes == (ddp_equal_batch(ranks),) * 2 and cost.equal.batch_sizes[0] >= 16
    assert cost.balanced.batch_sizes[1] <= 32 and cost.balanced.batch_sizes[0] <= 64
    assert cost.exposed_s >= 0 and len(cost.exposed_rounds_s) == 2
    assert len(cost.wait_factors) == world and min(cost.wait_factors) == 1.0 and max(cost.wait_factors) <= 2.0
    assert all(c > 0 for c in cost.balanced.compute_s) and cost.predicted_balanced_s > 0
    # Each rank's span under DDP over its standalone step (no optimizer step recorded here), floored at 1, unsnapped
    from planner.curves import fit_envelope

    alone = [fit_envelope(r.compute)(b) for r, b in zip(ranks, cost.balanced.batch_sizes, strict=True)]
    assert cost.span_factors == tuple(round(max(1.0, c / a), 4)
                                      for c, a in zip(cost.balanced.compute_s, alone, strict=True))
    # The tail after the slowest span (no optimizer step recorded here) at the same split, never negative.
    import statistics

    assert cost.span_tail_s == max(0.0, statistics.median(cost.balanced.step_s) - max(cost.balanced.compute_s))
    assert cost.balanced.batch_sizes == (64, 15)  # balanced_batches on the curves above, the same on every rank
    assert dist.get_backend() == "gloo"


@pytest.mark.distributed
def test_ddp_cost_on_two_gloo_ranks() -> None:
    run_distributed(_worker, 2, [1.0, 3.0], timeout_s=120)


def test_nccl_group_for_refuses_what_it_cannot_set() -> None:
    from profiler.comm import nccl_group_for

    assert nccl_group_for({"NCCL_ALGO": "ring"}) is None  # not a per-communicator CTA setting: never tried


def _overlap_worker(rank: int, world: int) -> None:
    import time

    from planner.profile import LoaderProfile
    from profiler.run import measure_rank
    from profiler.sweep import SweepOptions

    workload = build_workload("mlp", "fake")
    seen: list[str] = []

    def loader() -> tuple[LoaderProfile, dict[str, float]]:
        seen.append("loader")
        time.sleep(0.2)  # the loader's own work, in its turn with the other rank (barriers in the thread)
        return LoaderProfile(sec_per_sample=0.001), {"loader_cpu_sec_per_sample": 0.001}

    # Forced beside the sweep on CPU: the loader's turns run in a thread while the sweep runs here.
    rp = measure_rank(lambda dev: StepRunner(workload, dev), "cpu", sweep=SweepOptions.quick(total_budget_s=1.0),
                      measure_loader=loader, overlap_loader=True)
    parts = rp.meta["profile_parts_s"]
    assert seen == ["loader"] and rp.loader is not None and rp.loader.sec_per_sample == 0.001
    assert {"compute sweep", "memory search", "optimizer step", "loader (beside the sweep)"} <= set(parts)
    from runtime.collectives import all_gather_json

    assert all_gather_json(rank) == list(range(world))  # the collectives after it still line up


@pytest.mark.distributed
def test_loader_beside_the_sweep_keeps_the_collectives_in_order() -> None:
    run_distributed(_overlap_worker, 2, timeout_s=120)


def test_a_launch_variant_is_timed_only_where_a_rank_waits_and_cheaply() -> None:
    from profiler.ddp import DDPCost, SplitRounds

    eq = SplitRounds(batch_sizes=(16, 16), step_s=(0.16, 0.17, 0.16), compute_s=(0.05, 0.15), compute_spread=0.01)
    bal = SplitRounds(batch_sizes=(24, 8), step_s=(0.09, 0.09, 0.10), compute_s=(0.088, 0.081), compute_spread=0.01)
    waiting = DDPCost(exposed_s=0.001, exposed_rounds_s=(0.001,) * 3, wait_factors=(1.08, 1.0), equal=eq,
                      balanced=bal, predicted_balanced_s=0.09)
    assert waiting.some_rank_waits
    assert waiting.cost_s(warmup=1, rounds=2, repeats=3) == pytest.approx((0.16 + 0.09) * 7)
    assert not dataclasses.replace(waiting, wait_factors=(1.02, 1.02)).some_rank_waits


def _per_host_worker(rank: int, world: int) -> None:
    from planner.profile import LoaderProfile
    from profiler.run import measure_rank
    from profiler.sweep import SweepOptions

    workload = build_workload("mlp", "fake")
    ran: list[int] = []

    def loader() -> tuple[LoaderProfile, dict[str, float]]:
        ran.append(rank)
        return LoaderProfile(sec_per_sample=0.001 * (rank + 1)), {"loader_cpu_sec_per_sample": 0.001}

    rp = measure_rank(lambda dev: StepRunner(workload, dev), "cpu", sweep=SweepOptions.quick(total_budget_s=0.5),
                      measure_loader=loader, overlap_loader=True, loader_per_host=True)
    # Both ranks share one host: rank 0 measured it once, rank 1 holds rank 0's numbers.
    assert ran == ([0] if rank == 0 else [])
    assert rp.loader is not None and rp.loader.sec_per_sample == 0.001
    assert rp.meta["loader_measured_by_rank"] == 0


@pytest.mark.distributed
def test_one_loader_measurement_per_host_serves_every_rank() -> None:
    run_distributed(_per_host_worker, 2, timeout_s=120)


def test_the_equal_ddp_split_runs_where_plans_run_not_at_the_median_batch() -> None:
    # H100-like: launch-bound to ~48, then linear; the slow rank 3x. The median measured batch (48) is in the flat
    # part where DDP's reducer work shows (15 ms there vs ~1-6 ms compute-bound); the largest batch every rank ran
    # with its slowest step under 0.25 s is used instead.
    sizes = [8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    fast, slow = (RankProfile(rank=i, host="h", device=f"cuda:{i}", compute=tuple(
        ComputePoint(batch_size=b, step_time_s=t / 1000) for b, t in zip(sizes, ms, strict=True)))
        for i, ms in enumerate([[16, 16, 16, 16, 16, 17, 22, 27, 34, 50, 64],
                                [48, 48, 48, 48, 48, 51, 66, 81, 102, 150, 192]]))
    assert common_batch([fast, slow]) <= 64
    b = ddp_equal_batch([fast, slow])
    assert b > common_batch([fast, slow]) and fit_envelope(slow.compute)(b) <= 0.25


def _compressed_worker(rank: int, world: int) -> None:
    import torch

    from profiler.ddp import _hooked_ddp, _Marks

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).double()
    ddp = {c: _hooked_ddp(net, torch.device("cpu"), None, _Marks(torch.device("cpu")), c) for c in ("none", "bf16")}
    got = {}
    for c, model in ddp.items():
        model.zero_grad()
        torch.manual_seed(1 + rank)  # each rank its own batch
        model(torch.randn(8, 16, dtype=torch.float64)).pow(2).sum().backward()
        got[c] = [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]
    for exact, wire in zip(got["none"], got["bf16"], strict=True):
        # What travelled was bf16: the averaged gradient is a bf16 number, within bf16's rounding of the exact mean
        # (two roundings of terms up to the largest entry: the cast, the sum).
        assert torch.equal(wire, wire.bfloat16().double())
        assert (wire - exact).abs().max() <= 2 ** -7 * exact.abs().max()
        assert not torch.equal(wire, exact)


@pytest.mark.distributed
def test_the_profiled_ddp_steps_send_the_gradients_as_the_run_will() -> None:
    """``planner profile --grad-compress bf16``: the DDP steps behind the profile's communication all-reduce bf16
    (profiler.ddp._hooked_ddp), as `planner train --grad-compress bf16` does, so the plan's step includes it."""
    run_distributed(_compressed_worker, 2, timeout_s=60)
