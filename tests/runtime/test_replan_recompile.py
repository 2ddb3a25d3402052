"""Recompile charging: a re-plan that makes a compiled model recompile must save more than the recompile over the
epochs left; compile steps are kept apart from the step time in the epoch's stats."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

import planner
from planner.curves import fit_envelope
from runtime.replan import Replanner
from runtime.replan.policy import recompile_charge
from runtime.timing import StepTimer

# Recorded on one H200 (torch 2.11, bf16): GPT-2 small compiled ran 46 ms a step, a new batch size recompiled in 55 s.
STEP_S = 0.046
RECOMPILE_S = 55.0


def _profile() -> planner.Profile:
    return planner.Profile.load(Path(planner.__file__).parent / "examples" / "minimal_profile.json")


def _stats(profile: planner.Profile, plan: planner.Plan, epoch: int, *, slow: tuple[float, ...] = (1.0, 3.0),
           compile_s: tuple[float, ...] = (0.0, 0.0)) -> list[planner.StepStats]:
    out = []
    for r, rp in zip(plan.ranks, profile.by_rank, strict=True):
        c = slow[r.rank] * fit_envelope(rp.compute)(r.batch_size)
        out.append(planner.StepStats(
            rank=r.rank, epoch=epoch, num_steps=50, batch_size=r.batch_size, num_workers=r.num_workers,
            data_wait_s=0.0, compute_s=c, step_time_s=c + 0.002, compute_s_std=0.02 * c,
            compile_steps=int(compile_s[r.rank] > 0), compile_s=compile_s[r.rank]))
    return out


def test_recorded_recompile_outweighs_a_small_gain_over_a_short_run() -> None:
    t_new = STEP_S / 1.03  # a 3% gain
    short = recompile_charge(recompile_s=[None, RECOMPILE_S], compiled=[frozenset({16}), frozenset({16})],
                             candidate_micro=[[16], [15]], t_old_s=STEP_S, t_new_s=t_new, steps_per_epoch=100,
                             epochs_left=2)
    assert short.charge_s == RECOMPILE_S and short.ranks == (1,) and short.sizes == (15,)
    assert short.saved_s == pytest.approx((STEP_S - t_new) * 100 * 2)  # 0.27 s
    assert not short.worth
    # 200 epochs save 26.8 s: still under 55 s.  500 save 67 s: worth it.
    assert not replace(short, saved_s=(STEP_S - t_new) * 100 * 200).worth
    long = recompile_charge(recompile_s=[None, RECOMPILE_S], compiled=[frozenset({16}), frozenset({16})],
                            candidate_micro=[[16], [15]], t_old_s=STEP_S, t_new_s=t_new, steps_per_epoch=100,
                            epochs_left=500)
    assert long.worth and long.saved_s == pytest.approx(67.0, rel=0.01)
    assert "recompiling 55 s (rank 1 to 15)" in long.describe() and "500 epochs left" in long.describe()


def test_ranks_recompile_in_parallel_and_a_size_already_run_costs_nothing() -> None:
    both = recompile_charge(recompile_s=[40.0, 55.0], compiled=[frozenset({16}), frozenset({16})],
                            candidate_micro=[[20], [12]], t_old_s=0.05, t_new_s=0.04, steps_per_epoch=10,
                            epochs_left=1)
    assert both.charge_s == 55.0 and both.ranks == (0, 1)  # the slowest compile gates the step, not the sum
    back = recompile_charge(recompile_s=[40.0, 55.0], compiled=[frozenset({16, 20}), frozenset({12, 16})],
                            candidate_micro=[[20], [12]], t_old_s=0.05, t_new_s=0.049, steps_per_epoch=1,
                            epochs_left=1)
    assert back.charge_s == 0.0 and back.worth
    unknown = recompile_charge(recompile_s=[None, None], compiled=[frozenset({16})] * 2, candidate_micro=[[20], [12]],
                               t_old_s=0.05, t_new_s=0.049, steps_per_epoch=1, epochs_left=None)
    assert unknown.charge_s == 0.0 and unknown.worth  # no recompile time measured: no charge


def test_replanner_keeps_the_plan_when_the_recompile_costs_more_than_the_gain_saves() -> None:
    profile = _profile()
    plan = planner.solve(profile, global_batch=512)
    free = Replanner(profile, plan, smoothing=0.5).decide(_stats(profile, plan, 0), epoch=0)
    assert free.adopted  # without a recompile time: the move is made (rank 1 runs 3x slower)

    short = Replanner(profile, plan, smoothing=0.5, recompile_s=RECOMPILE_S, epochs=3, steps_per_epoch=100)
    d = short.decide(_stats(profile, plan, 0), epoch=0)
    assert not d.adopted and short.plan.fingerprint == plan.fingerprint
    assert d.predicted_gain == pytest.approx(free.predicted_gain)
    assert "recompiling 55 s (rank 0 to" in d.reason and "over the 2 epochs left of 100 steps" in d.reason
    assert "the recompile costs more than the gain saves" in d.reason

    long = Replanner(profile, plan, smoothing=0.5, recompile_s=RECOMPILE_S, epochs=100_000, steps_per_epoch=100)
    d = long.decide(_stats(profile, plan, 0), epoch=0)
    assert d.adopted and d.new_plan is not None
    assert d.new_plan.batch_sizes == free.new_plan.batch_sizes  # type: ignore[union-attr]
    assert "recompiling 55 s" in d.reason and "99999 epochs left" in d.reason


def _with_compile(profile: planner.Profile, **record: object) -> planner.Profile:
    """The profile with each rank's compile record (ranks[i].meta.compile, as `planner profile --compile` writes)."""
    base = {"mode": "default", "backend": "inductor", "dynamic": "batch", "first_s": RECOMPILE_S, "recompile_s": 0.0,
            "recompiles": 0, "sizes": [], "recompiled_sizes": []}
    ranks = tuple(replace(r, meta={**r.meta, "compile": {**base, **record}}) for r in profile.ranks)
    return replace(profile, ranks=ranks)


def test_sizes_the_profile_compiled_are_not_charged() -> None:
    profile = _profile()
    plan = planner.solve(profile, global_batch=512)
    free = Replanner(profile, plan, smoothing=0.5).decide(_stats(profile, plan, 0), epoch=0)
    assert free.new_plan is not None
    sizes = sorted({*free.new_plan.batch_sizes, *plan.batch_sizes})
    # Static shapes (dynamic not "batch"): a new size costs a compile, but these sizes were all compiled.
    compiled = _with_compile(profile, dynamic=None, recompile_s=RECOMPILE_S, sizes=sizes, recompiled_sizes=sizes[1:])
    rp = Replanner(compiled, plan, smoothing=0.5, epochs=3, steps_per_epoch=100)
    assert rp.recompile_s == (RECOMPILE_S, RECOMPILE_S)
    assert all(set(sizes) <= c for c in rp.compiled_sizes)
    d = rp.decide(_stats(compiled, plan, 0), epoch=0)
    assert d.adopted, d.reason
    assert "recompiling" not in d.reason


def test_a_static_record_charges_a_size_not_run_and_a_dynamic_one_does_not() -> None:
    profile = _profile()
    plan = planner.solve(profile, global_batch=512)
    ran = sorted(set(plan.batch_sizes))  # the profile compiled only the sizes the plan runs
    # Static shapes, one size profiled: no later size measured a recompile, so a new size costs first_s.
    static = _with_compile(profile, dynamic=None, first_s=RECOMPILE_S, recompile_s=0.0, sizes=ran[:1])
    rp = Replanner(static, plan, smoothing=0.5, epochs=3, steps_per_epoch=100)
    assert rp.recompile_s == (RECOMPILE_S, RECOMPILE_S)
    d = rp.decide(_stats(static, plan, 0), epoch=0)
    assert not d.adopted and "recompiling 55 s" in d.reason, d.reason
    # The batch dimension dynamic: the one graph serves every size, recompile_s 0.0 is charged (nothing).
    dynamic = _with_compile(profile, sizes=ran)
    rp = Replanner(dynamic, plan, smoothing=0.5, epochs=3, steps_per_epoch=100)
    assert rp.recompile_s == (0.0, 0.0)
    d = rp.decide(_stats(dynamic, plan, 0), epoch=0)
    assert d.adopted, d.reason
    # A profile without records charges nothing and remembers only the plan's sizes.
    plain = Replanner(profile, plan, smoothing=0.5)
    assert plain.recompile_s == (None, None)


def test_a_measured_recompile_replaces_the_given_one_and_the_state_keeps_it() -> None:
    profile = _profile()
    plan = planner.solve(profile, global_batch=512)
    rp = Replanner(profile, plan, smoothing=0.5, recompile_s=RECOMPILE_S, epochs=100_000, steps_per_epoch=100)
    d = rp.decide(_stats(profile, plan, 0, compile_s=(30.0, 30.0)), epoch=0)  # epoch 0's first compile: not a re-
    assert d.adopted and rp.recompile_s == (RECOMPILE_S, RECOMPILE_S)
    new = rp.plan
    rp.decide(_stats(profile, new, 1, compile_s=(70.0, 0.0)), epoch=1)  # rank 0 recompiled at its new size in 70 s
    assert rp.recompile_s == (70.0, RECOMPILE_S)
    assert all(set(r.micro_batches) <= c for r, c in zip(new.ranks, rp.compiled_sizes, strict=True))

    again = Replanner(profile, plan, smoothing=0.5)
    again.load_state_dict(rp.state_dict())
    assert again.recompile_s == rp.recompile_s and again.compiled_sizes == rp.compiled_sizes
    older = {k: v for k, v in rp.state_dict().items() if k not in ("recompile_s", "compiled_sizes")}
    fresh = Replanner(profile, plan, smoothing=0.5)
    fresh.load_state_dict(older)  # a state written before compile charging loads
    assert fresh.recompile_s == (None, None)
    replay = Replanner.from_description(rp.describe(), plan)
    assert (replay.epochs, replay.steps_per_epoch) == (100_000, 100)


def test_replanner_refuses_a_bad_recompile_time() -> None:
    profile = _profile()
    plan = planner.solve(profile, global_batch=512)
    with pytest.raises(planner.ValidationError, match=r"recompile_s must be seconds >= 0.*one per rank \(2\)"):
        Replanner(profile, plan, recompile_s=[1.0, 2.0, 3.0])
    with pytest.raises(planner.ValidationError, match="replan epochs must be an integer >= 1"):
        Replanner(profile, plan, epochs=0)


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _step(timer: StepTimer, clock: _Clock, compute: float) -> None:
    timer.data_start()
    clock.t += 0.001
    timer.data_end()
    timer.compute_start()
    clock.t += compute
    timer.compute_end()
    clock.t += 0.004
    timer.step_end()


def test_a_recompile_step_is_counted_as_compile_not_as_a_slow_rank() -> None:
    clock = _Clock()
    timer = StepTimer("cpu", clock=clock, warmup_steps=2)
    for i in range(40):  # the first step after a re-plan recompiled (8 s), the rest ran 40-42 ms
        _step(timer, clock, 8.0 if i == 3 else 0.040 + 0.002 * (i % 2))
    s = timer.epoch_summary(rank=1, epoch=4, batch_size=15, num_workers=0)
    assert (s.compile_steps, s.num_outliers, s.num_steps) == (1, 0, 37)
    assert s.compile_s == pytest.approx(8.005 - 0.045, abs=1e-6)  # beyond the median step (5 ms + 40 ms)
    assert s.step_time_s == pytest.approx(0.046, abs=1e-3) and s.compute_s == pytest.approx(0.041, abs=1e-3)
    again = planner.StepStats.from_dict(s.to_dict())
    assert again == s
    older = {k: v for k, v in s.to_dict().items() if k not in ("compile_steps", "compile_s")}
    assert planner.StepStats.from_dict(older).compile_s == 0.0


def test_a_short_stall_is_an_outlier_not_a_compile() -> None:
    clock = _Clock()
    timer = StepTimer("cpu", clock=clock, warmup_steps=0)
    for i in range(40):  # 0.3 s: far off the median, under COMPILE_MIN_S
        _step(timer, clock, 0.3 if i == 10 else 0.010)
    s = timer.epoch_summary(rank=0, epoch=0, batch_size=8, num_workers=0)
    assert (s.compile_steps, s.compile_s) == (0, 0.0)
