from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import planner
from planner.errors import PlanError, ValidationError
from planner.plan import Plan
from planner.profile import ComputePoint, HostProfile, LoaderProfile, Profile, RankProfile
from planner.solve import RankModel, SolveOptions, build_models
from tests.planner._profiles import MINIMAL, linear_profile, memory_profile


def test_minimal_profile_acceptance() -> None:
    profile = Profile.load(MINIMAL)
    plan = planner.solve(profile, global_batch=512)
    r0, r1 = plan.ranks
    assert plan.batch_sizes == (400, 112)
    assert 0.20 <= r1.share <= 0.30  # "about a quarter"
    assert plan.predicted.samples_per_s >= 1.9 * plan.predicted.equal_split_samples_per_s
    # within one sample's time of each other: rank 1's per-sample slope is 0.06/128 s
    one_sample = 0.255 / 512
    assert abs(r0.predicted_step_time_s - r1.predicted_step_time_s) <= one_sample
    assert plan.predicted.equal_split_samples_per_s == pytest.approx(512 / (0.015 + 256 * 0.06 / 128))
    assert plan.predicted.ideal_samples_per_s == pytest.approx(400 / r0.predicted_step_time_s + 112 / r1.predicted_step_time_s)
    assert {r.bottleneck for r in plan.ranks} == {"compute"}
    # loaders: 0.4 ms/sample, 14 worker cores for 2 ranks -> rank 0 needs ceil(400*0.0004/0.0675) = 3
    assert r0.num_workers >= 3 and r1.num_workers >= 1
    assert r0.num_workers + r1.num_workers <= 14


def test_plan_round_trips_and_fingerprint_is_semantic(tmp_path) -> None:
    plan = planner.solve(Profile.load(MINIMAL), global_batch=512)
    plan.save(tmp_path / "p.json")
    again = Plan.load(tmp_path / "p.json")
    assert again == plan
    assert again.fingerprint == plan.fingerprint
    other = planner.solve(Profile.load(MINIMAL), global_batch=512, min_batch=2)
    assert other.fingerprint != plan.fingerprint  # min_batch is part of what ranks must agree on


def test_hand_computed_three_ranks() -> None:
    # 1, 2, 4 ms per sample: b proportional to speed 4:2:1 -> 400/200/100 at T = 0.4 s
    plan = planner.solve(linear_profile([0.001, 0.002, 0.004]), global_batch=700)
    assert plan.batch_sizes == (400, 200, 100)
    assert plan.predicted.step_time_s == pytest.approx(0.4)
    assert plan.predicted.ideal_samples_per_s == pytest.approx(1750)


def test_memory_cap_binds_and_is_labelled() -> None:
    plan = planner.solve(linear_profile([0.001, 0.004], caps=[300, None]), global_batch=500, max_accumulation_steps=1)
    assert plan.batch_sizes == (300, 200)
    assert plan.ranks[0].bottleneck == "memory"
    assert plan.ranks[1].bottleneck == "compute"


def test_max_batch_per_rank_and_min_batch() -> None:
    plan = planner.solve(linear_profile([0.001, 0.1]), global_batch=100, min_batch=4, max_batch_per_rank=90)
    assert plan.batch_sizes == (90, 10)
    plan = planner.solve(linear_profile([0.001, 1.0]), global_batch=100, min_batch=4)
    assert plan.ranks[1].batch_size == 4


def test_loader_bound_rank_gets_workers_or_less_data() -> None:
    # Same GPUs; loaders cost 10 ms/sample and the host has 2 + 2 cores: 1 worker each.
    prof = linear_profile([0.001, 0.001], loader_s=[0.010, 0.010], cores=4)
    plan = planner.solve(prof, global_batch=200)
    assert plan.batch_sizes == (100, 100)
    assert [r.num_workers for r in plan.ranks] == [1, 1]
    assert all(r.bottleneck == "loader" for r in plan.ranks)
    assert plan.predicted.step_time_s == pytest.approx(1.0)
    # One rank's loader is 4x cheaper: it should take most of the batch.
    prof = linear_profile([0.001, 0.001], loader_s=[0.0025, 0.010], cores=4)
    plan = planner.solve(prof, global_batch=200)
    assert plan.batch_sizes[0] > 150


def test_loaders_share_host_cores() -> None:
    # 2 ranks, 10 cores: 8 worker cores; rank 1's loading is 3x dearer -> it gets more workers.
    prof = linear_profile([0.001, 0.001], loader_s=[0.001, 0.003], cores=10)
    plan = planner.solve(prof, global_batch=400)
    w0, w1 = (r.num_workers for r in plan.ranks)
    assert w0 + w1 <= 8
    assert w1 > w0


def test_too_few_cores_means_serial_loading() -> None:
    prof = linear_profile([0.001, 0.001], loader_s=[0.001, 0.001], cores=2)  # budget 0
    plan = planner.solve(prof, global_batch=200)
    assert [r.num_workers for r in plan.ranks] == [0, 0]
    assert plan.predicted.step_time_s == pytest.approx(100 * 0.002)


def test_infeasible_memory_message_names_numbers() -> None:
    prof = linear_profile([0.001] * 4, caps=[900, 900, 650, 650])
    with pytest.raises(PlanError, match=r"global batch 4096 exceeds the sum of memory caps 3100: ranks 0\.\.3 cap at 900, 900, 650, 650"):
        planner.solve(prof, global_batch=4096, max_accumulation_steps=1)


def test_infeasible_min_batch_messages() -> None:
    with pytest.raises(PlanError, match=r"global batch 3 is below world size 2 x min batch 2 = 4"):
        planner.solve(linear_profile([0.001, 0.001]), global_batch=3, min_batch=2)
    with pytest.raises(PlanError, match=r"min batch 8 exceeds the memory cap of rank 1 \(4\)"):
        planner.solve(linear_profile([0.001, 0.001], caps=[100, 4]), global_batch=50, min_batch=8)
    with pytest.raises(PlanError, match="max-batch-per-rank"):
        planner.solve(linear_profile([0.001, 0.001]), global_batch=50, max_batch_per_rank=10)


def test_bad_options_raise_validation_error() -> None:
    prof = linear_profile([0.001])
    for kwargs in ({"min_batch": 0}, {"memory_headroom": 1.5}, {"max_batch_per_rank": 0}):
        with pytest.raises(ValidationError):
            planner.solve(prof, global_batch=10, **kwargs)
    with pytest.raises(ValidationError):
        planner.solve(prof, global_batch=0)


def test_evaluate_equal_split_matches_predicted_equal() -> None:
    profile = Profile.load(MINIMAL)
    plan = planner.solve(profile, global_batch=512)
    eq = planner.evaluate(profile, [256, 256])
    assert eq.predicted.samples_per_s == pytest.approx(plan.predicted.equal_split_samples_per_s)


def test_comm_tail_adds_to_step_not_split() -> None:
    base = Profile.load(MINIMAL)
    from dataclasses import replace

    from planner.profile import CommProfile

    with_comm = replace(base, comm=CommProfile(backend="nccl", exposed_s=0.005))
    a, b = planner.solve(base, global_batch=512), planner.solve(with_comm, global_batch=512)
    assert a.batch_sizes == b.batch_sizes
    assert b.predicted.step_time_s == pytest.approx(a.predicted.step_time_s + 0.005)


# -- property tests ---------------------------------------------------------------------------------------
@st.composite
def profiles(draw: st.DrawFn) -> tuple[Profile, int, int]:
    n = draw(st.integers(1, 64))
    num_hosts = draw(st.integers(1, min(4, n)))
    hosts = tuple(HostProfile(name=f"h{k}", cpu_cores=draw(st.integers(1, 48))) for k in range(num_hosts))
    with_loader = draw(st.booleans())
    ranks = []
    for i in range(n):
        num_pts = draw(st.integers(1, 5))
        batches = sorted(draw(st.sets(st.integers(1, 1024), min_size=num_pts, max_size=num_pts)))
        base = draw(st.floats(1e-4, 0.05))
        slope = draw(st.floats(1e-6, 1e-3))
        noise = draw(st.lists(st.floats(0.9, 1.1), min_size=num_pts, max_size=num_pts))
        compute = tuple(
            ComputePoint(batch_size=b, step_time_s=(base + slope * b) * z) for b, z in zip(batches, noise, strict=True)
        )
        mem = None
        if draw(st.booleans()):
            per = draw(st.integers(10_000_000, 200_000_000))
            mem = memory_profile(draw(st.integers(10, 80)) * 1_000_000_000, 1_000_000_000, per)
        loader = LoaderProfile(sec_per_sample=draw(st.floats(0.0, 5e-3))) if with_loader else None
        ranks.append(RankProfile(rank=i, host=f"h{i % num_hosts}", device="cuda", compute=compute, memory=mem,
                                 loader=loader))
    min_batch = draw(st.sampled_from([1, 1, 2, 4]))
    B = draw(st.integers(n * min_batch, max(n * min_batch, n * 512)))
    return Profile(hosts=hosts, ranks=tuple(ranks)), B, min_batch


def _times(models: list[RankModel], b: np.ndarray, w: np.ndarray) -> np.ndarray:
    return np.array([m.busy_time(int(x), int(y))[0] for m, x, y in zip(models, b, w, strict=True)])


@pytest.mark.slow
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(profiles())
def test_solution_properties(case: tuple[Profile, int, int]) -> None:
    profile, B, min_batch = case
    models = build_models(profile, SolveOptions(min_batch=min_batch, max_accumulation_steps=1))
    caps = [B if m.cap is None else m.cap for m in models]
    if sum(caps) < B or any(c < min_batch for c in caps):
        with pytest.raises(PlanError, match="memory cap"):
            planner.solve(profile, global_batch=B, min_batch=min_batch, min_gain=0.0, max_accumulation_steps=1)
        return
    plan = planner.solve(profile, global_batch=B, min_batch=min_batch, min_gain=0.0, max_accumulation_steps=1)
    b = np.array(plan.batch_sizes)
    w = np.array([r.num_workers for r in plan.ranks])
    assert int(b.sum()) == B
    assert np.all(b >= min_batch) and np.all(b <= np.array(caps))
    # worker budgets per host
    for h in profile.hosts:
        on_h = [r.rank for r in profile.ranks if r.host == h.name]
        assert sum(int(w[i]) for i in on_h) <= max(0, h.cpu_cores - len(on_h)) or all(w[i] == 0 for i in on_h)
    times = _times(models, b, w)
    step = float(times.max())
    assert plan.predicted.step_time_s == pytest.approx(step + plan.predicted.comm_s)
    # Local optimality: no move of one sample from rank j to rank i lowers the step time.
    n = len(b)
    if n > 1:
        plus = np.array([m.busy_time(int(x) + 1, int(y))[0] for m, x, y in zip(models, b, w, strict=True)])
        minus = np.array([m.busy_time(int(x) - 1, int(y))[0] for m, x, y in zip(models, b, w, strict=True)])
        order = np.argsort(-times)
        for j in range(n):
            if b[j] <= min_batch:
                continue
            for i in range(n):
                if i == j or b[i] >= caps[i]:
                    continue
                rest = [k for k in order[:3] if k not in (i, j)]
                new = max(plus[i], minus[j], times[rest[0]] if rest else 0.0)
                assert new >= step * (1 - 1e-9), f"moving a sample {j}->{i} lowers {step} to {new}"


def test_rank_worker_cap_is_respected_and_moves_data() -> None:
    from dataclasses import replace

    prof = linear_profile([0.001, 0.001], loader_s=[0.004, 0.004], cores=18)
    free = planner.solve(prof, global_batch=400)
    assert free.batch_sizes == (200, 200)
    r1 = prof.by_rank[1]
    assert r1.loader is not None
    capped = replace(prof, ranks=(prof.by_rank[0], replace(r1, loader=replace(r1.loader, max_workers=1))))
    plan = planner.solve(capped, global_batch=400)
    assert plan.ranks[1].num_workers == 1
    assert plan.batch_sizes[1] < 200  # the starved loader gets less data
    assert planner.evaluate(capped, [200, 200]).ranks[1].num_workers == 1


def test_flat_curves_split_evenly_not_to_an_extreme() -> None:
    # Launch-bound GPUs: 8.5 ms whatever the batch up to 2048. Every split ties at T*; the plan must not pile
    # everything on one rank (on H200 [1022, 2] ran 0.77x the equal split), it loads both alike.
    flat = (ComputePoint(batch_size=64, step_time_s=0.0085), ComputePoint(batch_size=2048, step_time_s=0.0086))
    ranks = tuple(RankProfile(rank=i, host="h", device=f"cuda:{i}", compute=flat) for i in range(2))
    plan = planner.solve(Profile(hosts=(HostProfile(name="h", cpu_cores=8),), ranks=ranks), global_batch=1024,
                         min_batch=2)
    assert plan.batch_sizes == (512, 512)


def test_min_gain_keeps_the_equal_split_unless_the_plan_earns_its_departure() -> None:
    # Launch-bound pair (ResNet-18 32x32 on 2x H200): ~flat curves of slightly different slopes. The strict optimum
    # moves a third of the batch for a predicted ~1% -- on the GPUs such splits ran up to 16% slower than equal.
    flat = linear_profile([0.000002, 0.000001], fixed_s=0.0074)
    flat = Profile(hosts=flat.hosts, ranks=(flat.ranks[0], RankProfile(
        rank=1, host="h", device="cuda:1",
        compute=(ComputePoint(batch_size=16, step_time_s=0.0076), ComputePoint(batch_size=256, step_time_s=0.0078)))))
    optimum = planner.solve(flat, global_batch=1024, min_gain=0.0)
    assert abs(optimum.batch_sizes[0] - 512) > 100 and optimum.solver["method"] == "milp"
    kept = planner.solve(flat, global_batch=1024)  # default min_gain 0.05
    assert kept.batch_sizes == (512, 512)
    assert kept.solver["method"] == "equal (milp optimum within min_gain)"
    assert kept.solver["optimum_batch_sizes"] == list(optimum.batch_sizes)
    gain = kept.predicted.step_time_s / optimum.predicted.step_time_s - 1
    assert 0 < gain <= 0.05 and kept.solver["optimum_step_time_s"] == pytest.approx(optimum.predicted.step_time_s)
    assert kept.solver["options"]["min_gain"] == 0.05
    # A real skew is planned as before; min_gain only matters below it.
    assert planner.solve(Profile.load(MINIMAL), global_batch=512).batch_sizes == (400, 112)
    assert planner.solve(flat, global_batch=1024, min_gain=gain / 2).batch_sizes == optimum.batch_sizes
    # An equal split that does not fit (memory cap 300 < 512) is never returned.
    capped = linear_profile([0.001, 0.00101], caps=[None, 300])
    assert planner.solve(capped, global_batch=1024, max_accumulation_steps=1).batch_sizes[1] <= 300
    with pytest.raises(ValidationError, match="min_gain"):
        planner.solve(flat, global_batch=1024, min_gain=1.5)


@pytest.mark.subprocess
def test_the_solver_is_imported_by_the_first_solve_not_with_the_package() -> None:
    """scipy.optimize costs ~0.7 s of CPU to import: every rank imports the package, and only rank 0 solves."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, planner, planner.cli.cmd_report, reports; before = 'scipy' in sys.modules; "
            "planner.solve(planner.Profile.load('planner/examples/minimal_profile.json'), global_batch=64); "
            "print(before, 'scipy.optimize' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert res.returncode == 0 and res.stdout.split() == ["False", "True"], res.stdout + res.stderr
