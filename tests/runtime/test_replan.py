"""Replanner: the decision on simulated epochs (single process) and one 2-rank gloo run of step()."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import planner
from planner.curves import fit_envelope
from runtime.replan import DEFAULT_SMOOTHING, ReplanDecision, Replanner

LOG_KEYS = ["event", "epoch", "adopted", "reason", "predicted_gain", "old_batch_sizes", "new_batch_sizes",
            "measured_compute_s", "predicted_compute_s", "plan", "inputs"]


def _profile() -> planner.Profile:
    # The minimal profile (planner/examples/minimal_profile.json): rank 1 is 3x slower than rank 0 per sample.
    return planner.Profile.load(Path(planner.__file__).parent / "examples" / "minimal_profile.json")


def _stats(profile: planner.Profile, plan: planner.Plan, epoch: int, *, slow: tuple[float, ...] = (1.0, 1.0),
           rel_std: float = 0.02, num_steps: int = 50, jitter: np.ndarray | None = None,
           data_wait_s: tuple[float, ...] = (0.0, 0.0)) -> list[planner.StepStats]:
    """Stats as the timers would report them if rank i's true curve were slow[i] x the profile's."""
    out = []
    for r, rp in zip(plan.ranks, profile.by_rank, strict=True):
        c = slow[r.rank] * fit_envelope(rp.compute)(r.batch_size)
        if jitter is not None:
            c *= 1.0 + float(jitter[r.rank])
        out.append(planner.StepStats(
            rank=r.rank, epoch=epoch, num_steps=num_steps, batch_size=r.batch_size, num_workers=r.num_workers,
            data_wait_s=data_wait_s[r.rank], compute_s=c, step_time_s=c + data_wait_s[r.rank] + 0.002,
            compute_s_std=rel_std * c,
        ))
    return out


def test_rank_three_times_slower_is_replanned_toward_rank0() -> None:
    profile = _profile()
    plan = planner.solve(profile, global_batch=512)
    rp = Replanner(profile, plan, threshold=0.05, smoothing=0.5)
    d = rp.decide(_stats(profile, plan, 0, slow=(1.0, 3.0)), epoch=0)
    assert d.adopted, d.reason
    assert d.new_plan is not None and d.new_plan is rp.plan and d.plan is d.new_plan
    assert d.new_plan.global_batch == 512
    assert d.new_plan.batch_sizes[0] > plan.batch_sizes[0] and d.new_plan.batch_sizes[1] < plan.batch_sizes[1]
    assert d.predicted_gain is not None and d.predicted_gain > 0.05
    # 3x the profile in a quiet epoch is a device change (runtime.replan.model.DEVICE_CHANGE): the factor is the
    # measured 3.0, not the EMA's half way.
    assert d.scale_factors == pytest.approx((1.0, 3.0))
    assert d.measured_compute_s[1] == pytest.approx(3 * d.predicted_compute_s[1])
    # The profile in use is the original with rank 1's points corrected: 3x at the batch it measured, the excess
    # spread over the rest by the curve's elasticity there (0.8 on 15 ms + 0.47 ms a sample: within 6% of tripled),
    # the single source of truth.
    assert rp.ratio(1, plan.batch_sizes[1]) == pytest.approx(3.0)
    tripled = [0.090, 0.225, 0.765]
    assert all(abs(p.step_time_s / t - 1) < 0.06 for p, t in zip(rp.profile.rank(1).compute, tripled, strict=True))
    assert rp.profile.rank(0).compute == profile.rank(0).compute

    log = d.to_log()
    assert list(log) == LOG_KEYS
    assert log["adopted"] is True and log["old_batch_sizes"] == list(plan.batch_sizes)
    assert log["new_batch_sizes"] == list(d.new_plan.batch_sizes)
    assert planner.Plan.from_dict(json.loads(json.dumps(log, allow_nan=False))["plan"]) == d.new_plan

    # The slowdown persists: the model stays near 3x (at the new batch it had extrapolated 2.82x; smoothing 0.5
    # moves it half way to the measured 3x).  That extrapolation left the step 6% over its prediction, so the
    # next epoch follows up the same way at most, and then the split stays.
    d2 = rp.decide(_stats(profile, rp.plan, 1, slow=(1.0, 3.0)), epoch=1)
    assert 2.85 < d2.scale_factors[1] < 3.0
    assert d2.plan.batch_sizes[1] <= d.new_plan.batch_sizes[1]
    d3 = rp.decide(_stats(profile, rp.plan, 2, slow=(1.0, 3.0)), epoch=2)
    assert not d3.adopted and d3.plan.batch_sizes == d2.plan.batch_sizes


def test_a_slowdown_in_a_trials_epoch_is_followed_not_reverted() -> None:
    """Epoch 0 reads rank 1 1.4x slow (noise, or the start of a co-tenant) and moves work to rank 0; in epoch 1,
    that move's trial, rank 1 runs 3x slow. The step is slower than epoch 0's, but rank 1's batch went down: the
    ranks changed, not the split. Compared step to step the trial was reverted, and the 3/4-reach bar then refused
    the 150%-gain move toward rank 0 for 5 epochs."""
    profile = _profile()
    plan = planner.solve(profile, global_batch=512)
    rp = Replanner(profile, plan, threshold=0.05)
    d0 = rp.decide(_stats(profile, rp.plan, 0, slow=(1.0, 1.4)), epoch=0)
    assert d0.adopted and d0.plan.batch_sizes[1] < plan.batch_sizes[1], d0.reason
    d1 = rp.decide(_stats(profile, rp.plan, 1, slow=(1.0, 3.0)), epoch=1)
    assert not d1.reverted and d1.adopted, d1.reason
    assert "the ranks changed" in d1.reason and d1.plan.batch_sizes[0] > d0.plan.batch_sizes[0]
    # The uniform correction spreads rank 1's 3x over its curve by elasticity (0.72 at 84), which reads it a little
    # faster than 3x at 29: one more follow-up step the same way, then settled at the true 3x balance.
    d2 = rp.decide(_stats(profile, rp.plan, 2, slow=(1.0, 3.0)), epoch=2)
    d3 = rp.decide(_stats(profile, rp.plan, 3, slow=(1.0, 3.0)), epoch=3)
    assert not d3.adopted and d3.plan.batch_sizes == d2.plan.batch_sizes
    t0, t1 = (fit_envelope(profile.rank(i).compute) for i in range(2))
    best = min(range(1, 512), key=lambda b: max(t0(512 - b), 3 * t1(b)))
    assert abs(d3.plan.batch_sizes[1] - best) <= 2


def test_a_co_tenant_at_half_duty_is_a_device_change_at_the_batch_it_ran_before() -> None:
    """1.3x is under DEVICE_CHANGE (1.5x), but at the batch size the rank ran in the epoch before no curve shape
    moves it: the factor takes the epoch whole (runtime.replan.model.same_batch_changed) and the move follows at
    once. The same jump in an epoch whose steps scatter 60% stays smoothed."""
    profile = _profile()
    plan = planner.solve(profile, global_batch=512)
    rp = Replanner(profile, plan, threshold=0.05)
    rp.decide(_stats(profile, rp.plan, 0), epoch=0)
    d = rp.decide(_stats(profile, rp.plan, 1, slow=(1.0, 1.3)), epoch=1)
    assert d.scale_factors == pytest.approx((1.0, 1.3)) and d.adopted, d.reason
    noisy = Replanner(profile, plan, threshold=0.05)
    noisy.decide(_stats(profile, noisy.plan, 0), epoch=0)
    d = noisy.decide(_stats(profile, noisy.plan, 1, slow=(1.0, 1.3), rel_std=0.6, num_steps=20), epoch=1)
    assert d.scale_factors[1] == pytest.approx(1.0 + DEFAULT_SMOOTHING * 0.3)


def test_noise_alone_does_not_churn_over_ten_epochs() -> None:
    profile = _profile()
    plan = planner.solve(profile, global_batch=512)
    rp = Replanner(profile, plan)
    rng = np.random.default_rng(0)
    decisions: list[ReplanDecision] = []
    for epoch in range(10):
        # Epoch means off by ~2 % at random; per-step noise 5 % over 50 steps.
        stats = _stats(profile, rp.plan, epoch, rel_std=0.05, jitter=rng.normal(0.0, 0.02, size=2))
        decisions.append(rp.decide(stats, epoch=epoch))
    assert sum(d.adopted for d in decisions) <= 1, [d.reason for d in decisions]
    assert all(d.reason for d in decisions)
    assert all(abs(f - 1.0) < 0.06 for f in rp.scale_factors)


def test_gain_within_noise_is_refused() -> None:
    profile = _profile()
    plan = planner.solve(profile, global_batch=512)
    # 1.3x slower would be adopted, but per-step std of 100 % over 5 steps makes 2 x std error ~ 89 %.
    rp = Replanner(profile, plan)
    d = rp.decide(_stats(profile, plan, 0, slow=(1.0, 1.3), rel_std=1.0, num_steps=5), epoch=0)
    assert not d.adopted and "noise" in d.reason
    quiet = Replanner(profile, plan)
    assert quiet.decide(_stats(profile, plan, 0, slow=(1.0, 1.3)), epoch=0).adopted


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [("compute_s", math.nan, "non-finite"), ("step_time_s", math.inf, "non-finite"),
     ("data_wait_s", -1.0, "negative"), ("num_steps", 3, "min_steps")],
)
def test_bad_stats_are_refused_and_leave_the_model_alone(field: str, value: float, words: str) -> None:
    profile = _profile()
    plan = planner.solve(profile, global_batch=512)
    rp = Replanner(profile, plan, min_steps=5)
    stats = _stats(profile, plan, 0, slow=(1.0, 3.0))
    bad: dict[str, Any] = {field: value}
    stats[1] = replace(stats[1], **bad)
    d = rp.decide(stats, epoch=0)
    assert not d.adopted and d.new_plan is None and words in d.reason
    assert d.predicted_gain is None
    assert rp.scale_factors == (1.0, 1.0) and rp.plan is plan
    json.dumps(d.to_log(), allow_nan=False)  # NaN never reaches the log


def test_missing_rank_and_repeated_epoch_are_refused() -> None:
    profile = _profile()
    plan = planner.solve(profile, global_batch=512)
    rp = Replanner(profile, plan)
    stats = _stats(profile, plan, 0, slow=(1.0, 3.0))
    assert "ranks 0..1" in rp.decide(stats[:1], epoch=0).reason
    assert rp.decide(stats, epoch=0).adopted
    assert "already decided" in rp.decide(stats, epoch=0).reason


def test_min_batch_is_never_starved() -> None:
    profile = _profile()
    plan = planner.solve(profile, global_batch=512, min_batch=16)
    # Rank 1 50x slower: the best split would give it a handful of samples; min batch holds it at 16.
    rp = Replanner(profile, plan, smoothing=1.0)
    d = rp.decide(_stats(profile, plan, 0, slow=(1.0, 50.0)), epoch=0)
    assert d.adopted and d.plan.batch_sizes == (496, 16)

    # A solver that ignores min batch (a heuristic plugged in) is refused, not applied.
    def careless(profile: planner.Profile, *, global_batch: int, min_batch: int, **_: Any) -> planner.Plan:
        return planner.evaluate(profile, [global_batch - 1, 1])

    rp = Replanner(profile, plan, smoothing=1.0, solve_fn=careless)
    d = rp.decide(_stats(profile, plan, 0, slow=(1.0, 50.0)), epoch=0)
    assert not d.adopted and "below min batch 16" in d.reason and rp.plan.fingerprint == plan.fingerprint
    # The plan stays, its prediction re-made: 50x slower measured is not what it printed (policy.PREDICTION_MISS).
    assert d.repredicted is rp.plan is d.plan and rp.plan.batch_sizes == plan.batch_sizes
    assert rp.plan.predicted.step_time_s > 10 * plan.predicted.step_time_s
    assert d.candidate is not None and d.candidate.batch_sizes == (511, 1)


def test_data_wait_raises_the_loader_cost() -> None:
    profile = _profile()
    plan = planner.solve(profile, global_batch=512)
    rp = Replanner(profile, plan, smoothing=1.0)
    b0, w0 = plan.ranks[0].batch_size, plan.ranks[0].num_workers
    c0 = fit_envelope(profile.rank(0).compute)(b0)
    # Rank 0 waits as long for data as it computes: its loader paces the whole step, 2 * c0 plus the 2 ms tail
    # after the last bucket (the workers keep loading through it).
    d = rp.decide(_stats(profile, plan, 0, data_wait_s=(c0, 0.0)), epoch=0)
    spp = rp.loader_sec_per_sample
    assert spp[0] == pytest.approx((2 * c0 + 0.002) * w0 / b0) and spp[1] == pytest.approx(0.0004)
    loader = rp.profile.rank(0).loader
    assert loader is not None and loader.sec_per_sample == spp[0]
    # The host has spare cores: the re-solve gives the starved rank more workers and keeps its work.
    assert d.candidate is not None and d.candidate.batch_sizes[0] == b0 and d.candidate.ranks[0].num_workers > w0
    # With its workers capped where they are (--max-workers-per-rank), work moves off the starved rank instead.
    capped = planner.solve(profile, global_batch=512, max_workers_per_rank=w0)
    assert capped.batch_sizes == plan.batch_sizes and capped.ranks[0].num_workers == w0
    d = Replanner(profile, capped, smoothing=1.0).decide(_stats(profile, capped, 0, data_wait_s=(c0, 0.0)), epoch=0)
    assert d.candidate is not None and d.candidate.batch_sizes[0] < b0


def test_state_round_trip_continues_identically() -> None:
    profile = _profile()
    plan = planner.solve(profile, global_batch=512)
    a = Replanner(profile, plan)
    a.decide(_stats(profile, plan, 0, slow=(1.0, 3.0)), epoch=0)
    state = json.loads(json.dumps(a.state_dict()))
    b = Replanner(profile, plan)
    b.load_state_dict(state)
    assert b.plan == a.plan and b.plan.fingerprint == a.plan.fingerprint
    assert b.scale_factors == a.scale_factors and b.loader_sec_per_sample == a.loader_sec_per_sample
    nxt = _stats(profile, a.plan, 1, slow=(1.0, 3.6))  # a little slower again: the model moves, a new plan
    la, lb = a.decide(nxt, epoch=1).to_log(), b.decide(nxt, epoch=1).to_log()
    pa, pb = la.pop("plan"), lb.pop("plan")  # the solver's own timing differs between the two solves
    assert la == lb and pa["fingerprint"] == pb["fingerprint"]
    with pytest.raises(planner.ValidationError):
        b.load_state_dict({**state, "compute_scale": [1.0]})
    with pytest.raises(planner.ValidationError):
        Replanner(profile, plan, solve_kwargs={"global_batch": 1024})


def _step_worker(rank: int, world_size: int, out_dir: str) -> None:
    profile = _profile()
    plan = planner.solve(profile, global_batch=512)
    rp = Replanner(profile, plan)
    records: list[dict[str, Any]] = []
    for epoch, slow in ((0, 3.0), (1, math.nan)):  # a real slowdown, then a broken measurement
        mine = _stats(profile, rp.plan, epoch, slow=(1.0, slow))[rank]
        d = rp.step(mine, epoch)
        assert rp.plan.fingerprint == d.plan.fingerprint
        records.append({"log": d.to_log(), "fingerprint": d.plan.fingerprint, "scale": list(rp.scale_factors)})
    assert records[0]["log"]["adopted"] and not records[1]["log"]["adopted"]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(records))


@pytest.mark.distributed
def test_step_gives_every_rank_the_same_decision(tmp_path: Path) -> None:
    from tests._dist import run_distributed

    run_distributed(_step_worker, 2, str(tmp_path), timeout_s=90.0)
    r0, r1 = (json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2))
    assert r0 == r1
    assert r0[0]["log"]["new_batch_sizes"][0] > 400
    assert "non-finite" in r0[1]["log"]["reason"]


def test_small_gain_needs_a_second_epoch_large_gain_does_not() -> None:
    profile = _profile()
    plan = planner.solve(profile, global_batch=512)
    # Rank 1 1.07x slower (smoothing 1): a gain of a few percent, over the threshold, under confirm_below.
    rp = Replanner(profile, plan, threshold=0.02, smoothing=1.0)
    first = rp.decide(_stats(profile, rp.plan, 0, slow=(1.0, 1.07)), epoch=0)
    assert not first.adopted and "confirms" in first.reason and 0.02 < (first.predicted_gain or 0) < 0.10
    second = rp.decide(_stats(profile, rp.plan, 1, slow=(1.0, 1.07)), epoch=1)
    assert second.adopted
    # A one-off disturbance that goes away is never adopted.
    rp = Replanner(profile, plan, threshold=0.02, smoothing=1.0)
    assert not rp.decide(_stats(profile, rp.plan, 0, slow=(1.0, 1.07)), epoch=0).adopted
    assert not rp.decide(_stats(profile, rp.plan, 1), epoch=1).adopted
    # A large gain (a real slowdown) is followed at once.
    rp = Replanner(profile, plan, smoothing=1.0)
    assert rp.decide(_stats(profile, rp.plan, 0, slow=(1.0, 3.0)), epoch=0).adopted


# -- shape correction and revert (the 2x H200 ResNet-50 F=3 case, in numbers) ---------------------------------
def _t0(b: float) -> float:  # rank 0: profile and truth agree
    return 0.0045 + 0.000196 * b


def _p1(b: float) -> float:  # rank 1 as profiled: right near b = 100, too flat (launch-bound knee mis-measured)
    return 0.059 + 0.000265 * b


def _t1(b: float) -> float:  # rank 1 as it really runs: steeper
    return max(0.050, 0.0146 + 0.00058 * b)


def _knee_profile() -> planner.Profile:
    sizes = (16, 32, 64, 96, 128, 192, 256, 384, 512)
    ranks = [{"rank": i, "host": "n0", "device": f"cuda:{i}",
              "compute": [{"batch_size": b, "step_time_s": f(b)} for b in sizes]}
             for i, f in enumerate((_t0, _p1))]
    return planner.Profile.from_dict({"version": 1, "kind": "profile", "hosts": [{"name": "n0", "cpu_cores": 8}],
                                      "ranks": ranks})


def _true_stats(plan: planner.Plan, epoch: int) -> list[planner.StepStats]:
    times = [_t0(plan.batch_sizes[0]), _t1(plan.batch_sizes[1])]
    step = max(times) + 0.001
    return [planner.StepStats(rank=i, epoch=epoch, num_steps=40, batch_size=plan.batch_sizes[i], num_workers=0,
                              data_wait_s=0.0, compute_s=c, step_time_s=step, compute_s_std=0.01 * c)
            for i, c in enumerate(times)]


def test_shape_error_overshoot_is_reverted_and_not_repeated() -> None:
    profile = _knee_profile()
    plan = planner.solve(profile, global_batch=512, min_batch=2)
    first = plan.batch_sizes
    assert 95 <= first[1] <= 105  # the profile's balance point, as on the GPU
    rp = Replanner(profile, plan, smoothing=1.0)
    steps, logs = [], []
    for epoch in range(10):
        stats = _true_stats(rp.plan, epoch)
        steps.append(stats[0].step_time_s)
        logs.append(rp.decide(stats, epoch))
    adopted = [d for d in logs if d.adopted]
    # The uniformly rescaled curve over-shoots to ~130 (truly 5% slower); one epoch later it is reverted.
    assert adopted[0].new_plan is not None and adopted[0].new_plan.batch_sizes[1] > 120
    k = logs.index(adopted[0])
    assert logs[k + 1].adopted and logs[k + 1].reason.startswith("reverted")
    assert logs[k + 1].plan.batch_sizes == first and steps[k + 1] > steps[k] * 1.03
    # Never again: every later epoch runs no slower than the first plan, and the rejected batches stay rejected.
    assert all(s <= steps[0] * 1.005 for s in steps[k + 2:])
    assert all(d.plan.batch_sizes != adopted[0].new_plan.batch_sizes for d in logs[k + 1:])
    # Rank 1 now has measurements at two batch sizes: its curve is corrected there, not just rescaled.
    assert rp.ratio(1, first[1]) == pytest.approx(_t1(first[1]) / fit_envelope(profile.rank(1).compute)(first[1]))
    b2 = adopted[0].new_plan.batch_sizes[1]
    assert rp.ratio(1, b2) == pytest.approx(_t1(b2) / fit_envelope(profile.rank(1).compute)(b2))
    assert rp.ratio(1, first[1]) < rp.ratio(1, (first[1] + b2) / 2) < rp.ratio(1, b2)
    # ... and the re-solve now lands on the true balance point (t0(512 - b) = t1(b) at b = 116.4), a predicted
    # 3.8% gain: under the 5% threshold, so the plan stays -- no more churn.
    best = min(range(2, 511), key=lambda b: max(_t0(512 - b), _t1(b)))
    last = logs[-1].candidate
    assert last is not None and abs(last.batch_sizes[1] - best) <= 2 and not logs[-1].adopted
    # The state carries all of it: a resumed re-planner decides the same.
    again = Replanner(profile, plan, smoothing=1.0)
    again.load_state_dict(json.loads(json.dumps(rp.state_dict())))
    nxt = _true_stats(rp.plan, 10)
    la, lb = rp.decide(nxt, 10).to_log(), again.decide(nxt, 10).to_log()
    la.pop("plan"), lb.pop("plan")
    assert la == lb


def test_two_ratios_far_apart_mean_a_changed_device_not_a_shape() -> None:
    profile = _profile()
    plan = planner.solve(profile, global_batch=512)
    rp = Replanner(profile, plan, smoothing=1.0)
    rp.decide(_stats(profile, plan, 0), epoch=0)  # rank 1 as profiled at its planned batch
    moved = planner.evaluate(profile, [plan.batch_sizes[0] - 20, plan.batch_sizes[1] + 20])
    rp.decide(_stats(profile, moved, 1, slow=(1.0, 3.0)), epoch=1)  # at another batch, 3x slower: a co-tenant
    # Uniform, from the newest epoch (3x at its batch, spread by the curve's elasticity there), not a shape.
    assert rp.ratio(1, moved.batch_sizes[1]) == pytest.approx(3.0) and 2.5 < rp.ratio(1, 10) < rp.ratio(1, 500) < 3.1


def _random_case(rng: np.random.Generator) -> tuple[int, list[Any], planner.Profile]:
    """Ranks with a launch-bound floor then a linear part; the profile's slope is off by up to +-40% and its floor
    by up to +-30% (shape errors a uniform rescale cannot fix)."""
    W, B = int(rng.choice([2, 3, 4])), int(rng.choice([256, 512, 1024]))
    sizes = [8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
    trues, ranks = [], []
    for i in range(W):
        speed, floor = rng.uniform(0.5, 4.0), rng.uniform(0.005, 0.05)
        slope, icpt = rng.uniform(0.0001, 0.0004) * speed, rng.uniform(0.0, 0.01)
        trues.append(lambda b, f=floor, s=slope, c=icpt: max(f, c + s * b))
        pf, ps = floor * rng.uniform(0.7, 1.3), slope * rng.uniform(0.6, 1.4)
        ranks.append({"rank": i, "host": "n0", "device": f"cuda:{i}",
                      "compute": [{"batch_size": b, "step_time_s": max(pf, icpt + ps * b)} for b in sizes]})
    return B, trues, planner.Profile.from_dict({"version": 1, "kind": "profile",
                                                 "hosts": [{"name": "n0", "cpu_cores": 64}], "ranks": ranks})


RANDOM_SEEDS = (0, 1, 2026)
"""Several seeds, not one: a bound tuned on a single draw says little about the next one.  These three hold the
cases the comments below describe; seeds 2, 3 and 4 pass both tests too (60 cases a seed, ~8 s of one core)."""


def _replanned_ratios(seed: int) -> tuple[float, ...]:
    """Per random case: 12 epochs re-planned / 12 epochs of the first plan (true step times, 1% noise)."""
    return _simulate(seed)[0]


def _reverts(seed: int) -> tuple[int, ...]:
    """Per random case: how many adopted plans were reverted in the 12 epochs."""
    return _simulate(seed)[1]


@functools.cache
def _simulate(seed: int) -> tuple[tuple[float, ...], tuple[int, ...]]:
    rng = np.random.default_rng(seed)
    ratios, reverts = [], []
    for _ in range(60):
        B, trues, profile = _random_case(rng)
        # At the default smoothing: this test and the noise test above are the evidence for it (model.py).
        rp = Replanner(profile, planner.solve(profile, global_batch=B, min_batch=2), smoothing=DEFAULT_SMOOTHING)
        steps, n_reverts = [], 0
        for epoch in range(12):
            bs = rp.plan.batch_sizes
            comp = [t(b) * (1 + 0.01 * rng.standard_normal()) for t, b in zip(trues, bs, strict=True)]
            step = max(comp) + 0.0005
            steps.append(max(t(b) for t, b in zip(trues, bs, strict=True)) + 0.0005)
            d = rp.decide([planner.StepStats(rank=i, epoch=epoch, num_steps=40, batch_size=bs[i], num_workers=0,
                                             data_wait_s=0.0, compute_s=c, step_time_s=step, compute_s_std=0.02 * c)
                           for i, c in enumerate(comp)], epoch)
            n_reverts += d.reverted
        ratios.append(sum(steps) / (steps[0] * len(steps)))
        reverts.append(n_reverts)
    return tuple(ratios), tuple(reverts)


@pytest.mark.slow
@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_replanning_wins_on_average_on_random_shape_errors(seed: int) -> None:
    # On every seed tried (0..19 and 2026) the mean is 0.88-0.92: re-planning wins ~10% back.
    mean = float(np.mean(_replanned_ratios(seed)))
    assert mean < 0.95, (seed, mean)


@pytest.mark.slow
@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_replanning_never_churns_on_random_shape_errors(seed: int) -> None:
    # A trial is how a shape error beyond the measured batches is found, so one reverted trial may cost an epoch
    # (seed 0: a 4-rank case whose rank 2 left its flat part measured 28% slower once: 1.023 over 12 epochs);
    # what must never happen is trying again and again -- after a revert, a move must predict more than the
    # model's demonstrated miss, halved every 5 epochs (runtime/replan/policy.py).  Before that rule seed 0 lost
    # 2.8% by re-adopting a neighbour of the reverted move.  A kept trial may measure up to the 1% revert margin
    # plus the epoch's noise slower, and the era then allows no move back against it (runtime/replan/policy.py):
    # the split stays until its own epochs measure it slower than the one before beyond the noise (seeds 1, 2026:
    # 1.6% over 12 epochs, no revert).
    ratios, reverts = _replanned_ratios(seed), _reverts(seed)
    assert max(reverts) <= 2, (seed, reverts)
    assert all(r <= 1.02 for r, n in zip(ratios, reverts, strict=True) if n == 0), (seed, max(ratios))
    assert max(ratios) <= 1.03, (seed, max(ratios))
