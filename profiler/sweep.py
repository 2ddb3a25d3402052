"""The compute sweep's policy, free of torch and of clocks: which batch sizes, how many repeats, when to stop.

The sweep drives a ``measure(batch_size, warmup, repeats) -> Measurement`` callable (the torch step runner in
profiler.compute, or a fake in tests) and a ``clock() -> seconds`` (time.perf_counter, or a fake):

  * batch sizes: explicit (``--batch-sizes 8,16,..``) or a geometric series ``start, start*g, ..`` up to
    ``max_batch``;
  * per batch: ``warmup`` untimed steps (allocator, cuDNN algorithm choice, autotuning for a new shape) plus one
    timed probe step; the probe sets the repeats so a point costs about ``point_budget_s`` of timed steps,
    clamped to [min_repeats, max_repeats]; the point is the *median* of the timed steps (robust against a
    stray slow step; a mean would follow it);
  * stop at: the end of the series; a batch that does not fit (``DoesNotFit`` -> its size is reported so
    profiler.memory can search the largest batch that fits); a median step above ``step_limit_s``; or, once
    ``min_points`` are in, when the next point (predicted as linear in the batch) would overrun
    ``total_budget_s``; a device so slow that it stops before ``min_points`` gets smaller batches instead
    (start/2, start/4, ..), which cost less than the points already taken;
  * a budget stop while the curve is still flat (the last median below ``flat_ratio`` x the smallest one: a GPU
    still latency-bound) would leave a curve that says nothing about the batches a plan will ask for, so the
    sweep jumps ahead by 4x (few repeats; in the flat part a step costs what the small ones did), then 2x, until
    the last segment measures the per-sample slope (not a chord across the knee), a batch does not fit, or
    ``max_flat_jumps`` are spent.  Seen on 2 H100s: a
    ResNet-50 profile stopped at batch 32 (every point 15-18 ms) and the plan extrapolated rank 0 to 476;
  * (to profile faster) points after the first warm up with ``warmup_next`` steps; a point's repeats
    stop early once ``min_repeats`` agree within ``spread_stop``; and the series stops growing once its last
    points are linear within ``linear_stop_tol`` and one check point ``linear_check_factor`` times further out
    lies on the same line (where it does not, the sweep goes on as before); ``SweepOptions.thorough()`` turns
    all three off;
  * then suspects are re-measured: a point slower than the next larger batch, or more than ``suspect_tol`` above
    the chord of its neighbours (a concave bump).  Interference from other processes only ever slows a step,
    so of the two medians the lower one is kept.  This repairs the few points a busy host spoils without
    paying for many more repeats everywhere.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from planner.curves import fit_envelope
from planner.errors import ValidationError
from planner.profile import ComputePoint, MemoryPoint


class DoesNotFit(Exception):
    """A step at this batch size ran out of device memory (raised by the measure callable)."""

    def __init__(self, batch_size: int) -> None:
        super().__init__(f"batch {batch_size} does not fit in device memory")
        self.batch_size = batch_size


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    times_s: tuple[float, ...]
    """Wall time of each timed step (the measure callable synchronizes the device around its timer)."""
    peak_bytes: int | None = None
    """Peak allocated device bytes over these steps (None on CPU)."""


Measure = Callable[[int, int, int], Measurement]
"""measure(batch_size, warmup, repeats) -> Measurement; raises DoesNotFit."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SweepOptions:
    batch_sizes: tuple[int, ...] | None = None
    """Explicit batch sizes (sorted ascending); None: the geometric series below."""
    start_batch: int = 8
    growth: int = 2
    midpoints: bool = True
    """Also measure 1.5x each geometric point (8, 12, 16, 24, ...): a GPU curve bends between its flat and
    linear parts, and a chord across a factor of 2 over-estimates there by up to ~10% (seen on H200)."""
    max_batch: int = 4096
    end_at_max: bool = False
    """End the geometric series at ``max_batch`` itself (a cap that is the largest batch a plan can ask for: the
    global batch, profiler.run.sweep_options), not at the last series point below it."""
    warmup: int = 2
    warmup_next: int | None = 1
    """Warm-up steps of every point after the first (None: ``warmup``): the model, optimizer state and kernels are
    loaded by then; a new shape needs one step for the allocator (cuDNN does not autotune unless asked)."""
    min_repeats: int = 3
    max_repeats: int = 15
    point_budget_s: float = 1.0
    """Target seconds of timed steps per point (sets the repeats)."""
    step_limit_s: float = 2.0
    """Stop growing once a median step is slower than this (the curve is linear by then)."""
    total_budget_s: float = 30.0
    """Stop growing when the next point would end after this many seconds (once min_points are measured).  Warm-up
    steps do not count: with cudnn.benchmark a new shape's autotuning takes seconds (ResNet-50 bf16 on H100), and
    counting it stopped a sweep at batch 16-32 -- the points that matter, not the budget, were lost."""
    min_points: int = 3
    min_batch: int = 1
    """Smallest batch the slow-device extension may try (2 for BatchNorm models: batch 1 cannot normalize)."""
    linear_stop_tol: float | None = 0.03
    """Stop growing once the last ``linear_points`` points lie on one line within this relative distance, with
    repeats that agree as closely and an intercept under a quarter of the last step: the device is compute-bound
    there and further points only extend the line the planner extrapolates anyway.
    None: grow until the series end, the budget, the step limit or out of memory (the thorough sweep)."""
    linear_points: int = 4
    """Points that must be collinear (with midpoints: a factor 3 of batch, e.g. 128..384)."""
    linear_check_factor: int = 8
    """Before stopping on a linear tail, one point this many times further out must lie on its line too (within
    the budget and max_batch); where it does not, the sweep goes on as a full one would."""
    spread_stop: float | None = 0.02
    """Stop a point's repeats once ``min_repeats`` steps agree within this relative spread ((max - min) / median);
    None: always the repeats ``point_budget_s`` asks for (the thorough sweep)."""
    suspect_tol: float = 0.25
    """Relative excess over the neighbours' chord (or over the next batch) that triggers a re-measurement."""
    remeasure_rounds: int = 2
    flat_ratio: float = 2.0
    """A curve whose last median is below flat_ratio x its smallest has not shown its per-sample cost yet."""
    max_flat_jumps: int = 4
    """Points past the time budget to leave a flat curve (each 4x the batch before; 8 -> 2048 at most)."""

    def __post_init__(self) -> None:
        if self.batch_sizes is not None and (not self.batch_sizes or min(self.batch_sizes) < 1):
            raise ValidationError(f"--batch-sizes: need positive integers, got {list(self.batch_sizes)}")
        if self.start_batch < 1 or self.growth < 2 or self.max_batch < self.start_batch:
            raise ValidationError(
                f"sweep: need start_batch >= 1, growth >= 2, max_batch >= start_batch; got {self.start_batch}, "
                f"{self.growth}, {self.max_batch}"
            )
        if not 1 <= self.min_repeats <= self.max_repeats:
            raise ValidationError(f"sweep: need 1 <= min_repeats <= max_repeats, got {self.min_repeats}, {self.max_repeats}")

    @classmethod
    def thorough(cls, **overrides: object) -> SweepOptions:
        """The thorough sweep: every point's full repeats, growing until budget/limit/memory (for comparison)."""
        base: dict[str, object] = dict(linear_stop_tol=None, spread_stop=None, warmup_next=None)
        base.update(overrides)
        return cls(**base)  # type: ignore[arg-type]

    @classmethod
    def quick(cls, **overrides: object) -> SweepOptions:
        """CI-sized: a few seconds per device, still >= 3 points."""
        base: dict[str, object] = dict(max_batch=512, midpoints=False, warmup=1, min_repeats=3, max_repeats=7, point_budget_s=0.3,
                                       step_limit_s=0.5, total_budget_s=6.0)
        base.update(overrides)
        return cls(**base)  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True, slots=True)
class SweepPoint:
    batch_size: int
    times_s: tuple[float, ...]
    peak_bytes: int | None = None

    @property
    def median_s(self) -> float:
        return float(statistics.median(self.times_s))

    @property
    def spread(self) -> float:
        """Interquartile range over median: the point's relative noise."""
        if len(self.times_s) < 4:
            return (max(self.times_s) - min(self.times_s)) / self.median_s
        q = statistics.quantiles(self.times_s, n=4)
        return (q[2] - q[0]) / self.median_s


@dataclass(frozen=True, kw_only=True, slots=True)
class SweepResult:
    points: tuple[SweepPoint, ...]
    stop_reason: str
    """"series end" | "does not fit" | "step limit" | "time budget" | "linear"."""
    oom_batch: int | None = None
    """Smallest batch seen not to fit (None when none failed)."""
    elapsed_s: float = 0.0

    def compute_points(self) -> tuple[ComputePoint, ...]:
        return tuple(ComputePoint(batch_size=p.batch_size, step_time_s=p.median_s) for p in self.points)

    def memory_points(self) -> tuple[MemoryPoint, ...]:
        return tuple(
            MemoryPoint(batch_size=p.batch_size, peak_bytes=p.peak_bytes) for p in self.points if p.peak_bytes is not None
        )

    def fit_residual(self) -> float | None:
        """Largest relative distance of a point from the fitted envelope (what the planner will use)."""
        return fit_envelope(self.compute_points()).max_rel_residual if self.points else None


def geometric_batches(start: int, stop: int, growth: int = 2, *, midpoints: bool = False,
                      end_at_stop: bool = False) -> list[int]:
    """start, start*growth, ... while <= stop; with midpoints also round(1.5*b) between them.  ``end_at_stop``:
    the series ends at ``stop`` itself -- added after the last point, or in its place when within 1.25x of it."""
    out, b = [], start
    while b <= stop:
        out.append(b)
        mid = round(1.5 * b)
        if midpoints and b < mid < b * growth and mid <= stop:
            out.append(mid)
        b *= growth
    if end_at_stop and out and out[-1] < stop:
        if len(out) > 1 and stop < 1.25 * out[-1]:
            out.pop()
        out.append(stop)
    return out


def parse_batch_sizes(text: str | None) -> tuple[int, ...] | None:
    """``"auto"``/None -> None; ``"8,16,32"`` -> (8, 16, 32) sorted and de-duplicated."""
    if text is None or text.strip().lower() == "auto":
        return None
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValidationError(f"--batch-sizes: expected 'auto' or comma-separated integers like 8,16,32, got {text!r}") from None
    if not values or values[0] < 1:
        raise ValidationError(f"--batch-sizes: need positive integers like 8,16,32, got {text!r}")
    return tuple(values)


def repeats_for(predicted_step_s: float, opts: SweepOptions) -> int:
    """Timed steps so a point costs about point_budget_s, within [min_repeats, max_repeats]."""
    if predicted_step_s <= 0:
        return opts.max_repeats
    return max(opts.min_repeats, min(opts.max_repeats, math.ceil(opts.point_budget_s / predicted_step_s)))


def run_sweep(measure: Measure, opts: SweepOptions, *, clock: Callable[[], float],
              on_point: Callable[[SweepPoint], None] | None = None) -> SweepResult:
    """Measure the step time curve (see the module docstring for the policy)."""
    explicit = opts.batch_sizes is not None
    series = list(opts.batch_sizes) if opts.batch_sizes is not None else geometric_batches(
        opts.start_batch, opts.max_batch, opts.growth, midpoints=opts.midpoints, end_at_stop=opts.end_at_max)
    t0 = clock()
    points: list[SweepPoint] = []
    warm = [0.0]  # seconds spent in warm-up steps (not charged to the budget)
    reason, oom = "series end", None
    linear_stop = not explicit and opts.linear_stop_tol is not None
    far: SweepPoint | None = None  # a check beyond a linear tail that found a bend: placed when the series gets there

    def cost_s(b: int) -> float:
        """Predicted cost of a point at b: linear in b from the last point (an over-estimate in a flat region)."""
        last = points[-1]
        step_pred = last.median_s * b / last.batch_size
        return step_pred * (opts.warmup + 1 + repeats_for(step_pred, opts))

    def emit(p: SweepPoint) -> None:
        if on_point is not None:
            on_point(p)

    for b in series:
        if far is not None and b >= far.batch_size:
            points.append(far)
            far = None
            if b == points[-1].batch_size:
                continue
        if not explicit and len(points) >= opts.min_points and clock() - t0 - warm[0] + cost_s(b) > opts.total_budget_s:
            reason = "time budget"
            break
        try:
            point = _measure_point(measure, b, opts, first=not points, clock=clock, warm=warm)
        except DoesNotFit:
            reason, oom = "does not fit", b
            break
        points.append(point)
        emit(point)
        if not explicit and point.median_s > opts.step_limit_s:
            reason = "step limit"
            break
        if linear_stop and opts.linear_stop_tol is not None and linear_tail(points, opts.linear_stop_tol,
                                                                            opts.linear_points):
            # Linear so far; one check far out (linear_check_factor x) before trusting the line beyond: a CPU's
            # caches or a GPU near its memory limit bend the curve up later.
            check = min(opts.max_batch, b * opts.linear_check_factor)
            if check <= b or clock() - t0 - warm[0] + cost_s(check) > opts.total_budget_s:
                reason = "linear"
                break
            try:
                fp = _measure_point(measure, check, opts, first=False, clock=clock, warm=warm)
            except DoesNotFit:
                reason, oom = "does not fit", check
                break
            emit(fp)
            tail = points[-opts.linear_points:]
            slope = (tail[-1].median_s - tail[0].median_s) / (tail[-1].batch_size - tail[0].batch_size)
            line = tail[-1].median_s + slope * (check - tail[-1].batch_size)
            if abs(fp.median_s - line) <= opts.linear_stop_tol * fp.median_s:
                points.append(fp)
                reason = "linear"
                break
            far, linear_stop = fp, False  # it bends: the series goes on as a full sweep would
    if far is not None:
        points.append(far)
    if not explicit and reason == "time budget":
        reason, oom = _leave_flat_part(measure, points, opts, on_point)
    if not explicit and points and len(points) < opts.min_points and reason in ("step limit", "time budget"):
        # A slow device hit the limit early: smaller batches are cheaper and still pin the curve's shape.
        b = points[0].batch_size // opts.growth
        while b >= max(1, opts.min_batch) and len(points) < opts.min_points:
            try:
                probe = measure(b, opts.warmup, opts.min_repeats)
            except DoesNotFit:  # cannot happen below a batch that ran; keep what we have
                break
            points.insert(0, SweepPoint(batch_size=b, times_s=probe.times_s, peak_bytes=probe.peak_bytes))
            emit(points[0])
            b //= opts.growth
    points = remeasure_suspects(measure, points, opts)
    return SweepResult(points=tuple(points), stop_reason=reason, oom_batch=oom, elapsed_s=clock() - t0)


def _floor_s(points: list[SweepPoint]) -> float:
    """The flat part's step time: the median of the three smallest batches' medians (launch-bound points are noisy,
    +-30% on H100 with a loader beside the sweep; their minimum made a noisy 2x look like a bend)."""
    return statistics.median(p.median_s for p in points[:3])


def _slope_pinned(points: list[SweepPoint], opts: SweepOptions) -> bool:
    """The last point is past the flat part (median >= flat_ratio x the smallest) and the last segment is
    nearly proportional (d log t / d log b >= 0.75), i.e. it measures the per-sample slope, not a chord across
    the knee -- a 32..128 chord under-predicted batch 412 by ~10% (H100, ResNet-50 bf16)."""
    last, prev = points[-1], points[-2]
    if last.median_s < opts.flat_ratio * _floor_s(points) or prev.median_s <= 0:
        return False
    return math.log(last.median_s / prev.median_s) >= 0.75 * math.log(last.batch_size / prev.batch_size)


def _leave_flat_part(measure: Measure, points: list[SweepPoint], opts: SweepOptions,
                     on_point: Callable[[SweepPoint], None] | None) -> tuple[str, int | None]:
    """After a budget stop on a flat curve: jumps with min_repeats until the slope is pinned (appends to points)."""
    reason: str = "time budget"
    for _ in range(opts.max_flat_jumps):
        if len(points) < 2 or _slope_pinned(points, opts) or points[-1].batch_size >= opts.max_batch:
            break
        past_bend = points[-1].median_s >= opts.flat_ratio * _floor_s(points)
        b = min(opts.max_batch, points[-1].batch_size * (2 if past_bend else 4))
        try:
            m = measure(b, opts.warmup, opts.min_repeats)
        except DoesNotFit:
            return "does not fit", b
        points.append(SweepPoint(batch_size=b, times_s=m.times_s, peak_bytes=m.peak_bytes))
        if on_point is not None:
            on_point(points[-1])
        reason = "time budget, then past the flat part"
        if points[-1].median_s > opts.step_limit_s:
            break
    return reason, None


def _measure_point(measure: Measure, b: int, opts: SweepOptions, *, first: bool,
                   clock: Callable[[], float] | None = None, warm: list[float] | None = None) -> SweepPoint:
    """One point: warm-up and a timed probe that sets the repeats, then the repeats (early-stopped when the first
    min_repeats agree within spread_stop).  Adds the warm-up's seconds to ``warm[0]``.  Raises DoesNotFit."""
    n_warm = opts.warmup if first or opts.warmup_next is None else opts.warmup_next
    started = clock() if clock is not None else 0.0
    probe = measure(b, n_warm, 1)
    if clock is not None and warm is not None:
        warm[0] += max(0.0, clock() - started - probe.times_s[0])
    n = repeats_for(probe.times_s[0], opts)
    parts = [probe]
    if opts.spread_stop is not None and n > opts.min_repeats:
        # Enough steps to judge the noise first; the rest only where they disagree.
        parts.append(measure(b, 0, opts.min_repeats - 1))
        times = [t for m in parts for t in m.times_s]
        if (max(times) - min(times)) / statistics.median(times) > opts.spread_stop:
            parts.append(measure(b, 0, n - opts.min_repeats))
    elif n > 1:
        parts.append(measure(b, 0, n - 1))
    peaks = [m.peak_bytes for m in parts if m.peak_bytes is not None]
    return SweepPoint(batch_size=b, times_s=tuple(t for m in parts for t in m.times_s),
                      peak_bytes=max(peaks) if peaks else None)


def linear_tail(points: list[SweepPoint], tol: float, n: int = 4) -> bool:
    """True when the last n points are compute-bound and linear: each within `tol` of the line through the first
    and last of them, their repeats within `tol` too, and that line's intercept in [-10%, 25%] of the last step."""
    if n < 3 or len(points) < n:
        return False
    tail = points[-n:]
    (b0, t0), (b1, t1) = (tail[0].batch_size, tail[0].median_s), (tail[-1].batch_size, tail[-1].median_s)
    if b1 <= b0 or t1 <= 0:
        return False
    slope = (t1 - t0) / (b1 - b0)
    intercept = t0 - slope * b0
    if not -0.1 * t1 <= intercept <= 0.25 * t1:
        return False
    return all(abs(p.median_s - (intercept + slope * p.batch_size)) <= tol * p.median_s and p.spread <= tol
               for p in tail)


def suspects(points: list[SweepPoint], tol: float) -> list[int]:
    """Indices of points that look slowed by interference (see the module docstring)."""
    med = [p.median_s for p in points]
    bs = [p.batch_size for p in points]
    out = []
    for i in range(len(points)):
        if i + 1 < len(points) and med[i] > (1 + tol) * med[i + 1]:
            out.append(i)
        elif 0 < i < len(points) - 1:
            # Chord between the neighbours at this batch: a convex curve lies on or below it.
            w = (bs[i] - bs[i - 1]) / (bs[i + 1] - bs[i - 1])
            chord = (1 - w) * med[i - 1] + w * med[i + 1]
            if med[i] > (1 + tol) * chord:
                out.append(i)
    return out


def remeasure_suspects(measure: Measure, points: list[SweepPoint], opts: SweepOptions) -> list[SweepPoint]:
    """Re-time suspect points (up to remeasure_rounds) and keep the lower median of the two measurements."""
    points = list(points)
    for _ in range(opts.remeasure_rounds):
        bad = suspects(points, opts.suspect_tol)
        if not bad:
            break
        for i in bad:
            old = points[i]
            try:
                m = measure(old.batch_size, opts.warmup, max(opts.min_repeats, len(old.times_s)))
            except DoesNotFit:
                continue
            new = SweepPoint(batch_size=old.batch_size, times_s=m.times_s, peak_bytes=old.peak_bytes)
            if new.median_s < old.median_s:
                points[i] = new
    return points


def search_max_batch(fits: Callable[[int], bool], lo_fits: int, hi_fails: int, *, rel_tol: float = 0.05,
                     max_probes: int = 6) -> int:
    """Largest batch that fits, by bisection between a batch known to fit and one known not to.

    Stops when the bracket is within rel_tol of lo or after max_probes steps (each probe is a full training
    step, possibly an out-of-memory one); returns the largest batch seen to fit.
    """
    assert 1 <= lo_fits < hi_fails, (lo_fits, hi_fails)
    lo, hi = lo_fits, hi_fails
    for _ in range(max_probes):
        if hi - lo <= max(1, int(rel_tol * lo)):
            break
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo

