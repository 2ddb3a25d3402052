"""Curve models: step time as a convex piecewise-linear envelope, memory as an affine fit.

Step time.  A GPU step is flat at small batches (launch-bound) and linear later; a CPU step is linear
throughout.  Both are well described by a convex, non-decreasing, piecewise-linear function
    t(b) = max_k (slope_k * b + intercept_k)
which keeps the solver's constraint ``t_i(b_i) <= T`` linear (one row per piece).

How noisy measurements are handled (in this order):
  1. repeated batch sizes are merged by their median;
  2. a larger batch never takes less time: non-monotone points are pooled by isotonic regression (PAV),
     which replaces a violating run by its mean instead of trusting either end;
  3. the lower convex hull of the pooled points gives the pieces -- a point above the hull (a concave bump,
     usually noise or a kernel switch) is under-estimated by at most its distance to the hull, which
     ``Envelope.max_rel_residual`` reports;
  4. left of the smallest measured batch the curve follows the hull down to a non-negative intercept: when the
     first piece would cross zero, the segment from the origin to the first point is used instead, so t(b) > 0
     for every b >= 1;
  5. right of the largest measured batch the last piece extends linearly (GPUs are linear once saturated).
A single point gives the line through the origin (time proportional to batch), the only shape it supports.
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from planner.profile import ComputePoint, MemoryPoint, MemoryProfile


@dataclass(frozen=True, kw_only=True, slots=True)
class Envelope:
    """t(b) = max_k slopes[k] * b + intercepts[k]; slopes ascending, all >= 0; convex and non-decreasing."""

    slopes: tuple[float, ...]
    intercepts: tuple[float, ...]
    knots: tuple[tuple[float, float], ...]
    """The hull's (batch, time) vertices, for plotting."""
    max_rel_residual: float = 0.0
    """Largest |t(b_k) - measured_k| / measured_k over the measured points (fit quality)."""

    def __call__(self, b: float) -> float:
        return max(s * b + c for s, c in zip(self.slopes, self.intercepts, strict=True))

    def predict(self, b: np.ndarray) -> np.ndarray:
        s = np.asarray(self.slopes)[:, None]
        c = np.asarray(self.intercepts)[:, None]
        return np.max(s * np.asarray(b, dtype=float)[None, :] + c, axis=0)

    def max_batch_within(self, t: float) -> float:
        """Largest real b with t(b) <= t (inf if the envelope is flat at or below t; 0 if nothing fits)."""
        best = math.inf
        for s, c in zip(self.slopes, self.intercepts, strict=True):
            if s > 0:
                best = min(best, (t - c) / s)
            elif c > t:
                return 0.0
        return max(best, 0.0)

    def scaled(self, factor: float) -> Envelope:
        """The same shape with every time multiplied by `factor` (used by the re-planner)."""
        return Envelope(
            slopes=tuple(s * factor for s in self.slopes),
            intercepts=tuple(c * factor for c in self.intercepts),
            knots=tuple((b, t * factor) for b, t in self.knots),
            max_rel_residual=self.max_rel_residual,
        )

    def plus_per_sample(self, sec_per_sample: float) -> Envelope:
        """t(b) + c*b: a step whose data is produced serially in the training process (num_workers=0)."""
        return Envelope(
            slopes=tuple(s + sec_per_sample for s in self.slopes),
            intercepts=self.intercepts,
            knots=tuple((b, t + sec_per_sample * b) for b, t in self.knots),
            max_rel_residual=self.max_rel_residual,
        )


    def at_least_per_sample(self, sec_per_sample: float) -> Envelope:
        """max(t(b), c*b): a step that cannot run faster than c seconds a sample, whatever its compute -- the
        training process taking its batch over (planner.loader.handover_costs_s) -- one more piece through 0."""
        if sec_per_sample <= 0:
            return self
        pieces = sorted([*zip(self.slopes, self.intercepts, strict=True), (sec_per_sample, 0.0)])
        return Envelope(slopes=tuple(p[0] for p in pieces), intercepts=tuple(p[1] for p in pieces),
                        knots=self.knots, max_rel_residual=self.max_rel_residual)


def _merge_median(points: Iterable[ComputePoint]) -> tuple[np.ndarray, np.ndarray]:
    by_batch: dict[int, list[float]] = {}
    for p in points:
        by_batch.setdefault(p.batch_size, []).append(p.step_time_s)
    b = np.array(sorted(by_batch), dtype=float)
    t = np.array([statistics.median(by_batch[int(x)]) for x in b])
    return b, t


def isotonic(y: Sequence[float] | np.ndarray, w: Sequence[float] | None = None) -> np.ndarray:
    """Non-decreasing least-squares fit (pool-adjacent-violators)."""
    ys = [float(v) for v in y]
    ws = [1.0] * len(ys) if w is None else [float(v) for v in w]
    # Each block: [mean, weight, count]; merge while the last two violate monotonicity.
    blocks: list[list[float]] = []
    for yi, wi in zip(ys, ws, strict=True):
        blocks.append([yi, wi, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    out: list[float] = []
    for m, _, n in blocks:
        out.extend([m] * int(n))
    return np.array(out)


def _lower_hull(b: np.ndarray, t: np.ndarray) -> list[tuple[float, float]]:
    """Lower convex hull of points sorted by b (monotone chain)."""
    hull: list[tuple[float, float]] = []
    for x, y in zip(b.tolist(), t.tolist(), strict=True):
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            # Drop the middle point when it lies on or above the chord from hull[-2] to (x, y) (collinear
            # within rounding counts as on it, so exactly linear data gives one piece).
            cross = (y2 - y1) * (x - x1) - (y - y1) * (x2 - x1)
            if cross >= -1e-9 * abs(y - y1) * abs(x2 - x1):
                hull.pop()
            else:
                break
        hull.append((x, y))
    return hull


def fit_envelope(points: Sequence[ComputePoint]) -> Envelope:
    """Fit the convex non-decreasing piecewise-linear envelope to measured (batch, step time) points.

    Points and envelopes are immutable, so each distinct set of points is fitted once (the solver builds every
    rank's model several times per solve, the Replanner once more per epoch)."""
    if not points:
        raise ValueError("fit_envelope needs at least one measured point")
    return _fit_envelope(tuple(points))


@functools.lru_cache(maxsize=4096)
def _fit_envelope(points: tuple[ComputePoint, ...]) -> Envelope:
    b, t_raw = _merge_median(points)
    t = isotonic(t_raw)
    if len(b) == 1:
        slope = t[0] / b[0]
        return Envelope(slopes=(slope,), intercepts=(0.0,), knots=((0.0, 0.0), (b[0], t[0])), max_rel_residual=0.0)
    hull = _lower_hull(b, t)
    # Left extension: keep the first piece unless it would give t(0) < 0; then start the hull at the origin.
    (x0, y0), (x1, y1) = hull[0], hull[1]
    if y0 - (y1 - y0) / (x1 - x0) * x0 < 0:
        hull.insert(0, (0.0, 0.0))
        hull = _lower_hull(np.array([p[0] for p in hull]), np.array([p[1] for p in hull]))
    slopes, intercepts = [], []
    for (xa, ya), (xb, yb) in itertools.pairwise(hull):
        s = (yb - ya) / (xb - xa)
        slopes.append(max(s, 0.0))
        intercepts.append(ya - max(s, 0.0) * xa)
    env = Envelope(slopes=tuple(slopes), intercepts=tuple(intercepts), knots=tuple(hull))
    resid = float(np.max(np.abs(env.predict(b) - t_raw) / t_raw))
    return Envelope(slopes=env.slopes, intercepts=env.intercepts, knots=env.knots, max_rel_residual=resid)


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryFit:
    fixed_bytes: float
    per_sample_bytes: float
    """peak(b) = fixed_bytes + per_sample_bytes * b (least squares over the measured points)."""

    def __call__(self, b: float) -> float:
        return self.fixed_bytes + self.per_sample_bytes * b


def fit_memory(mem: MemoryProfile) -> MemoryFit | None:
    """Affine fit of peak bytes against batch size; None without points (each distinct set of points fitted once,
    as ``fit_envelope``).

    With one point the fixed part is unknown; assuming it is zero over-estimates the growth per sample and so
    gives a conservative cap.
    """
    return _fit_memory(tuple(mem.points))


@functools.lru_cache(maxsize=4096)
def _fit_memory(points: tuple[MemoryPoint, ...]) -> MemoryFit | None:
    if not points:
        return None
    b = np.array([p.batch_size for p in points], dtype=float)
    m = np.array([p.peak_bytes for p in points], dtype=float)
    if len(set(b.tolist())) == 1:
        return MemoryFit(fixed_bytes=0.0, per_sample_bytes=float(np.max(m) / b[0]))
    slope, intercept = np.polyfit(b, m, 1)
    if slope <= 0:
        # Peak memory that does not grow with batch: no activation term to cap.
        return MemoryFit(fixed_bytes=float(np.max(m)), per_sample_bytes=0.0)
    return MemoryFit(fixed_bytes=float(intercept), per_sample_bytes=float(slope))


def memory_cap(mem: MemoryProfile | None, *, headroom: float = 0.10, sharing: int = 1) -> int | None:
    """Largest batch whose predicted peak stays below (1 - headroom) * capacity / sharing; None means uncapped.

    ``sharing`` ranks run on the device (two local ranks on one GPU): each gets its part of the memory, its own
    fixed bytes (parameters, optimizer state) included. A measured ``max_batch_size`` (largest batch that ran
    without OOM) also caps.
    """
    if mem is None:
        return None
    caps: list[int] = []
    if mem.max_batch_size is not None:
        caps.append(mem.max_batch_size)
    fit = fit_memory(mem)
    if fit is not None and mem.capacity_bytes is not None and fit.per_sample_bytes > 0:
        budget = mem.capacity_bytes * (1.0 - headroom) / max(1, sharing)
        caps.append(max(0, math.floor((budget - fit.fixed_bytes) / fit.per_sample_bytes)))
    return min(caps) if caps else None
