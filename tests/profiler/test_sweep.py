"""The sweep policy with injected timings: no clock, no torch, deterministic."""

from __future__ import annotations

import pytest

from planner.curves import fit_envelope
from planner.errors import ValidationError
from profiler.memory import find_max_batch
from profiler.sweep import (
    DoesNotFit,
    Measurement,
    SweepOptions,
    SweepPoint,
    SweepResult,
    geometric_batches,
    parse_batch_sizes,
    repeats_for,
    run_sweep,
    search_max_batch,
    suspects,
)


class FakeDevice:
    """t(b) = max(flat_s, per_sample_s * b); batches above max_fit raise DoesNotFit; a fake clock advances by
    every step it runs (warm-up included), so budgets are exercised without real time."""

    def __init__(self, *, flat_s: float = 0.010, per_sample_s: float = 0.0002, max_fit: int = 10**9,
                 spikes: dict[int, list[list[float]]] | None = None) -> None:
        self.flat_s, self.per_sample_s, self.max_fit = flat_s, per_sample_s, max_fit
        self.now = 0.0
        self.calls: list[tuple[int, int, int]] = []
        self.spikes = spikes or {}

    def t(self, b: int) -> float:
        return max(self.flat_s, self.per_sample_s * b)

    def clock(self) -> float:
        return self.now

    def measure(self, b: int, warmup: int, repeats: int) -> Measurement:
        self.calls.append((b, warmup, repeats))
        if b > self.max_fit:
            raise DoesNotFit(b)
        # Queued spiked timings replace the next calls' times for b (interference from another process).
        queue = self.spikes.get(b)
        times = queue.pop(0) if queue else [self.t(b)] * repeats
        self.now += self.t(b) * warmup + sum(times)
        return Measurement(times_s=tuple(times), peak_bytes=1000 + 10 * b)


def test_geometric_and_parse() -> None:
    assert geometric_batches(8, 100) == [8, 16, 32, 64]
    assert geometric_batches(3, 30, growth=3) == [3, 9, 27]
    assert parse_batch_sizes("auto") is None
    assert parse_batch_sizes(None) is None
    assert parse_batch_sizes("64, 8,16,16") == (8, 16, 64)
    with pytest.raises(ValidationError, match="comma-separated"):
        parse_batch_sizes("8,sixteen")
    with pytest.raises(ValidationError, match="positive"):
        parse_batch_sizes("0,8")


def test_repeats_follow_the_point_budget() -> None:
    opts = SweepOptions(point_budget_s=1.0, min_repeats=3, max_repeats=15)
    assert repeats_for(0.001, opts) == 15  # cheap steps: as many as allowed
    assert repeats_for(0.2, opts) == 5  # 1 s / 0.2 s
    assert repeats_for(5.0, opts) == 3  # slow steps: the minimum


def test_auto_sweep_runs_the_series_and_hands_medians_to_the_fit() -> None:
    dev = FakeDevice()
    opts = SweepOptions.thorough(max_batch=256, total_budget_s=1e9, midpoints=False)
    res = run_sweep(dev.measure, opts, clock=dev.clock)
    assert [p.batch_size for p in res.points] == [8, 16, 32, 64, 128, 256]
    assert res.stop_reason == "series end" and res.oom_batch is None
    # Each batch: one warm-up+probe call, then the remaining repeats without warm-up.
    assert dev.calls[0] == (8, opts.warmup, 1) and dev.calls[1] == (8, 0, opts.max_repeats - 1)
    pts = res.compute_points()
    assert [p.step_time_s for p in pts] == [pytest.approx(dev.t(b)) for b in (8, 16, 32, 64, 128, 256)]
    # The planner's envelope reproduces a flat-then-linear device exactly from these points.
    env = fit_envelope(pts)
    assert env(200) == pytest.approx(dev.t(200))
    assert res.fit_residual() == pytest.approx(0.0, abs=1e-9)
    assert [m.peak_bytes for m in res.memory_points()] == [1000 + 10 * b for b in (8, 16, 32, 64, 128, 256)]


def test_stops_at_the_first_batch_that_does_not_fit() -> None:
    dev = FakeDevice(max_fit=100)
    res = run_sweep(dev.measure, SweepOptions(max_batch=1024, total_budget_s=1e9, midpoints=False), clock=dev.clock)
    assert [p.batch_size for p in res.points] == [8, 16, 32, 64]
    assert res.stop_reason == "does not fit" and res.oom_batch == 128
    # Bisection between 64 (ran) and 128 (failed) lands within 5% below the true limit.
    probes: list[int] = []

    def fits(b: int) -> bool:
        probes.append(b)
        return b <= dev.max_fit

    best = find_max_batch(res, fits)
    assert best is not None and 95 <= best <= 100
    assert len(probes) <= 6


def test_stops_when_a_step_exceeds_the_limit() -> None:
    dev = FakeDevice(per_sample_s=0.01)  # 0.01 s per sample: b=256 -> 2.56 s
    res = run_sweep(dev.measure, SweepOptions.thorough(step_limit_s=2.0, total_budget_s=1e9), clock=dev.clock)
    assert res.points[-1].batch_size == 256 and res.stop_reason == "step limit"


def test_slow_device_gets_smaller_batches_for_min_points() -> None:
    dev = FakeDevice(flat_s=0.0, per_sample_s=0.5)  # 4 s at the first batch (8)
    res = run_sweep(dev.measure, SweepOptions(step_limit_s=2.0, min_points=3), clock=dev.clock)
    assert [p.batch_size for p in res.points] == [2, 4, 8] and res.stop_reason == "step limit"
    assert fit_envelope(res.compute_points())(16) == pytest.approx(8.0)
    bn = run_sweep(dev.measure, SweepOptions(step_limit_s=2.0, min_points=3, min_batch=4), clock=dev.clock)
    assert [p.batch_size for p in bn.points] == [4, 8]  # never below min_batch, even short of min_points


def test_time_budget_stops_growth_but_keeps_min_points() -> None:
    dev = FakeDevice(flat_s=0.5, per_sample_s=0.05)  # already slow: every point costs seconds
    opts = SweepOptions(total_budget_s=5.0, step_limit_s=1e9, min_points=3, min_repeats=3, midpoints=False)
    res = run_sweep(dev.measure, opts, clock=dev.clock)
    assert len(res.points) == 3 and res.stop_reason == "time budget"
    # The next point (predicted linear in b) would have overrun the budget, so it was never started.
    assert max(b for b, _, _ in dev.calls) == 32


def test_explicit_batches_ignore_limits_but_not_memory() -> None:
    dev = FakeDevice(per_sample_s=0.01, max_fit=300)
    opts = SweepOptions(batch_sizes=(16, 200, 400), step_limit_s=0.1, total_budget_s=1e9)
    res = run_sweep(dev.measure, opts, clock=dev.clock)
    assert [p.batch_size for p in res.points] == [16, 200] and res.oom_batch == 400


def test_interference_spike_is_remeasured_and_the_lower_median_kept() -> None:
    # Both measurements of b=32 in the sweep (probe + repeats) are slowed 10x; the re-measurement is clean.
    dev = FakeDevice(flat_s=0.0, per_sample_s=0.001, spikes={32: [[0.32], [0.32, 0.32]]})
    opts = SweepOptions.thorough(max_batch=128, total_budget_s=1e9, min_repeats=3, max_repeats=3)
    res = run_sweep(dev.measure, opts, clock=dev.clock)
    assert {p.batch_size: p.median_s for p in res.points}[32] == pytest.approx(0.032)
    assert [c for c in dev.calls if c[0] == 32][-1] == (32, opts.warmup, 3)  # one re-measurement, warmed up


def test_suspects_are_bumps_and_inversions_only() -> None:
    def pts(times: list[float]) -> list[SweepPoint]:
        return [SweepPoint(batch_size=b, times_s=(t,)) for b, t in zip((8, 16, 32, 64, 128), times, strict=True)]

    assert suspects(pts([0.008, 0.016, 0.032, 0.064, 0.128]), 0.25) == []  # linear: clean
    assert suspects(pts([0.010, 0.010, 0.010, 0.020, 0.040]), 0.25) == []  # flat then linear: convex, clean
    assert suspects(pts([0.008, 0.016, 0.300, 0.064, 0.128]), 0.25) == [2]  # bump
    assert suspects(pts([0.008, 0.050, 0.032, 0.064, 0.128]), 0.25) == [1]  # slower than the next batch


def test_search_max_batch_and_empty_cases() -> None:
    assert search_max_batch(lambda b: b <= 1000, 512, 1024, rel_tol=0.01, max_probes=20) in range(995, 1001)
    res = SweepResult(points=(), stop_reason="does not fit", oom_batch=8)
    assert find_max_batch(res, lambda b: b <= 5) == 5
    assert find_max_batch(res, lambda b: False) is None
    clean = SweepResult(points=(SweepPoint(batch_size=8, times_s=(0.1,)),), stop_reason="series end")
    assert find_max_batch(clean, lambda b: True) is None


def test_options_are_validated() -> None:
    with pytest.raises(ValidationError):
        SweepOptions(batch_sizes=())
    with pytest.raises(ValidationError):
        SweepOptions(min_repeats=5, max_repeats=2)
    assert SweepOptions.quick(max_batch=64).max_batch == 64


def test_a_planned_global_batch_caps_the_series_and_ends_it() -> None:
    """A run that plans for global batch B (train --auto, bench, the adapters) sweeps no batch above B and
    measures B itself; a cap below the series' start moves the start down so min_points still fit."""
    from profiler.run import sweep_options

    def series(opts: SweepOptions) -> list[int]:
        return geometric_batches(opts.start_batch, opts.max_batch, opts.growth, midpoints=opts.midpoints,
                                 end_at_stop=opts.end_at_max)

    assert series(sweep_options(True, None, None, max_batch=64)) == [8, 16, 32, 64]
    assert series(sweep_options(True, None, None, max_batch=100)) == [8, 16, 32, 64, 100]
    assert series(sweep_options(True, None, None, max_batch=70)) == [8, 16, 32, 70]  # 64 -> 70: too close to keep
    assert series(sweep_options(True, None, None, max_batch=20)) == [5, 10, 20]
    assert series(sweep_options(True, None, None, min_batch=2, max_batch=4)) == [2, 4]
    assert series(sweep_options(False, None, None, max_batch=100)) == [8, 12, 16, 24, 32, 48, 64, 100]
    assert sweep_options(True, None, None, max_batch=10**6) == SweepOptions.quick()  # above the sweep's own limit
    assert sweep_options(True, [8, 300], None, max_batch=64).batch_sizes == (8, 300)  # explicit batches are kept
    dev = FakeDevice()
    result = run_sweep(dev.measure, sweep_options(True, None, None, max_batch=100), clock=dev.clock)
    assert [p.batch_size for p in result.points] == [8, 16, 32, 64, 100]
    assert max(b for b, _, _ in dev.calls) == 100


def test_default_series_has_midpoints_quick_does_not() -> None:
    from profiler.sweep import geometric_batches

    assert geometric_batches(8, 100, midpoints=True) == [8, 12, 16, 24, 32, 48, 64, 96]
    assert geometric_batches(8, 100) == [8, 16, 32, 64]
    assert SweepOptions().midpoints and not SweepOptions.quick().midpoints


def test_budget_stop_on_a_flat_curve_jumps_until_it_bends() -> None:
    # A GPU whose steps are latency-bound (15 ms) up to b=150; the budget ran out at b=32 (warm-ups for new
    # shapes are what cost). A curve of 8..32 alone would say nothing about b=476.
    dev = FakeDevice(flat_s=0.015, per_sample_s=0.0001)
    opts = SweepOptions(total_budget_s=0.5, step_limit_s=1e9, min_points=3, midpoints=False, warmup=2, min_repeats=3)
    res = run_sweep(dev.measure, opts, clock=dev.clock)
    sizes = [p.batch_size for p in res.points]
    assert sizes[:3] == [8, 16, 32]
    assert sizes[3:] == [128, 512]  # 4x while flat; 128..512 is proportional enough to pin the slope

    # The H100 case: a 32..128 chord across the knee is not enough, one more 2x point is taken.
    knee = FakeDevice(flat_s=0.015, per_sample_s=0.00025)
    k = run_sweep(knee.measure, opts, clock=knee.clock)
    assert [p.batch_size for p in k.points][3:] == [128, 256]
    assert res.stop_reason == "time budget, then past the flat part"
    assert all(r == opts.min_repeats for b, _, r in dev.calls if b > 32)  # the jumps are short
    fit = fit_envelope(res.compute_points())
    assert fit(476) == pytest.approx(dev.t(476), rel=0.02)


def test_flat_jumps_stop_at_memory_and_at_max_batch() -> None:
    dev = FakeDevice(flat_s=0.015, per_sample_s=0.00001, max_fit=200)
    opts = SweepOptions(total_budget_s=0.5, step_limit_s=1e9, midpoints=False)
    res = run_sweep(dev.measure, opts, clock=dev.clock)
    assert res.stop_reason == "does not fit" and res.oom_batch == 512
    never_bends = FakeDevice(flat_s=0.015, per_sample_s=1e-7)
    capped = run_sweep(never_bends.measure, SweepOptions(total_budget_s=0.5, step_limit_s=1e9, midpoints=False,
                                                         max_batch=1024), clock=never_bends.clock)
    assert capped.points[-1].batch_size == 1024 and capped.stop_reason == "time budget, then past the flat part"
    assert max(b for b, _, _ in never_bends.calls) == 1024


def test_linear_tail_stops_growth_and_the_fit_matches_the_full_sweep() -> None:
    """Once the last points are compute-bound and collinear the sweep stops; the planner's fitted curve
    is the full sweep's within 1% over the full sweep's whole range (it extrapolates the same line)."""
    dev = FakeDevice(flat_s=0.010, per_sample_s=0.0002)
    full = run_sweep(dev.measure, SweepOptions.thorough(max_batch=4096, total_budget_s=1e9), clock=dev.clock)
    fast_dev = FakeDevice(flat_s=0.010, per_sample_s=0.0002)
    fast = run_sweep(fast_dev.measure, SweepOptions(max_batch=4096, total_budget_s=1e9), clock=fast_dev.clock)
    assert fast.stop_reason == "linear" and full.stop_reason == "series end"
    assert fast.points[-1].batch_size < full.points[-1].batch_size and fast.elapsed_s < full.elapsed_s / 4
    f_full, f_fast = fit_envelope(full.compute_points()), fit_envelope(fast.compute_points())
    for b in (8, 50, 100, 384, 1000, 4096):
        assert f_fast(b) == pytest.approx(f_full(b), rel=0.01)


def test_a_flat_or_bending_tail_is_not_linear() -> None:
    from profiler.sweep import linear_tail

    def pts(times: list[float]) -> list[SweepPoint]:
        return [SweepPoint(batch_size=b, times_s=(t, t, t)) for b, t in zip((64, 96, 128, 192), times, strict=True)]

    assert linear_tail(pts([0.064, 0.096, 0.128, 0.192]), 0.03)  # t proportional to b
    assert not linear_tail(pts([0.02, 0.02, 0.02, 0.02]), 0.03)  # flat: launch-bound, the knee is still ahead
    assert not linear_tail(pts([0.03, 0.04, 0.06, 0.10]), 0.03)  # still bending
    noisy = [SweepPoint(batch_size=b, times_s=(t, 1.2 * t, t)) for b, t in ((64, 0.064), (96, 0.096), (128, 0.128),
                                                                             (192, 0.192))]
    assert not linear_tail(noisy, 0.03)  # repeats that disagree cannot certify a line


def test_repeats_stop_early_when_the_first_steps_agree() -> None:
    dev = FakeDevice(flat_s=0.001, per_sample_s=0.0)  # identical steps: min_repeats are enough
    run_sweep(dev.measure, SweepOptions(batch_sizes=(8,), min_repeats=3, max_repeats=15), clock=dev.clock)
    assert dev.calls == [(8, 2, 1), (8, 0, 2)]
    noisy = FakeDevice(flat_s=0.001, per_sample_s=0.0, spikes={8: [[0.001], [0.001, 0.002]]})
    run_sweep(noisy.measure, SweepOptions(batch_sizes=(8,), min_repeats=3, max_repeats=15), clock=noisy.clock)
    assert noisy.calls == [(8, 2, 1), (8, 0, 2), (8, 0, 12)]  # they disagree: the point's full repeats
    two = FakeDevice(flat_s=0.001, per_sample_s=0.0)
    run_sweep(two.measure, SweepOptions(batch_sizes=(8, 16), min_repeats=3, max_repeats=15), clock=two.clock)
    assert [c for c in two.calls if c[2] == 1] == [(8, 2, 1), (16, 1, 1)]  # one warm-up after the first point


class BendingDevice(FakeDevice):
    """Linear to 128 samples, then steeper (a CPU's caches, seen with cifar_cnn on this box: 2x at 512)."""

    def t(self, b: int) -> float:
        return 0.001 * b + (0.002 * (b - 128) if b > 128 else 0.0)


def test_a_check_point_past_a_linear_tail_finds_a_bend_and_the_sweep_goes_on() -> None:
    dev = BendingDevice()
    res = run_sweep(dev.measure, SweepOptions(start_batch=8, max_batch=512, total_budget_s=1e9), clock=dev.clock)
    sizes = [p.batch_size for p in res.points]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)  # the check point took its place in order
    assert res.stop_reason == "series end" and sizes[-1] == 512  # went on as a full sweep would
    fit = fit_envelope(res.compute_points())
    for b in (64, 256, 512):
        assert fit(b) == pytest.approx(dev.t(b), rel=0.01)
    straight = FakeDevice(flat_s=0.0, per_sample_s=0.001)
    ok = run_sweep(straight.measure, SweepOptions(start_batch=8, max_batch=4096, total_budget_s=1e9),
                   clock=straight.clock)
    assert ok.stop_reason == "linear" and ok.points[-1].batch_size == 8 * ok.points[-2].batch_size  # checked far out


def test_warm_ups_do_not_count_against_the_budget() -> None:
    # cudnn.benchmark autotunes every new shape for seconds in its first (warm-up) step; charged to the 30 s budget
    # that stopped a ResNet-50 bf16 sweep at batch 16-32 on H100.
    class Autotuning(FakeDevice):
        def measure(self, b: int, warmup: int, repeats: int) -> Measurement:
            if warmup:
                self.now += 6.0  # seconds of autotuning, untimed
            return super().measure(b, warmup, repeats)

    dev = Autotuning(flat_s=0.015, per_sample_s=0.00025)
    res = run_sweep(dev.measure, SweepOptions(max_batch=1024, total_budget_s=30.0), clock=dev.clock)
    assert res.points[-1].batch_size >= 512 and res.stop_reason != "time budget"
