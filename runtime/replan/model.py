"""The correction model: what measured epochs teach about each rank's compute curve and loader (pure).

Rank i ran batch b_i and measured mean compute c_i, data wait d_i, step time s_i:

    raw_i     = c_i / t0_i(b_i)                    t0_i = envelope fitted to the ORIGINAL profile's points
    m_i       = t_i(b_i) / t0_i(b_i)               the model's ratio at b_i before this epoch (1 at the start)
    factor_i <- (1 - a) * m_i + a * raw_i          EMA in the model's terms, a = `smoothing` (DEFAULT_SMOOTHING =
                                                   0.8); the model starts at the profile (trust it as much as one
                                                   epoch), so one noisy epoch moves it only part of the way
    A_i       = b_i                                the factor is the ratio at this anchor, the newest batch size

The factor is spread over the curve by the original curve's local elasticity at the anchor (``UniformCorrection``):

    eps   = t0'(A) * A / t0(A)             in [0, 1]: 1 on a curve linear through the origin, 0 on a flat one
    e     = (factor - 1) * t0(A)           the seconds the rank ran over its profile at A
    t(x)  = t0(x) + e * (eps * t0(x) / t0(A) + (1 - eps) * x / A)     e > 0: slower than profiled
    t(x)  = factor * t0(x)                                            e <= 0: faster

Why: a rescaled curve stays flat where the profile is flat, so moving samples off a slowed rank whose curve is flat
at its batch predicts no gain -- a rank 4 ms a sample slower, on a profile flat at small batches, was never moved
over 7 slow epochs (predicted gains -0.1% to 1%).  Where the curve is flat the excess can only be a cost per sample
(the floor is the launch-bound part, which a per-sample sleep or a transform in the loop does not touch); where it
is linear through the origin every cost is per sample and a uniform factor is the same thing; in between the excess
is split by the share of the time that grows with the batch.  Both forms pass through the measurement,
t(A) = factor * t0(A).  Faster than profiled stays multiplicative: a per-sample credit would go below the floor,
and below zero at large batches.  The EMA mixes in the model's ratio at the new batch (m_i), not the old factor:
the factor is a ratio at one anchor, and on a flat curve it says another thing at another batch size (the old
factor, 4.6x at batch 5, blended with a 1.8x measured at batch 1 said the rank was 2.4x slow at batch 1).

A device change replaces the factor instead: raw_i at least 1.5x (or at most 1/1.5x) what the model said at that
batch -- 2x at a batch size not measured before, where the shape correction below may explain up to that -- and more
than 10 standard errors of the epoch's mean away (``DEVICE_CHANGE``, ``CHANGE_SIGMAS``) means the device itself changed
(a slowdown, a co-tenant arriving or leaving), so the smoothed history describes the old device: factor_i <- raw_i,
and the rank's observations below restart from this one.  At a batch size the rank ran before, 10% off the ratio it
measured there (and 10 standard errors) is a device change too (``same_batch_changed``): no curve shape moves one
batch size's time between epochs, and a co-tenant at half duty (about 1.3x) would otherwise take the EMA an extra
epoch to follow (2x H200, own loop, a co-tenant joining GPU 0: the 9.5% gain was adopted 3 epochs after the join).
In the run logs under tests/data 27 of 192 same-batch rank-epoch pairs clear this rule: slowdowns and co-tenant joins,
loader-bound ranks whose compute moves with their loaders, and first epochs' warm-up; for each, the factor moves the
last 20% the EMA would have left.  Epoch-to-epoch noise does not come near the 1.5x bound (2% jitter):
of 500 consecutive rank-epoch pairs at one split in the recorded launches (raw files in git history), six clear it, four of them
real 3x slowdowns (the mid-run cases) and two a loader-bound rank's small compute.

Shape correction: a profile's curve can be right at one batch size and off in slope elsewhere -- e.g. near the
knee where a launch-bound GPU turns compute-bound, a uniformly rescaled curve then sends too much work to a rank
(measured on 2x H200, ResNet-50, emulated 3x rank: the re-plan moved 38 samples and the step got 4% slower).
So once a rank has been measured at two different batch sizes b1 < b2 (times c1 < c2; the latest measurement
at each of the two most recent batch sizes; a batch size measured >10% off its previous time clears the history),
with raw ratios r1, r2 within a factor 2 of each other (beyond that the device itself changed, e.g. a
co-tenant came, and the uniform factor above applies), each original point time t becomes

    alpha * t + beta      alpha, beta: the affine map of the original curve through (b1, c1) and (b2, c2)
    r1 * t  for b <= b1   when beta <= 0 (truly steeper than profiled), else
    r2 * t  for b >= b2   (truly flatter)

which passes through both measurements, stays convex and positive, and keeps the profile's shape beyond them.
Where the envelope does not rise between b1 and b2 (flat there) there is no slope to map, and the uniform
correction above, anchored at the newest of the two, applies.

Every correction is a function of the envelope's time, and the profile's points take it as a ratio on the envelope
(``CorrectionModel.corrected_profile``):

    point (b, t)  ->  (b, t * t_i(b) / t0_i(b))      t_i: the corrected time at t0_i(b)

The envelope is positive and non-decreasing, so every correction gives a positive time on it: r1 * t0 and r2 * t0;
alpha * t0(b) + beta >= alpha * t0(b1) + beta = c1 > 0 for b > b1 when beta <= 0 (alpha > 0 as c2 > c1), and
alpha * t0 + beta > 0 when beta > 0; the uniform form adds e >= 0 or multiplies by factor > 0.  So no corrected
point is zero, negative, NaN or inf.  Applied to a measured point itself, alpha * t + beta went negative at a point
b > b1 measured below t0(b1) -- measured points need not be monotone, the envelope pools them -- and the re-plan
raised a ValidationError.  A ratio that is still not finite and positive falls back to the rank's factor, then 1.

Loader: p_i starts as the planner's effective cost per sample per worker at the host's training load
(``planner.loader.loader_costs_s``: the measured scaling curve under contention).  When d_i / s_i >
`loader_wait_frac` the loader did not keep up: it paced the step, so with w_i workers the rank ran one step per
b_i * p_i / w_i seconds, which is its whole step time s_i (not c_i + d_i: the all-reduce and optimizer tail
after the last bucket runs while the workers keep loading -- on 2x H100 that tail was 36 ms of a 179 ms step),

    p_i = s_i * w_i / b_i      (w_i >= 1)        p_i = d_i / b_i      (w_i = 0: loaded in the loop)

smoothed the same way and only ever raised by it (a loader that keeps up hides its true cost, so a small wait
is no evidence that it got faster).  Where the workers timed their own batches (``StepStats.loader_s``,
runtime.loader_timing) that time is the cost itself, p_i = loader_s_i / b_i, and moves p_i both ways (smoothed
alike) before the wait rule above may still raise it: their timing misses the main process's share.

Hand-over: when those timed workers kept up (their period at most ``WORKERS_KEPT_UP`` of the step) and the rank
still waited, the batches reached the loop slower than they were built -- the training process's pinning thread
copying each one once more.  The wait is then the hand-over's: the rank's hand-over cost per sample (h_i, from
``planner.loader.handover_costs_s``: sample bytes over the profile's pinning rate) is raised instead of p_i,

    h_i <- max(h_i, (1 - a) * h_i + a * s_i / b_i)      (one batch handed over per step)

Charged to the workers, such a wait made every split look loader-bound (2x H100, plan [495, 17]: rank
0's 29 workers built a batch every 114-120 ms while its 298 MB batches arrived every 143-157 ms; the Replanner
raised the host's loader cost and predicted 0-4% for moving work to rank 1, where [394, 118] had run 121-124 ms in
another launch).

Spans under DDP: c_i is the rank's compute span (forward start to its last gradient bucket), which under DDP runs
longer than the standalone step it is compared with, less its optimizer step (the backward shares the device with
the earlier buckets' all-reduce).  Where the profile measured that (``CommProfile.span_factors`` f_i, DDP only), c_i
first becomes the standalone step it stands for, c_i / f_i + opt_i, so the corrected curves stay standalone curves
and the plan's exposed communication is not counted twice (2x H200: without the mapping the Replanner
predicted 88-89 ms for steps that ran 86.8).

Waiting ranks: under DDP a rank that finishes its backward before a slower peer launches the all-reduce of each
early bucket and the kernel then sits on some of its SMs until the peer's bucket arrives, so its own backward runs
slower the longer it waits: beyond the span factor the profile measured at a balanced split.  2x H200, a co-tenant
joining the fast GPU 0: rank 1's span rose from 64.5 to 68-70 ms at the same batch while it waited 16 ms a step
for rank 0; read as rank 1 slowing down, the model predicted the balancing split 3.7-5.9% faster where it ran 11%
faster, and missed the 5% threshold in one launch of three.  So a rank whose busy time (span plus data wait) is
more than ``WAITED_MARGIN`` under the slowest rank's may lower its curve, never raise it; once work moves to it,
it is no longer waiting and its measurement counts in full.

Micro-steps: a rank that ran its batch b_i as k_i > 1 micro-steps measured one span over all of them (the
optimizer step o_i after it), which the plan predicted as k_i (t_i(b_i / k_i) - o_i) + o_i (planner._accumulation).
The measurement is taken back to the standalone step at the micro-batch it ran, c_i' = (c_i - o_i) / k_i + o_i at
b_i / k_i, and the rules above learn from that: the curve is corrected where the rank actually runs, and a plan
with accumulation (``mode="ddp"`` or ``"fsdp"``) is re-predicted as it executes, not as one step of b_i.

Exposed communication: the ranks' corrections explain each rank's busy time, not what the step spends after the
slowest rank is done -- the all-reduce's exposed tail, which the profile measured once in a quiet DDP loop.  When
that changes (gloo reduces on the CPU: a CPU hog on one rank's cores made the all-reduce of a ResNet-50 between two
ranks sharing an H200 take about 75 ms a step where the profile measured 10), no rank's curve holds the excess, and
every prediction missed by the same seconds (one H200, two gloo ranks, the hog from epoch 3: the adopted split ran
136-156 ms a step on a predicted 104-114, three launches).  So after each epoch's rank corrections, the step the split
measured (S, slowest rank) is compared with the model's prediction for that same split (T, batches, micro-steps and
workers as run), and the rest is learned as extra exposed communication x, the same at every split:

    x <- max(0, x + a * (S - T))      a = ``smoothing``, 1 in an epoch that starts a new era (the ranks changed)

and every plan the model evaluates adds x to the profile's exposed term (``planner.solve.with_exposed_comm_s``).
It moves every prediction by the same seconds, so it never moves the split by itself, but it shrinks the gain a
rebalancing can offer when the step is mostly communication, and it makes the prediction a kept plan is re-made
with the step the run measures.  Never below the profile's term: a step shorter than predicted is the ranks' curves
or loaders over-predicted (their own corrections' business) or a loader that hides the all-reduce behind its
period, and a negative x would under-predict every split where no loader hides it.  Replayed on the three launches
above, the predictions in force from the second epoch after the adoption were 0-10% off (median 3%; without it,
32-56%), with the same decisions (tests/runtime/test_replan_exposed.py replays one of them).

The corrected compute points, loader costs and hand-over rates form a new ``planner.Profile``
(``CorrectionModel.corrected_profile``; a loader p_i times its starting value has its sec_per_sample and its
measured rates scaled by that factor, ``planner.loader.scaled_loader``; a raised h_i sets the rank's
``handover_bytes_per_s`` to sample_bytes / h_i): the profile in use stays the one source of truth for the solver.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from planner.comm_model import applied_span_factors, span_under_ddp_s, standalone_step_s
from planner.curves import Envelope, fit_envelope
from planner.loader import handover_costs_s, loader_costs_s, scaled_loader
from planner.options import SolveOptions
from planner.profile import LoaderProfile, Profile
from planner.solve import exposed_comm_s, with_exposed_comm_s
from planner.stats import WORKERS_KEPT_UP, StepStats

DEFAULT_SMOOTHING = 0.8
"""EMA weight of the newest epoch.  Chosen from tests/runtime/test_replan.py's two opposing checks, re-run at
a = 0.5 ... 1.0: on the 60 random profiles with slope/floor errors (seeds 2026, 7, 11) the mean step time over
12 epochs improves as a grows (0.915 / 0.898 / 0.900 of the first plan's at 0.5, 0.910 / 0.893 / 0.895 at 0.8,
0.904 / 0.883 / 0.888 at 1.0), but at 1.0 the safety fails: one case ends 1.4% slower than never re-planning,
and on noise alone (2% epoch jitter, 100 seeds) one run adopts 3 plans in 10 epochs.  0.8 passes both with margin
(no churn, scale factors within 4.1% of 1 under noise), closes 96% of the gap to a real change in two epochs
(0.5: 75%), and is what the trainer has run."""
SHAPE_MAX_LOG = math.log(2.0)
"""Two measured ratios further apart than 2x mean the device changed, not the curve's shape (a knee between a
launch-bound floor and the linear part can make them differ by 1.5x)."""
SAME_BATCH_CHANGE = math.log(1.10)
"""The same batch size measured more than 10% off its last time: the device changed; its history is dropped."""

DEVICE_CHANGE = math.log(1.5)
"""A rank's compute at least 1.5x, or at most 1/1.5x, what its model says, far beyond the epoch's own noise
(``CHANGE_SIGMAS``): the device itself changed -- a slowdown, a co-tenant arriving or leaving -- and the smoothed
factor's history describes the old device.  The newest epoch then replaces it, instead of moving it ``smoothing``
of the way (2x H100, rank 1 3x slower from epoch 1: with smoothing the factor went from 1.0-1.4 to 2.6 on a measured
2.95, the adopted split ran 117-123 ms a step on a predicted 103-105, and a second re-plan was needed two epochs
later; replayed with this rule the first re-plan goes straight to [377-384, 128-135], where the second one went)."""
CHANGE_SIGMAS = 10.0
"""How far beyond the epoch mean's relative standard error a device change must lie (``DEVICE_CHANGE``)."""


WAITED_MARGIN = 0.05
"""A rank whose busy time is more than this fraction under the slowest rank's waited for it (module docstring,
"Waiting ranks"): its span under DDP is an upper bound of its compute."""


def device_changed(raw: float, expected: float, s: StepStats, *, seen: bool) -> bool:
    """Whether a rank's measured ratio ``raw`` says its device changed, against the ratio its model ``expected`` at
    that batch (the shape correction's where one is in force, else the uniform factor: ``DEVICE_CHANGE``).  At a batch
    size not measured before (``seen`` False) a curve's shape may be off by up to ``SHAPE_MAX_LOG`` (2x), which the
    shape correction is there to learn: only a larger jump is a changed device there."""
    return _jumped(raw, expected, DEVICE_CHANGE if seen else max(DEVICE_CHANGE, SHAPE_MAX_LOG), s)


def same_batch_changed(raw: float, before: float, s: StepStats) -> bool:
    """Whether a rank's ratio ``raw`` at a batch size it ran before (ratio ``before`` there) moved by more than
    ``SAME_BATCH_CHANGE`` (10%) and ``CHANGE_SIGMAS`` standard errors of the epoch's mean: at an unchanged batch no
    curve shape explains it, so the device changed (a co-tenant at half duty slows a GPU ~1.3x, under
    ``DEVICE_CHANGE``), and the factor takes the new epoch whole instead of ``smoothing`` of the way."""
    return _jumped(raw, before, SAME_BATCH_CHANGE, s)


def _jumped(raw: float, ref: float, bound: float, s: StepStats) -> bool:
    """``raw`` more than ``bound`` (a log ratio) from ``ref`` and more than ``CHANGE_SIGMAS`` standard errors of the
    epoch's mean compute away."""
    if not (raw > 0 and ref > 0) or abs(math.log(raw / ref)) <= bound:
        return False
    rel_se = s.compute_s_std / math.sqrt(max(1, s.num_steps)) / s.compute_s if s.compute_s > 0 else math.inf
    return abs(raw / ref - 1.0) > CHANGE_SIGMAS * rel_se


TimeMap = Callable[[float, float], float]
"""f(batch_size, t): the model's time at ``batch_size`` for a point the original profile gave time ``t``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Observation:
    """One epoch's raw measurement of a rank, relative to the original profile."""

    batch_size: int
    ratio: float
    """Measured compute time over the original curve's time at ``batch_size`` (raw_i above, not smoothed)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ShapeCorrection:
    """The two-point correction of one rank: the affine map through two measurements, ratios beyond them."""

    b1: int
    b2: int
    """The two measured batch sizes, b1 < b2."""
    r1: float
    r2: float
    """Measured / original-curve ratio at b1 and at b2."""
    alpha: float
    beta: float
    """t -> alpha * t + beta maps the original curve's times at b1, b2 onto the measured ones."""

    def time_at(self, batch_size: float, t: float) -> float:
        """The corrected time at ``batch_size`` whose envelope time is ``t`` (positive for every envelope time:
        module docstring; not for an arbitrary measured point below t0(b1))."""
        if self.beta <= 0:  # steeper than profiled: the affine map above b1, the ratio at b1 below (convex at b1)
            return self.r1 * t if batch_size <= self.b1 else self.alpha * t + self.beta
        # Flatter: the affine map below b2, the ratio at b2 above (a positive beta would keep adding beyond b2).
        return self.alpha * t + self.beta if batch_size <= self.b2 else self.r2 * t


def elasticity(envelope: Envelope, batch_size: float) -> float:
    """eps = t0'(b) * b / t0(b) in [0, 1] (module docstring): 0 where the curve is flat at ``batch_size``, 1 where it
    is linear through the origin.  The slope is the left one at a knee: a slower rank's samples move down."""
    t = envelope(batch_size)
    if not (t > 0 and math.isfinite(t)):
        return 1.0
    active = [s for s, c in zip(envelope.slopes, envelope.intercepts, strict=True)
              if s * batch_size + c >= t * (1.0 - 1e-12)]
    slope = min(active) if active else max(envelope.slopes)
    return min(1.0, max(0.0, slope * batch_size / t))


@dataclass(frozen=True, kw_only=True, slots=True)
class UniformCorrection:
    """One rank's correction from its factor at one anchor batch size (module docstring): per-sample where the
    original curve is flat at the anchor, multiplicative where it is linear through the origin."""

    scale: float
    """The model's ratio at the anchor (measured over original)."""
    anchor: float | None = None
    """The batch size the factor was measured at (None: not known, a state written before it was kept -- the
    factor then applies multiplicatively, as it did)."""
    t_anchor: float = 0.0
    """t0(anchor)."""
    eps: float = 1.0
    """The original curve's elasticity at the anchor."""

    @classmethod
    def of(cls, scale: float, anchor: float | None, envelope: Envelope) -> UniformCorrection:
        if anchor is None or not scale > 1.0:
            return cls(scale=scale)
        return cls(scale=scale, anchor=anchor, t_anchor=envelope(anchor), eps=elasticity(envelope, anchor))

    def time_at(self, batch_size: float, t: float) -> float:
        if self.anchor is None or not self.t_anchor > 0:
            return self.scale * t
        e = (self.scale - 1.0) * self.t_anchor  # > 0: the excess seconds at the anchor
        # t(x) = t0(x) + e * (eps * t0(x) / t0(A) + (1 - eps) * x / A)
        return t + e * (self.eps * t / self.t_anchor + (1.0 - self.eps) * batch_size / self.anchor)


def shape_correction(observations: Sequence[Observation], envelope: Envelope) -> ShapeCorrection | None:
    """The two-point correction from a rank's observations, or None when the uniform factor applies."""
    if len(observations) != 2 or observations[0].batch_size == observations[1].batch_size:
        return None
    lo, hi = sorted(observations, key=lambda o: o.batch_size)
    b1, r1, b2, r2 = lo.batch_size, lo.ratio, hi.batch_size, hi.ratio
    if abs(math.log(r1 / r2)) > SHAPE_MAX_LOG:
        return None  # the device changed between the two epochs: the newest uniform factor is the better guess
    t1, t2 = envelope(b1), envelope(b2)
    c1, c2 = r1 * t1, r2 * t2
    if not (t2 > t1 and c2 > c1):
        return None  # no slope to learn from (flat curve, or noise reversed the order)
    alpha = (c2 - c1) / (t2 - t1)
    return ShapeCorrection(b1=b1, b2=b2, r1=r1, r2=r2, alpha=alpha, beta=c1 - alpha * t1)


@dataclass(frozen=True, kw_only=True, slots=True)
class RankCorrection:
    """What the measured epochs taught about one rank (all of the model's state for that rank)."""

    scale: float = 1.0
    """EMA of raw_i: compute time relative to the original profile (1.0 = the profile as measured)."""
    loader_sec_per_sample: float = 0.0
    """The loader cost in use: the profile's, moved to the workers' measured cost, raised when the loader did not
    keep up."""
    observations: tuple[Observation, ...] = ()
    """The latest observation at each of the two most recent batch sizes, oldest first."""
    handover_s: float = 0.0
    """Seconds per sample the training process takes to hand a built batch to the loop (0: not measured): the
    profile's, raised when the workers kept up and the rank still waited for data."""

    def time_map(self, envelope: Envelope) -> TimeMap:
        """This rank's correction as f(batch_size, t) (see ``TimeMap``; ``t`` an envelope time): the shape correction
        once two batch sizes were measured, else the uniform correction at the newest one; ``envelope`` is the
        rank's original curve."""
        shape = shape_correction(self.observations, envelope)
        if shape is not None:
            return shape.time_at
        anchor = self.observations[-1].batch_size if self.observations else None
        return UniformCorrection.of(self.scale, anchor, envelope).time_at

    def updated(self, s: StepStats, envelope: Envelope, *, smoothing: float,
                loader_wait_frac: float, micro_steps: int = 1, optimizer_s: float = 0.0) -> RankCorrection:
        """This rank after one more epoch of (already checked: finite, positive) stats, run as ``micro_steps``
        micro-steps per optimizer step (module docstring: the compute is learned at the micro-batch)."""
        return self.updated_and_changed(s, envelope, smoothing=smoothing, loader_wait_frac=loader_wait_frac,
                                        micro_steps=micro_steps, optimizer_s=optimizer_s)[0]

    def updated_and_changed(self, s: StepStats, envelope: Envelope, *, smoothing: float, loader_wait_frac: float,
                            micro_steps: int = 1, optimizer_s: float = 0.0) -> tuple[RankCorrection, bool]:
        """``updated``, and whether the epoch showed a device change (``device_changed`` / ``same_batch_changed``:
        the rank's speed changed beyond the noise, which the Replanner's memory of measured splits must know)."""
        a = smoothing
        k = max(1, int(micro_steps))
        batch = s.batch_size / k
        compute = s.compute_s if k == 1 else max((s.compute_s - optimizer_s) / k + optimizer_s, 1e-12)
        t0 = envelope(batch)
        raw = compute / t0
        b = max(1, round(batch))
        same = [o.ratio for o in self.observations if o.batch_size == b]
        expected = self.time_map(envelope)(batch, t0) / t0  # m_i: the model's ratio at this batch
        changed = device_changed(raw, expected, s, seen=bool(same)) or (
            bool(same) and same_batch_changed(raw, same[0], s))
        if changed or (same and abs(math.log(raw / same[0])) > SAME_BATCH_CHANGE):
            # The old device's shape is gone, or what this batch size showed no longer holds: restart from here.
            obs: tuple[Observation, ...] = (Observation(batch_size=b, ratio=raw),)
        else:
            others = [o for o in self.observations if o.batch_size != b]
            obs = (*others[-1:], Observation(batch_size=b, ratio=raw))
        spp, handover = self.loader_sec_per_sample, self.handover_s
        if s.loader_s is not None and s.batch_size > 0 and s.loader_s > 0:
            # Measured in the workers: the cost itself, up or down (runtime.loader_timing).
            spp = (1.0 - a) * spp + a * s.loader_s / s.batch_size
        if s.step_time_s > 0 and s.data_wait_s / s.step_time_s > loader_wait_frac:
            period = s.loader_period_s
            if handover > 0 and s.num_workers > 0 and period is not None and period <= WORKERS_KEPT_UP * s.step_time_s:
                # The workers kept up: the hand-over paced the step (module docstring), one batch per step.
                handover = max(handover, (1.0 - a) * handover + a * s.step_time_s / s.batch_size)
            else:
                if s.num_workers > 0:
                    seen = s.step_time_s * s.num_workers / s.batch_size
                else:
                    seen = s.data_wait_s / s.batch_size
                spp = max(spp, (1.0 - a) * spp + a * seen)  # only raised: see the module docstring
        # The EMA in the model's terms at this batch (module docstring); a changed device takes the epoch whole.
        scale = raw if changed or not (math.isfinite(expected) and expected > 0) else (1.0 - a) * expected + a * raw
        return RankCorrection(scale=scale, loader_sec_per_sample=spp, observations=obs,
                              handover_s=handover), changed


@dataclass(frozen=True, kw_only=True, slots=True)
class CorrectionModel:
    """The original profile plus each rank's correction; ``updated`` returns a new model, nothing is mutated."""

    base: Profile
    """The profile the first plan was solved from (the curves' shape; never modified)."""
    envelopes: tuple[Envelope, ...] = field(compare=False)
    """t0_i: the envelope of each rank's original points, by rank id (fitted once per profile)."""
    ranks: tuple[RankCorrection, ...]
    """By rank id."""
    loader_costs_s: tuple[float, ...] = ()
    """p_i of the original profile as the planner models it (by rank id; empty: each loader's sec_per_sample)."""
    spans: tuple[tuple[float, float], ...] = ()
    """(f_i, optimizer seconds) by rank id where the profile measured each rank's span under DDP (module docstring);
    empty: the measured compute is taken as the standalone step."""
    optimizer_s: tuple[float, ...] = ()
    """o_i by rank id (the profile's optimizer_step_s, 0 where unmeasured): charged once per optimizer step when a
    rank runs micro-steps (module docstring); empty: 0 for every rank."""
    mode: str = "ddp"
    """The run's data-parallel mode (``SolveOptions.mode``): which exposed-communication term its plans read."""
    exposed_extra_s: float = 0.0
    """x: the exposed communication measured beyond the profile's, >= 0 (module docstring, "Exposed
    communication")."""

    @classmethod
    def of(cls, profile: Profile, options: SolveOptions | None = None,
           workers: Sequence[int] | None = None) -> CorrectionModel:
        """The model before any measurement: the profile as it is, its loaders as the planner models them under
        ``options`` (worker caps and CPU reserve; default ``SolveOptions()``) with ``workers`` (by rank: the plan's,
        whose load the measured loaders run under; default the budget split equally)."""
        by_rank = profile.by_rank
        opts = options or SolveOptions()
        costs = tuple(loader_costs_s(profile, opts, workers=workers))
        factors = applied_span_factors(profile, opts.mode)
        spans = () if factors is None else tuple(
            (f, r.optimizer_step_s or 0.0) for f, r in zip(factors, by_rank, strict=True))
        return cls(base=profile, envelopes=tuple(fit_envelope(r.compute) for r in by_rank),
                   ranks=tuple(RankCorrection(loader_sec_per_sample=c, handover_s=h)
                               for c, h in zip(costs, handover_costs_s(profile), strict=True)),
                   loader_costs_s=costs, spans=spans,
                   optimizer_s=tuple(r.optimizer_step_s or 0.0 for r in by_rank), mode=opts.mode)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def scale_factors(self) -> tuple[float, ...]:
        return tuple(r.scale for r in self.ranks)

    @property
    def loader_sec_per_sample(self) -> tuple[float, ...]:
        return tuple(r.loader_sec_per_sample for r in self.ranks)

    def time_map(self, rank: int) -> TimeMap:
        """The rank's correction as f(batch_size, t) (see ``TimeMap``)."""
        return self.ranks[rank].time_map(self.envelopes[rank])

    def compute_s(self, rank: int, batch_size: float) -> float:
        """The model's compute time of ``rank`` at ``batch_size``."""
        return self.time_map(rank)(batch_size, self.envelopes[rank](batch_size))

    def opt_s(self, rank: int) -> float:
        return self.optimizer_s[rank] if self.optimizer_s else 0.0

    def span_s(self, rank: int, batch_size: float, micro_steps: int = 1) -> float:
        """The model's compute span of ``rank`` at ``batch_size`` under DDP, what its step timer reads (module
        docstring); ``compute_s`` where the profile did not measure the span.  With ``micro_steps`` k > 1, the
        plan's prediction of the k micro-steps, k (t(b / k) - o) + o (the plan's, ``RankPlan.timer_busy_s``)."""
        if micro_steps > 1:
            o = self.opt_s(rank)
            return micro_steps * (self.compute_s(rank, batch_size / micro_steps) - o) + o
        t = self.compute_s(rank, batch_size)
        if not self.spans:
            return t
        f, opt = self.spans[rank]
        return span_under_ddp_s(t, opt, f)

    def ratio(self, rank: int, batch_size: float) -> float:
        """The model's time over the original curve's at ``batch_size``."""
        return self.compute_s(rank, batch_size) / self.envelopes[rank](batch_size)

    def updated(self, by_rank: Sequence[StepStats], *, smoothing: float, loader_wait_frac: float,
                micro_steps: Sequence[int] | None = None) -> CorrectionModel:
        """The model after one epoch; ``by_rank[i]`` is rank i's checked stats, run as ``micro_steps[i]``
        micro-steps per optimizer step (default one each)."""
        return self.updated_and_changed(by_rank, smoothing=smoothing, loader_wait_frac=loader_wait_frac,
                                        micro_steps=micro_steps)[0]

    def updated_and_changed(self, by_rank: Sequence[StepStats], *, smoothing: float, loader_wait_frac: float,
                            micro_steps: Sequence[int] | None = None) -> tuple[CorrectionModel, tuple[int, ...]]:
        """``updated``, and the ranks whose epoch showed a device change (``RankCorrection.updated_and_changed``)."""
        assert len(by_rank) == self.world_size and all(s.rank == i for i, s in enumerate(by_rank))
        steps = list(micro_steps) if micro_steps is not None else [1] * self.world_size
        if self.spans:  # a span under DDP stands for the standalone step c / f + opt (module docstring)
            busy = [s.compute_s + s.data_wait_s for s in by_rank]
            by_rank = [s if k > 1 else replace(s, compute_s=standalone_step_s(s.compute_s, opt, f))
                       for s, (f, opt), k in zip(by_rank, self.spans, steps, strict=True)]
            # A rank that waited for a slower peer (module docstring, "Waiting ranks"): its span holds part of the
            # wait, so it may lower the rank's curve, never raise it.
            top = max(busy)
            by_rank = [replace(s, compute_s=min(s.compute_s, self.compute_s(i, s.batch_size)))
                       if k == 1 and b < top * (1.0 - WAITED_MARGIN) else s
                       for i, (s, b, k) in enumerate(zip(by_rank, busy, steps, strict=True))]
        done = [r.updated_and_changed(s, env, smoothing=smoothing, loader_wait_frac=loader_wait_frac,
                                      micro_steps=k, optimizer_s=self.opt_s(i))
                for i, (r, s, env, k) in enumerate(zip(self.ranks, by_rank, self.envelopes, steps, strict=True))]
        return (replace(self, ranks=tuple(r for r, _ in done)),
                tuple(i for i, (_, changed) in enumerate(done) if changed))

    def with_exposed_miss(self, miss_s: float, weight: float) -> CorrectionModel:
        """The model after one more measured step miss ``miss_s`` = measured step - this model's step at the split
        that ran (module docstring, "Exposed communication"): x <- max(0, x + weight * miss)."""
        if self.world_size < 2 or not math.isfinite(miss_s):
            return self
        return replace(self, exposed_extra_s=max(0.0, self.exposed_extra_s + weight * miss_s))

    def _point_ratio(self, rank: int) -> Callable[[float], float]:
        """t_i(b) / t0_i(b) as a function of b, finite and positive: a correction that is not (never expected:
        module docstring) falls back to the rank's factor, then to 1, rather than hand the solver a bad curve."""
        f, env = self.time_map(rank), self.envelopes[rank]
        scale = self.ranks[rank].scale
        fallback = scale if math.isfinite(scale) and scale > 0 else 1.0

        def ratio(b: float) -> float:
            t = env(b)
            r = f(b, t) / t if t > 0 and math.isfinite(t) else fallback
            return r if math.isfinite(r) and r > 0 else fallback
        return ratio

    def with_ranks(self, ranks: Sequence[RankCorrection]) -> CorrectionModel:
        """The same profile with restored corrections (a checkpoint's)."""
        assert len(ranks) == self.world_size
        return replace(self, ranks=tuple(ranks))

    def corrected_profile(self) -> Profile:
        """The original profile with each rank's compute points corrected and loader costs raised as measured."""
        ratios = [self._point_ratio(i) for i in range(self.world_size)]  # one correction per rank, not per point
        # point (b, t) -> (b, t * t_i(b) / t0_i(b)): the correction taken on the envelope (module docstring)
        profile = self.base.with_compute_times(lambda rank, b, t: t * ratios[rank](b))
        start = self.loader_costs_s or tuple(_loader_spp(r.loader) for r in self.base.by_rank)
        raised = {i for i, (p0, c) in enumerate(zip(start, self.ranks, strict=True)) if c.loader_sec_per_sample != p0}
        handed = {i for i, (h0, c) in enumerate(zip(handover_costs_s(self.base), self.ranks, strict=True))
                  if c.handover_s != h0 and c.handover_s > 0}
        if self.exposed_extra_s > 0:
            profile = with_exposed_comm_s(profile, exposed_comm_s(self.base, self.mode) + self.exposed_extra_s,
                                          self.mode)[0]
        if not raised and not handed:
            return profile
        ranks = []
        for r in profile.ranks:
            loader = r.loader
            if r.rank in raised:
                loader = _raised(loader, start[r.rank], self.ranks[r.rank].loader_sec_per_sample)
            if r.rank in handed and loader is not None and loader.sample_bytes:
                loader = replace(loader, handover_bytes_per_s=loader.sample_bytes / self.ranks[r.rank].handover_s)
            ranks.append(r if loader is r.loader else replace(r, loader=loader))
        return replace(profile, ranks=tuple(ranks))


def _loader_spp(loader: LoaderProfile | None) -> float:
    return loader.sec_per_sample if loader is not None else 0.0


def _raised(loader: LoaderProfile | None, start: float, spp: float) -> LoaderProfile:
    """The loader whose modelled cost moved from ``start`` to ``spp`` (its scaling and worker cap kept)."""
    if loader is None or start <= 0:
        return LoaderProfile(sec_per_sample=spp) if loader is None else replace(loader, sec_per_sample=spp)
    if not loader.scaling:  # no curve: the cost is sec_per_sample itself (set, not scaled: no rounding on the way)
        return replace(loader, sec_per_sample=spp)
    return scaled_loader(loader, spp / start)
