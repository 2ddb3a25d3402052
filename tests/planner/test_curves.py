from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.curves import fit_envelope, isotonic, memory_cap
from planner.profile import ComputePoint, MemoryPoint, MemoryProfile


def pts(*bt: tuple[int, float]) -> list[ComputePoint]:
    return [ComputePoint(batch_size=b, step_time_s=t) for b, t in bt]


def test_collinear_points_give_one_piece_through_them() -> None:
    env = fit_envelope(pts((32, 0.010), (128, 0.025), (512, 0.085)))
    assert len(env.slopes) == 1
    assert env(32) == pytest.approx(0.010)
    assert env(512) == pytest.approx(0.085)
    assert env(1024) == pytest.approx(0.005 + 1024 * 0.015 / 96)


def test_flat_then_linear_gpu_shape_is_kept() -> None:
    env = fit_envelope(pts((8, 0.010), (16, 0.010), (32, 0.010), (64, 0.015), (128, 0.025)))
    assert env(8) == pytest.approx(0.010)
    assert env(24) == pytest.approx(0.010)
    assert env(128) == pytest.approx(0.025)
    assert env(256) == pytest.approx(0.045)  # last piece extends linearly


def test_non_monotone_noise_is_pooled_not_trusted() -> None:
    # 64 measured faster than 32: PAV pools them to their mean.
    env = fit_envelope(pts((16, 0.010), (32, 0.022), (64, 0.018), (128, 0.040)))
    assert env(64) == pytest.approx(0.020)
    # 32 pools to 0.020 too, which lies above the convex hull: the hull under-estimates it, by a bounded amount
    assert 0.010 < env(32) < 0.020
    assert env.max_rel_residual == pytest.approx((0.022 - env(32)) / 0.022)
    assert all(s >= 0 for s in env.slopes)


def test_repeated_batches_are_merged_by_median() -> None:
    env = fit_envelope(pts((32, 0.010), (32, 0.011), (32, 0.500), (64, 0.020)))
    assert env(32) == pytest.approx(0.011)


def test_single_point_is_proportional() -> None:
    env = fit_envelope(pts((64, 0.032)))
    assert env(32) == pytest.approx(0.016)
    assert env(1) > 0


def test_left_extension_never_goes_negative() -> None:
    env = fit_envelope(pts((100, 0.010), (200, 0.050)))  # first piece would cross zero at b=75
    assert env(1) > 0
    assert env(50) == pytest.approx(0.005)  # the origin-to-first-point segment
    assert env(100) == pytest.approx(0.010)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4096), st.floats(1e-4, 10.0)), min_size=1, max_size=12))
def test_envelope_is_convex_non_decreasing_and_positive(raw: list[tuple[int, float]]) -> None:
    env = fit_envelope(pts(*raw))
    b = np.arange(1, 5000, 7)
    t = env.predict(b)
    assert np.all(t > 0)
    assert np.all(np.diff(t) >= -1e-12)
    second = np.diff(t, 2)
    assert np.all(second >= -1e-9 * t.max())
    # max_batch_within inverts it
    for target in (t[3], t[len(t) // 2]):
        bb = env.max_batch_within(float(target))
        if math.isfinite(bb):
            assert env(bb) <= target * (1 + 1e-9)


def test_isotonic_matches_hand_result() -> None:
    assert isotonic([1, 3, 2, 4]).tolist() == [1, 2.5, 2.5, 4]
    assert isotonic([5, 4, 3]).tolist() == [4, 4, 4]


def test_memory_cap_affine_with_headroom() -> None:
    mem = MemoryProfile(
        capacity_bytes=80_000_000_000,
        points=(MemoryPoint(batch_size=32, peak_bytes=2_000_000_000), MemoryPoint(batch_size=512, peak_bytes=20_000_000_000)),
    )
    per = 18e9 / 480
    fixed = 2e9 - 32 * per
    assert memory_cap(mem, headroom=0.10) == math.floor((72e9 - fixed) / per)
    assert memory_cap(mem, headroom=0.0) == math.floor((80e9 - fixed) / per)
    # Two ranks on the GPU: each its half, its own fixed bytes included.
    assert memory_cap(mem, headroom=0.10, sharing=2) == math.floor((36e9 - fixed) / per)


def test_ranks_sharing_a_gpu_share_its_memory() -> None:
    from planner.options import SolveOptions
    from planner.profile import ComputePoint, HostProfile, Profile, RankProfile
    from planner.solve import build_models

    mem = MemoryProfile(capacity_bytes=10_000, points=(MemoryPoint(batch_size=10, peak_bytes=1_000),
                                                        MemoryPoint(batch_size=20, peak_bytes=2_000)))
    compute = (ComputePoint(batch_size=10, step_time_s=0.01), ComputePoint(batch_size=20, step_time_s=0.02))
    ranks = tuple(RankProfile(rank=i, host="h", device=dev, compute=compute, memory=mem)
                  for i, dev in enumerate(("cuda:0", "cuda:0", "cuda:1")))
    caps = [m.micro_cap for m in build_models(Profile(hosts=(HostProfile(name="h", cpu_cores=8),), ranks=ranks),
                                               SolveOptions(memory_headroom=0.0))]
    assert caps == [50, 50, 100]  # 100 bytes a sample, no fixed part: 10,000 bytes between two ranks, or alone


def test_memory_cap_measured_max_and_absent() -> None:
    assert memory_cap(None) is None
    assert memory_cap(MemoryProfile()) is None
    assert memory_cap(MemoryProfile(max_batch_size=300)) == 300
    one = MemoryProfile(capacity_bytes=1000, points=(MemoryPoint(batch_size=10, peak_bytes=100),))
    assert memory_cap(one, headroom=0.0) == 100  # fixed part assumed 0: conservative
