"""The correction model on its own: EMA factors, the two-point shape correction, loader costs, the profile."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from planner.loader import loader_costs_s
from planner.options import SolveOptions
from planner.profile import LoaderPoint, LoaderProfile, Profile
from planner.stats import StepStats
from runtime.replan.model import CorrectionModel, Observation
from tests.planner._profiles import linear_profile


def _profile() -> Profile:
    # t_i(b) = 0.01 + s_i * b, profiled at b = 16 and 256.
    return linear_profile([0.001, 0.003], fixed_s=0.01, loader_s=[0.0004, 0.0004])


def _epoch(model: CorrectionModel, times: dict[int, tuple[int, float]], *, smoothing: float = 1.0,
           wait_s: tuple[float, float] = (0.0, 0.0), workers: int = 2, rel_std: float = 0.02) -> CorrectionModel:
    """One epoch of 50 steps: rank i ran batch b at c seconds of compute, its steps' std ``rel_std`` x c (ranks
    not named ran as profiled at 64)."""
    stats = []
    for i in range(model.world_size):
        b, c = times.get(i, (64, model.envelopes[i](64)))
        stats.append(StepStats(rank=i, epoch=0, num_steps=50, batch_size=b, num_workers=workers,
                               data_wait_s=wait_s[i], compute_s=c, step_time_s=c + wait_s[i],
                               compute_s_std=rel_std * c))
    return model.updated(stats, smoothing=smoothing, loader_wait_frac=0.10)


def _spread(t0: Callable[[float], float], factor: float, anchor: float, b: float, slope: float) -> float:
    """The uniform correction of a factor measured at ``anchor`` on the linear curve t0 (runtime.replan.model):
    t0(b) + e (eps t0(b) / t0(A) + (1 - eps) b / A), e = (factor - 1) t0(A), eps = slope A / t0(A)."""
    e, eps = (factor - 1) * t0(anchor), slope * anchor / t0(anchor)
    return t0(b) + e * (eps * t0(b) / t0(anchor) + (1 - eps) * b / anchor)


def test_scale_factors_are_an_ema_from_one_and_the_model_is_never_mutated() -> None:
    m0 = CorrectionModel.of(_profile())
    t = m0.envelopes[1](128)
    m1 = _epoch(m0, {1: (128, 1.4 * t)}, smoothing=0.8)
    m2 = _epoch(m1, {1: (128, 1.4 * t)}, smoothing=0.8)
    assert m0.scale_factors == (1.0, 1.0)
    assert m1.scale_factors == pytest.approx((1.0, 1.32))
    assert m2.scale_factors == pytest.approx((1.0, 1 + 0.4 * (1 - 0.2**2)))  # 96% of the way after two epochs
    # One batch size seen: the factor is the ratio at it; elsewhere the excess is spread by the curve's elasticity
    # there (eps = 0.384 / 0.394 on this curve with a 10 ms fixed part, so nearly a uniform factor).
    assert m2.compute_s(1, 128) == pytest.approx(m2.scale_factors[1] * t)
    for b in (16, 500):
        assert m2.compute_s(1, b) == pytest.approx(_spread(m0.envelopes[1], m2.scale_factors[1], 128, b, 0.003))
        assert abs(m2.ratio(1, b) / m2.scale_factors[1] - 1) < 0.01


def test_a_device_change_replaces_the_factor_and_the_old_shape() -> None:
    """A rank measured 3x its model with a quiet epoch: its device changed (a slowdown, a co-tenant), so the factor
    is the measured one at once, not 80% of the way there, and what two batch sizes showed before is dropped."""
    m = CorrectionModel.of(_profile())
    t = m.envelopes[1]
    m = _epoch(_epoch(m, {1: (64, 1.1 * t(64))}, smoothing=0.8), {1: (128, 1.1 * t(128))}, smoothing=0.8)
    assert len(m.ranks[1].observations) == 2  # the shape correction in force
    after = _epoch(m, {1: (96, 3.0 * t(96))}, smoothing=0.8)
    assert after.scale_factors[1] == pytest.approx(3.0)
    assert after.ranks[1].observations == (Observation(batch_size=96, ratio=pytest.approx(3.0)),)
    # The uniform correction again (anchored at 96) until a second batch size is measured.
    assert after.compute_s(1, 200) == pytest.approx(_spread(t, 3.0, 96, 200, 0.003))
    back = _epoch(after, {1: (96, 1.0 * t(96))}, smoothing=0.8)  # and it leaves
    assert back.scale_factors[1] == pytest.approx(1.0)
    # The same 3x within a noisy epoch (steps' std 1.5x their mean over 50 steps: a 21% standard error) is no
    # evidence of a change beyond the smoothing: 80% of the way.
    noisy = _epoch(CorrectionModel.of(_profile()), {1: (96, 3.0 * t(96))}, smoothing=0.8, rel_std=1.5)
    assert noisy.scale_factors[1] == pytest.approx(2.6)
    # Under 1.5x is never a change, however quiet the epoch.
    small = _epoch(CorrectionModel.of(_profile()), {1: (96, 1.45 * t(96))}, smoothing=0.8, rel_std=0.0)
    assert small.scale_factors[1] == pytest.approx(1 + 0.8 * 0.45)


def test_a_measurement_the_shape_correction_predicts_is_no_device_change() -> None:
    """A rank truly steeper than profiled: 1.0x at batch 16, 1.9x at 256, so its factor is 1.9 (smoothing 1.0).
    Measured at 16 again at 1.0x, it is 1.9x off the uniform factor but exactly what the shape correction in force
    says: the shape stays, nothing changed."""
    m = CorrectionModel.of(_profile())
    t = m.envelopes[1]
    m = _epoch(_epoch(m, {1: (16, 1.0 * t(16))}), {1: (256, 1.9 * t(256))})
    assert m.scale_factors[1] == pytest.approx(1.9) and len(m.ranks[1].observations) == 2
    again = _epoch(m, {1: (16, 1.0 * t(16))})
    assert [o.batch_size for o in again.ranks[1].observations] == [256, 16]  # both kept: the shape holds
    assert again.compute_s(1, 16) == pytest.approx(t(16)) and again.compute_s(1, 256) == pytest.approx(1.9 * t(256))


@pytest.mark.parametrize(("alpha", "beta"), [(1.5, -0.01), (0.5, 0.02)])  # truly steeper / truly flatter
def test_two_measurements_correct_the_shape(alpha: float, beta: float) -> None:
    m = CorrectionModel.of(_profile())
    t0 = m.envelopes[1]

    def true(b: float) -> float:
        return alpha * t0(b) + beta

    m = _epoch(_epoch(m, {1: (64, true(64))}), {1: (128, true(128))})
    assert m.ranks[1].observations == (Observation(batch_size=64, ratio=true(64) / t0(64)),
                                      Observation(batch_size=128, ratio=true(128) / t0(128)))
    # Through both measurements and exact between them (the true curve is an affine map of the profiled one).
    for b in (64, 96, 128):
        assert m.compute_s(1, b) == pytest.approx(true(b))
    r1, r2 = true(64) / t0(64), true(128) / t0(128)
    if beta <= 0:  # steeper: the map holds above b1, the ratio at b1 below it
        assert m.compute_s(1, 256) == pytest.approx(true(256))
        assert m.compute_s(1, 16) == pytest.approx(r1 * t0(16))
    else:  # flatter: the map holds below b2, the ratio at b2 above it
        assert m.compute_s(1, 16) == pytest.approx(true(16))
        assert m.compute_s(1, 256) == pytest.approx(r2 * t0(256))
    # The corrected profile's points follow the same map (rank 0, measured as profiled, is left as it was).
    points = {p.batch_size: p.step_time_s for p in m.corrected_profile().rank(1).compute}
    assert points == pytest.approx({b: m.compute_s(1, b) for b in (16, 256)})
    assert m.corrected_profile().rank(0).compute == _profile().rank(0).compute


def test_ratios_more_than_2x_apart_mean_a_changed_device() -> None:
    m = CorrectionModel.of(_profile())
    t0 = m.envelopes[1]
    m = _epoch(_epoch(m, {1: (64, t0(64))}), {1: (128, 2.5 * t0(128))})
    # The uniform correction from the newest epoch (2.5x at 128), not a shape.
    for b in (16, 256):
        assert m.compute_s(1, b) == pytest.approx(_spread(t0, 2.5, 128, b, 0.003))


def test_a_batch_size_measured_far_off_its_last_time_clears_the_history() -> None:
    m = CorrectionModel.of(_profile())
    t0 = m.envelopes[1]
    m = _epoch(_epoch(m, {1: (64, 1.2 * t0(64))}), {1: (128, 1.3 * t0(128))})
    near = _epoch(m, {1: (128, 1.4 * t0(128))})  # within 10% of 1.3: the newest replaces the old at 128
    assert [o.batch_size for o in near.ranks[1].observations] == [64, 128]
    assert [o.ratio for o in near.ranks[1].observations] == pytest.approx([1.2, 1.4])
    far = _epoch(m, {1: (128, 1.6 * t0(128))})  # 23% off: the device changed, what it showed before is dropped
    assert [o.batch_size for o in far.ranks[1].observations] == [128]
    assert far.ranks[1].observations[0].ratio == pytest.approx(1.6)
    third = _epoch(m, {1: (256, 1.35 * t0(256))})  # a third batch size pushes out the oldest
    assert [o.batch_size for o in third.ranks[1].observations] == [128, 256]


def test_loader_cost_is_only_ever_raised() -> None:
    m = CorrectionModel.of(_profile())
    b, c = 64, m.envelopes[0](64)
    # Rank 0 waits as long for data as it computes, with 2 workers: p = (c + d) * w / b.
    m1 = _epoch(m, {0: (b, c)}, wait_s=(c, 0.0))
    assert m1.loader_sec_per_sample == pytest.approx((2 * c * 2 / b, 0.0004))
    # A loader that keeps up, or waits less, is no evidence that it got faster.
    assert _epoch(m1, {0: (b, c)}).loader_sec_per_sample == m1.loader_sec_per_sample
    assert _epoch(m1, {0: (b, c)}, wait_s=(0.5 * c, 0.0)).loader_sec_per_sample == m1.loader_sec_per_sample
    # A wait under 10% of the step is not counted; without workers the loop loaded the data itself: p = d / b.
    assert _epoch(m, {0: (b, c)}, wait_s=(0.05 * c, 0.0)).loader_sec_per_sample == (0.0004, 0.0004)
    assert _epoch(m, {0: (b, c)}, wait_s=(c, 0.0), workers=0).loader_sec_per_sample[0] == pytest.approx(c / b)


def test_the_corrected_profile_changes_only_times_and_loader_costs() -> None:
    base = _profile()
    capped = replace(base.rank(0), loader=LoaderProfile(
        sec_per_sample=0.0004, scaling=(LoaderPoint(num_workers=1, samples_per_s=2500.0),), max_workers=3))
    base = replace(base, ranks=(capped, base.rank(1)), meta={"note": "kept"})
    m = CorrectionModel.of(base)
    assert m.corrected_profile() == base  # nothing measured: the profile as it is
    c = m.envelopes[0](64)
    m = _epoch(m, {0: (64, 2 * c)}, wait_s=(2 * c, 0.0))
    out = m.corrected_profile()
    assert out.hosts == base.hosts and out.meta == base.meta and out.model == base.model
    loader = out.rank(0).loader
    # The model started from the planner's cost (1 / 2500 s from the scaling run, not sec_per_sample) and the
    # whole loader profile is scaled by what training showed, so the planner now models the measured cost.
    assert m.loader_costs_s[0] == pytest.approx(1 / 2500)
    factor = m.loader_sec_per_sample[0] / m.loader_costs_s[0]
    assert loader is not None and factor > 1 and loader.sec_per_sample == pytest.approx(0.0004 * factor)
    assert loader.scaling[0].samples_per_s == pytest.approx(2500.0 / factor) and loader.max_workers == 3
    assert loader_costs_s(out, SolveOptions())[0] == pytest.approx(m.loader_sec_per_sample[0])
    assert out.rank(1).loader == base.rank(1).loader
    # Rank 0 measured 2x at 64 on 10 ms + 1 ms a sample: its points take the uniform correction anchored there.
    assert [p.step_time_s for p in out.rank(0).compute] == pytest.approx(
        [_spread(m.envelopes[0], 2.0, 64, p.batch_size, 0.001) for p in capped.compute])


def _handed(profile: Profile, bytes_per_s: float = 4e9, sample_bytes: int = 600_000) -> Profile:
    """``profile`` with every rank's hand-over measured: ``sample_bytes`` a sample pinned at ``bytes_per_s``."""
    return replace(profile, ranks=tuple(replace(r, loader=replace(r.loader, sample_bytes=sample_bytes,
                                                                  handover_bytes_per_s=bytes_per_s))
                                        for r in profile.ranks))


def _waited(model: CorrectionModel, *, period_s: float, wait_s: float, b: int = 64) -> CorrectionModel:
    """One epoch where rank 0 computed on profile, waited ``wait_s`` a step for data, and its 2 workers timed their
    own batches at ``period_s`` a step (rank 1 as profiled)."""
    c = model.envelopes[0](b)
    stats = [StepStats(rank=0, epoch=0, num_steps=50, batch_size=b, num_workers=2, data_wait_s=wait_s, compute_s=c,
                       step_time_s=c + wait_s, loader_s=2 * period_s),
             StepStats(rank=1, epoch=0, num_steps=50, batch_size=b, num_workers=2, data_wait_s=0.0,
                       compute_s=model.envelopes[1](b), step_time_s=c + wait_s, loader_s=0.0256)]
    return model.updated(stats, smoothing=1.0, loader_wait_frac=0.10)


def test_a_wait_while_the_workers_kept_up_raises_the_hand_over_not_the_workers() -> None:
    """Measured on 2x H100: rank 0's workers built a batch every 114-120 ms while it stepped every 143-157 ms,
    waiting for data; charged to the workers, that wait made every split look loader-bound."""
    m = CorrectionModel.of(_handed(_profile()))
    assert [r.handover_s for r in m.ranks] == pytest.approx([600_000 / 4e9] * 2)
    c = m.envelopes[0](64)
    kept = _waited(m, period_s=0.5 * c, wait_s=c)  # the workers need half the step; the rank waits a whole compute
    step = 2 * c
    assert kept.ranks[0].handover_s == pytest.approx(step / 64)  # one batch handed over per step
    assert kept.ranks[0].loader_sec_per_sample == pytest.approx(2 * 0.5 * c / 64)  # as the workers timed it
    assert kept.ranks[1] == replace(m.ranks[1], scale=kept.ranks[1].scale, loader_sec_per_sample=0.0004,
                                    observations=kept.ranks[1].observations)
    handed = kept.corrected_profile().rank(0).loader
    assert handed is not None and handed.handover_bytes_per_s == pytest.approx(600_000 * 64 / step)
    # Only raised, as the loader's cost: a rank that stops waiting shows nothing of the hand-over's rate.
    assert _waited(kept, period_s=0.5 * c, wait_s=0.0).ranks[0].handover_s == kept.ranks[0].handover_s
    # Workers that did not keep up are the wait's cause, as before: their cost is raised, the hand-over kept.
    slow = _waited(m, period_s=0.95 * 2 * c, wait_s=c)
    assert slow.ranks[0].handover_s == m.ranks[0].handover_s
    assert slow.ranks[0].loader_sec_per_sample == pytest.approx(2 * c * 2 / 64)
    # Without a hand-over reading in the profile there is nothing to raise: the workers are charged, as before.
    plain = _waited(CorrectionModel.of(_profile()), period_s=0.5 * c, wait_s=c)
    assert plain.ranks[0].handover_s == 0 and plain.ranks[0].loader_sec_per_sample == pytest.approx(2 * c * 2 / 64)
