"""What a run log measured of each rank's speed and of the synchronization, in the terms the profile uses.

Three readers need the same numbers:

  * speed eras (``speed_eras``): epochs in which no rank's compute, relative to its profiled curve at the batch it
    ran, moved by more than ``ERA_TOL``.  Two splits' measured samples/s compare the splits only inside one era; a
    split that ran before a slowdown and one that ran after it compare the slowdown (a log whose rank slowed 5x in
    epoch 2 credited a 4.74x "gain" to the split of epoch 0 over the equal split of epoch 2, while the equal split
    had run within 15% of it in epoch 1);
  * the per-rank findings (reports.causes): a rank whose compute the run measured far above its curve, relative to
    the other ranks, is slow whatever the profile said;
  * the what-ifs (``as_measured``): the profile with each rank's curve scaled to what the run measured, and the
    exposed communication never above what the run's step left for it (its step less its slowest rank's own
    time).  A profile whose DDP overhead (94.6 ms) exceeded the whole measured step (~81 ms) made dropping either
    of two ranks look 37% faster.

The ratio ``compute_s / curve(batch)`` is what a re-plan does not move (it changes the batch, and the curve is
read at the new one) and what a slowdown raises.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from planner.curves import fit_envelope
from planner.profile import Profile
from planner.runlog import EpochRecord, RunLog
from planner.solve import exposed_comm_s

ERA_TOL = 0.15
"""A rank's compute-over-curve ratio this far (relative) from its era's median starts a new era: above the
epoch-to-epoch noise of a busy host (the same 15% a slow rank is named at, reports.causes.SLOW_TOL)."""
ERA_SIGMAS = 3.0
"""... and this many of the epoch's standard errors (``compute_s_std / sqrt(num_steps)``) away: an epoch of a
few noisy steps does not open an era by itself.  The Replanner's eras (runtime.replan.policy) follow the same
idea with their own margins; the report reads only the log."""
SCALE_TOL = 0.15
"""A rank whose measured compute is this far from its curve gets its curve scaled in the what-ifs; nearer, the
profile's own curve stands (the compute span under DDP and the standalone step differ by a few percent)."""


def curve_ratios(profile: Profile, epoch: EpochRecord) -> dict[int, float]:
    """rank -> measured compute per step over the profiled curve at the batch it ran, for the ranks that timed a
    step in ``epoch``."""
    return {r: x for r, (x, _) in _ratios(profile, epoch).items()}


def _ratios(profile: Profile, epoch: EpochRecord) -> dict[int, tuple[float, float]]:
    """rank -> (``curve_ratios``' ratio, its relative standard error over the epoch's steps)."""
    out = {}
    for st in epoch.ranks:
        if st.rank >= profile.world_size or st.num_steps <= 0 or st.batch_size <= 0:
            continue
        if not (math.isfinite(st.compute_s) and st.compute_s > 0):
            continue
        curve = fit_envelope(profile.rank(st.rank).compute)(st.batch_size)
        if curve > 0:
            out[st.rank] = (st.compute_s / curve, st.compute_s_std / math.sqrt(st.num_steps) / st.compute_s)
    return out


def speed_eras(profile: Profile, log: RunLog) -> list[int]:
    """The era of each of ``log.epochs`` (0, 1, ...): an epoch opens a new era when some rank's ratio
    (``curve_ratios``) is more than ``ERA_TOL`` and ``ERA_SIGMAS`` standard errors from the median of the current
    era's ratios for that rank."""
    eras: list[int] = []
    current: dict[int, list[float]] = {}
    for e in log.epochs:
        measured = _ratios(profile, e)
        ratios = {r: x for r, (x, _) in measured.items()}
        moved = any(_moved(x, current[r], se) for r, (x, se) in measured.items() if r in current)
        if moved or not eras:
            current = {}
            eras.append(eras[-1] + 1 if eras else 0)
        else:
            eras.append(eras[-1])
        for r, x in ratios.items():
            current.setdefault(r, []).append(x)
    return eras


def _moved(ratio: float, era: Sequence[float], rel_se: float) -> bool:
    """A rank's ratio more than ``ERA_TOL`` and ``ERA_SIGMAS`` standard errors from its era's median."""
    change = abs(ratio / statistics.median(era) - 1.0)
    return change > ERA_TOL and change > ERA_SIGMAS * rel_se


def speed_change(profile: Profile, a: EpochRecord, b: EpochRecord) -> tuple[int, float] | None:
    """(rank, factor) of the rank whose compute-over-curve ratio moved most from epoch ``a`` to epoch ``b``
    (factor > 1: slower in ``b``); None when no rank timed both."""
    ra, rb = curve_ratios(profile, a), curve_ratios(profile, b)
    common = [(r, rb[r] / ra[r]) for r in ra if r in rb]
    return max(common, key=lambda rf: abs(math.log(rf[1]))) if common else None


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredBasis:
    """The profile as a run log's steady epoch measured it (``as_measured``)."""

    epoch: int
    factors: tuple[float, ...]
    """By rank: the factor its compute curve is scaled by (1.0 where the run measured it on its curve)."""
    comm_s: float
    """Exposed communication the what-ifs use: the profile's, or less where the run's step left less."""
    profile_comm_s: float
    """The profile's own exposed communication (``planner.solve.exposed_comm_s``)."""
    profile: Profile

    @property
    def changed(self) -> bool:
        return any(f != 1.0 for f in self.factors) or self.comm_s < self.profile_comm_s

    @property
    def text(self) -> str:
        """Plain words: what differs from the profile ("" when nothing does)."""
        parts = [f"rank {i} at {f:.2f}x its profiled curve" for i, f in enumerate(self.factors) if f != 1.0]
        if self.comm_s < self.profile_comm_s:
            parts.append(f"communication {1000 * self.comm_s:.1f} ms a step as the run measured it, not the "
                         f"profile's {1000 * self.profile_comm_s:.1f} ms")
        return "; ".join(parts)


def _synchronization_s(e: EpochRecord) -> float | None:
    """What the epoch's measured step spent beyond its slowest rank's own time (compute and data wait): the
    all-reduce tail and DDP's own work as this run paid them; None when the epoch lacks the numbers."""
    busy = [b for b in e.measured_busy_s if math.isfinite(b)]
    if not busy or not e.step_time_s or not math.isfinite(e.step_time_s):
        return None
    return max(0.0, e.step_time_s - max(busy))


def as_measured(profile: Profile, log: RunLog, mode: str = "ddp") -> MeasuredBasis | None:
    """The profile with what the log's steady epoch (``RunLog.steady_epoch``) measured: each rank's compute curve
    scaled by its ratio (``curve_ratios``) where that is more than ``SCALE_TOL`` from 1, and the exposed
    communication capped at the epoch's synchronization (its step less its slowest rank's own time, so never above
    the measured step).  None when the epoch is missing, drained, or of another world size."""
    e = log.steady_epoch()
    if e is None or e.drained or len(e.ranks) != profile.world_size:
        return None
    ratios = curve_ratios(profile, e)
    factors = tuple(ratios[r] if r in ratios and abs(ratios[r] - 1.0) > SCALE_TOL else 1.0
                    for r in range(profile.world_size))
    measured = profile.scaled(factors) if any(f != 1.0 for f in factors) else profile
    own = exposed_comm_s(profile, mode)
    sync = _synchronization_s(e)
    comm = own if sync is None else min(own, sync)
    if comm < own and measured.comm is not None:
        c = measured.comm
        measured = replace(measured, comm=replace(
            c, exposed_s=comm, span_tail_s=None if c.span_tail_s is None else min(c.span_tail_s, comm)))
    return MeasuredBasis(epoch=e.epoch, factors=factors, comm_s=comm, profile_comm_s=own, profile=measured)


def reference_rank(ratios: dict[int, float], ranks: Sequence[int] | None = None) -> int | None:
    """The rank (of ``ranks``, else any) with the lowest ratio -- the one that ran nearest its curve, or faster
    than it: what the others are compared with."""
    pool = {r: x for r, x in ratios.items() if ranks is None or r in ranks}
    return min(pool, key=lambda r: pool[r]) if pool else None


__all__ = ["ERA_SIGMAS", "ERA_TOL", "SCALE_TOL", "MeasuredBasis", "as_measured", "curve_ratios", "reference_rank",
           "speed_change", "speed_eras"]
