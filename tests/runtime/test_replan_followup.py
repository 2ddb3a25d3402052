"""Corrections that finish: a re-plan whose first epoch misses its prediction is followed up, and a plan kept off
its prediction carries the prediction the model now makes (single process, simulated epochs).

The simulated co-tenant: from epoch 3 a second process shares rank 1's GPU.  Its kernels then share the SMs, so
rank 1's launch-bound floor is gone and every sample costs twice as much plus a fixed 60 ms a step (time slices):

    profiled   t(b) = max(40 ms, 4 ms + 0.3 ms * b)          both ranks, what the profile measured
    rank 1     t'(b) = 2 * 0.3 ms * b * (80.8 / 76.8) + 60 ms   from epoch 3 (no floor, a per-step cost)

A uniformly rescaled curve cannot express that, nor can the two-point shape correction below its lower measured
batch (it keeps the profile's floor there).  Before the follow-up rule the Replanner adopted [382, 130] after the
first slow epoch (good), then ran 142.1 ms a step against the 118.6 ms it printed (+19.8%) in every later epoch:
the remaining predicted gain (4.2%) was under the 5% threshold, and the printed prediction was never re-made.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence

import numpy as np
import pytest

import planner
from planner.plan import micro_batch_sizes
from runtime.replan import ReplanDecision, Replanner
from runtime.replan.policy import PREDICTION_MISS

SIZES = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024)
CHANGE_EPOCH = 3
Curve = Callable[[float], float]


def _profiled(b: float) -> float:
    return max(0.040, 0.004 + 0.0003 * b)


def _scaled(factor: float, b: float) -> float:
    return factor * _profiled(b)


def _cotenant(b: float) -> float:
    return 2.0 * _profiled(256) * b / 256 + 0.060


def _profile(world: int = 2, *, cap: int | None = None, optimizer_s: float | None = None) -> planner.Profile:
    ranks = []
    for i in range(world):
        r: dict = {"rank": i, "host": "n0", "device": f"cuda:{i}",
                   "compute": [{"batch_size": b, "step_time_s": _profiled(b)} for b in SIZES]}
        if cap is not None:
            r["memory"] = {"max_batch_size": cap}
        if optimizer_s is not None:
            r["optimizer_step_s"] = optimizer_s
        ranks.append(r)
    return planner.Profile.from_dict({"version": 1, "kind": "profile", "hosts": [{"name": "n0", "cpu_cores": 64}],
                                      "ranks": ranks})


def _stats(plan: planner.Plan, epoch: int, truth: Sequence[Curve], optimizer_s: float) -> list[planner.StepStats]:
    """What the step timers read: each rank's span over its micro-steps (k (t(m) - o) + o, as the plan prices it),
    the synchronous step the slowest of them."""
    comp = []
    for r in plan.ranks:
        micro = micro_batch_sizes(r.batch_size, r.accumulation_steps)
        comp.append(sum(truth[r.rank](m) - optimizer_s for m in micro) + optimizer_s)
    step = max(comp)
    return [planner.StepStats(rank=i, epoch=epoch, num_steps=40, batch_size=plan.ranks[i].batch_size, num_workers=0,
                              data_wait_s=0.0, compute_s=c, step_time_s=step, compute_s_std=0.02 * c)
            for i, c in enumerate(comp)]


def simulate(plan: planner.Plan, profile: planner.Profile, *, epochs: int = 10, optimizer_s: float = 0.0,
             ) -> tuple[list[float], list[ReplanDecision], list[planner.Plan]]:
    """(per epoch: measured step / the running plan's predicted step - 1; the decisions; the plans that ran)."""
    rp = Replanner(profile, plan)
    off, decisions, ran = [], [], []
    for epoch in range(epochs):
        truth = [_profiled] + [_cotenant if epoch >= CHANGE_EPOCH else _profiled] * (profile.world_size - 1)
        stats = _stats(rp.plan, epoch, truth, optimizer_s)
        ran.append(rp.plan)
        off.append(stats[0].step_time_s / rp.plan.predicted.step_time_s - 1.0)
        decisions.append(rp.decide(stats, epoch))
        assert decisions[-1].plan is rp.plan
    return off, decisions, ran


def _check_finishes(off: list[float], decisions: list[ReplanDecision], ran: list[planner.Plan], *,
                    follow_up: bool = True) -> None:
    """Adopted after the first slow epoch; the trial missed; corrected at once (a follow-up, or where the re-solve
    keeps the split, the prediction re-made); on its prediction from then on."""
    assert all(abs(x) < 0.02 for x in off[:CHANGE_EPOCH]), off
    first = decisions[CHANGE_EPOCH]
    assert first.adopted and not first.reverted, first.reason
    trial = CHANGE_EPOCH + 1
    assert abs(off[trial]) > 0.15, off  # the first move missed: the profile's curve could not express the change
    second = decisions[trial]
    if follow_up:
        assert second.adopted and "follow-up" in second.reason, second.reason
    else:
        assert second.repredicted is not None and "its prediction is now" in second.reason, second.reason
    # Within 2 epochs of the first adoption the step is within 5% of the prediction it runs under, and stays so.
    assert all(abs(x) <= PREDICTION_MISS for x in off[trial + 1:]), off
    assert not any(d.reverted for d in decisions), [d.reason for d in decisions]
    # Never slower than the first move's split, measured.
    assert ran[-1].predicted.step_time_s * (1 + off[-1]) <= ran[trial].predicted.step_time_s * (1 + off[trial])


def test_a_missed_correction_is_followed_up() -> None:
    profile = _profile()
    off, decisions, ran = simulate(planner.solve(profile, global_batch=512, min_batch=2), profile)
    _check_finishes(off, decisions, ran)
    # (One sample further than a uniform factor: rank 1's excess at 256 is spread by its curve's elasticity there.)
    assert ran[CHANGE_EPOCH + 1].batch_sizes == (381, 131)
    assert off[CHANGE_EPOCH + 1] == pytest.approx(0.203, abs=0.005)


def test_a_resumed_replanner_follows_up_the_same_way() -> None:
    # The trial's prediction is part of the checkpointed state: resumed between the adoption and its first epoch,
    # the Replanner judges the trial against the same number.
    profile = _profile()
    plan = planner.solve(profile, global_batch=512, min_batch=2)
    rp = Replanner(profile, plan)
    for epoch in range(CHANGE_EPOCH + 1):
        truth = [_profiled, _cotenant if epoch >= CHANGE_EPOCH else _profiled]
        rp.decide(_stats(rp.plan, epoch, truth, 0.0), epoch)
    again = Replanner(profile, plan)
    again.load_state_dict(json.loads(json.dumps(rp.state_dict())))
    nxt = _stats(rp.plan, CHANGE_EPOCH + 1, [_profiled, _cotenant], 0.0)
    a, b = rp.decide(nxt, CHANGE_EPOCH + 1), again.decide(nxt, CHANGE_EPOCH + 1)
    la, lb = a.to_log(), b.to_log()
    assert la.pop("plan")["ranks"] == lb.pop("plan")["ranks"]  # (the solver's own timing differs)
    assert a.adopted and "follow-up" in a.reason and la == lb


def test_a_missed_correction_is_followed_up_with_accumulation() -> None:
    # Both ranks capped at 256 samples: 1024 runs as micro-steps, and the co-tenant's rank runs fewer of them.
    # Before, the model read the span of k micro-steps as one step of the whole batch; its first move, [763, 261],
    # ran +17.8% over its prediction and only its misread second re-solve happened to land near the optimum.
    profile = _profile(cap=256, optimizer_s=0.002)
    plan = planner.solve(profile, global_batch=1024, min_batch=2)
    assert plan.accumulation_steps == (2, 2)
    off, decisions, ran = simulate(plan, profile, optimizer_s=0.002)
    _check_finishes(off, decisions, ran)
    assert ran[CHANGE_EPOCH + 1].accumulation_steps == (3, 2)  # the fast rank took a third micro-step
    assert ran[-1].accumulation_steps == (3, 1)


def test_a_missed_correction_is_corrected_under_fsdp() -> None:
    # One micro-step count for every rank: the co-tenant's rank runs 2 micro-batches of 60, below the profile's
    # floor, and measured 21% faster than predicted; the re-solve keeps the split, so its prediction is re-made.
    # Before: -24.0% off for good.
    profile = _profile(cap=280, optimizer_s=0.002)
    plan = planner.solve(profile, global_batch=640, min_batch=2, mode="fsdp")
    off, decisions, ran = simulate(plan, profile, optimizer_s=0.002)
    _check_finishes(off, decisions, ran, follow_up=False)
    assert all(p.mode == "fsdp" and len(set(p.accumulation_steps)) == 1 for p in ran)


def test_a_plan_without_micro_steps_is_judged_at_its_micro_batch() -> None:
    # Accumulation as the profile says: the model reads the measured span as k micro-steps, not one step of b.
    profile = _profile(cap=300, optimizer_s=0.002)
    plan = planner.solve(profile, global_batch=1024, min_batch=2)
    rp = Replanner(profile, plan)
    for epoch in range(4):
        d = rp.decide(_stats(rp.plan, epoch, [_profiled, _profiled], 0.002), epoch)
        assert not d.adopted and d.repredicted is None, d.reason
        assert d.predicted_compute_s == pytest.approx(d.measured_compute_s)
    assert rp.scale_factors == pytest.approx((1.0, 1.0))


def test_a_kept_plan_carries_the_prediction_the_model_now_makes() -> None:
    # A slowdown the split need not follow (both ranks 12% slower): nothing to gain, the prediction is re-made.
    profile = _profile()
    plan = planner.solve(profile, global_batch=512, min_batch=2)
    rp = Replanner(profile, plan)
    slow = [functools.partial(_scaled, 1.12)] * 2
    d = rp.decide(_stats(plan, 0, slow, 0.0), 0)
    assert not d.adopted and d.new_plan is None and d.repredicted is not None and d.plan is d.repredicted
    assert d.plan.fingerprint == plan.fingerprint and d.plan.batch_sizes == plan.batch_sizes
    assert "its prediction is now" in d.reason
    measured = _stats(plan, 1, slow, 0.0)[0].step_time_s
    # EMA smoothing (0.8): the ranks' curves go 80% of the way to the measured factor after one epoch, and the
    # exposed communication takes 80% of the step they still leave unexplained (runtime/replan/model.py).
    curves = plan.predicted.step_time_s * (1 + 0.8 * 0.12)
    assert d.plan.predicted.step_time_s == pytest.approx(curves + 0.8 * (measured - curves))
    assert abs(measured / d.plan.predicted.step_time_s - 1) < PREDICTION_MISS
    # Within the miss bar nothing is re-made: the plan the next epoch runs is the one this epoch ran.
    d2 = rp.decide(_stats(rp.plan, 1, slow, 0.0), 1)
    assert d2.repredicted is None and d2.plan is d.plan
    # Every rank takes the same plan from rank 0's wire form.
    again = ReplanDecision.from_wire(json.loads(json.dumps(d.to_wire())), plan)
    assert again.plan == d.plan


def test_noise_alone_is_never_followed_up() -> None:
    # The 2% jitter of a quiet machine never reads as a miss: no re-made prediction, no follow-up.
    profile = _profile()
    plan = planner.solve(profile, global_batch=512, min_batch=2)
    rng = np.random.default_rng(7)
    rp = Replanner(profile, plan)
    for epoch in range(12):
        jittered = functools.partial(_scaled, 1.0 + float(rng.normal(0, 0.02)))
        stats = _stats(rp.plan, epoch, [jittered] * 2, 0.0)
        d = rp.decide(stats, epoch)
        assert not d.adopted and d.repredicted is None, d.reason
