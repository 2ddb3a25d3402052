"""Profiles built in code for planner tests."""

from __future__ import annotations

from pathlib import Path

from planner.profile import (
    ComputePoint,
    HostProfile,
    LoaderProfile,
    MemoryPoint,
    MemoryProfile,
    Profile,
    RankProfile,
)

MINIMAL = Path(__file__).resolve().parents[2] / "planner" / "examples" / "minimal_profile.json"


def linear_profile(
    sec_per_sample: list[float],
    *,
    fixed_s: float = 0.0,
    caps: list[int | None] | None = None,
    loader_s: list[float] | None = None,
    cores: int = 64,
) -> Profile:
    """Ranks with t_i(b) = fixed_s + sec_per_sample[i] * b on one host: optimum computable by hand."""
    ranks = []
    for i, s in enumerate(sec_per_sample):
        cap = caps[i] if caps else None
        ranks.append(
            RankProfile(
                rank=i,
                host="h",
                device=f"cuda:{i}",
                compute=(
                    ComputePoint(batch_size=16, step_time_s=fixed_s + 16 * s),
                    ComputePoint(batch_size=256, step_time_s=fixed_s + 256 * s),
                ),
                memory=None if cap is None else MemoryProfile(max_batch_size=cap),
                loader=None if loader_s is None else LoaderProfile(sec_per_sample=loader_s[i]),
            )
        )
    return Profile(hosts=(HostProfile(name="h", cpu_cores=cores),), ranks=tuple(ranks))


def memory_profile(capacity: int, fixed: int, per_sample: int) -> MemoryProfile:
    return MemoryProfile(
        capacity_bytes=capacity,
        points=(
            MemoryPoint(batch_size=8, peak_bytes=fixed + 8 * per_sample),
            MemoryPoint(batch_size=64, peak_bytes=fixed + 64 * per_sample),
        ),
    )
