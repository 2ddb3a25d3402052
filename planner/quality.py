"""The profile-quality gate: can a plan made from this profile be trusted?

A profile taken on a busy machine can hold junk -- on a shared 2-core box one rank recorded 808 ms at batch 4,
49 ms at batch 8 and 847 ms at batch 16 -- and the solver, which believes every point, then splits two identical
CPUs 11 / 53 and predicts 2.76x.  This module looks at what the profiler recorded and says, one line per problem
with its numbers and the fix, what makes the profile untrustworthy:

  repeat spread   the repeats of one batch size disagree (IQR / median, from ``meta.sweep_spread``) by > 50%;
  fit residual    a point is > 35% away from the convex curve the solver uses (``planner.curves``);
  non-monotone    a batch is > 1.5x slower than the next larger one (a larger batch never takes less time);
  implausible     the step time grows > 2x faster than the batch between two points (work grows with the batch,
                  at most about linearly);
  identical       two ranks with the same device (name, threads, emulation) measured > 1.5x apart;
  DDP overhead    the synchronization cost measured in rounds (``meta.ddp_overhead_rounds_s``) varies by more
                  than half its median and by more than 10% of a step.

The thresholds sit well above what clean profiles show: on 2x H200 (tests/data) the worst repeat spread was
34%, the worst fit residual 27% and the worst drop to a larger batch 22%, all in a launch-bound flat region.

The first four measure the noise of the compute curves -- repeat spreads as the typical error of a point (the
median over points of spread / sqrt(repeats): a point is a median, and one disturbed point does not move a curve
fitted through all of them); the others as the relative error they show -- and the largest is the profile's
``noise_frac``: a plan whose predicted gain over the equal split is smaller than that is inside the profile's own
noise, and ``keep_equal_within_noise`` keeps the equal split and records why.  Each of them says the largest batch
its evidence touches (``QualityIssue.batch_size``), and a plan is judged only by the issues at batch sizes it or the
equal split runs (``ProfileQuality.noise_for``: down to ``RELEVANT_FRACTION`` of the smaller of the two): a small
batch's launch-bound jitter says nothing of a step 10x longer (4x H100, one of three default 4-rank
ResNet-50 profiles: batches 8-24 off the curve by 43% and 1.6x out of order, 16-31 ms steps beside the loader
measurement, while a 1.6x slower rank's plan ran batches of 173-294 -- the whole profile's noise would have kept the
equal split against a predicted 44% gain).  Identical devices measured apart may
be real (a co-tenant, throttling), and the DDP overhead adds to every split alike, so those two only warn.

Pure: functions of Profile and Plan, no I/O; callers print ``warning_lines``.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from planner.curves import fit_envelope, memory_cap
from planner.options import SolveOptions
from planner.plan import Plan
from planner.profile import Profile, RankProfile
from planner.solve import equal_split, evaluate, solve

FIX = "re-profile with a longer --budget-s on an idle machine"
COMPUTE_CHECKS = ("repeat_spread", "fit_residual", "non_monotone", "implausible")
RELEVANT_FRACTION = 0.5
"""A compute issue judges a plan when its batch size is at least this fraction of the smaller of the rank's
planned batch and the equal split's (``ProfileQuality.relevant``): the fitted curve at a batch rests on the
measured points around it, the sweep's grid steps are 1.33-1.5x, and two of them down is about half."""


@dataclass(frozen=True, kw_only=True, slots=True)
class QualityLimits:
    """Where a measurement stops being trustworthy (see the module docstring for why these values)."""

    max_spread: float = 0.5
    """Largest IQR / median of one point's repeats (range / median below 4 repeats)."""
    max_fit_residual: float = 0.35
    """Largest relative distance of a measured point from the fitted curve."""
    max_drop: float = 1.5
    """Largest ratio t(b_small) / t(b_large) for a smaller batch that ran slower than a larger one."""
    max_growth: float = 2.0
    """Largest (t2 / t1) / (b2 / b1) between consecutive points: time growing faster than the batch."""
    max_identical_ratio: float = 1.5
    """Largest ratio of the step times of two ranks with the same device at the same batch."""
    max_ddp_spread: float = 0.5
    """Largest (max - min) / median of the DDP overhead over its measurement rounds."""
    min_ddp_spread_of_step: float = 0.1
    """...and only when that range is also at least this fraction of a step (sub-ms jitter is no problem)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class QualityIssue:
    check: str
    """One of repeat_spread, fit_residual, non_monotone, implausible, identical_devices, ddp_overhead."""
    ranks: tuple[int, ...]
    noise_frac: float
    """The size of the problem as a relative error (0.5 = measurements off by 50%)."""
    subject: str
    """Who: "rank 0 (cpu)", "ranks 0 and 1", "DDP overhead"."""
    what: str
    """What is wrong, with the numbers."""
    fix: str = FIX
    batch_size: int | None = None
    """The largest batch size the problem's evidence touches: the rank's curve up to it is in doubt (None: the
    whole curve, or no batch at all)."""

    @property
    def message(self) -> str:
        """One line: who, what with its numbers, the fix."""
        return f"{self.subject}: {self.what}; {self.fix}"


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileQuality:
    issues: tuple[QualityIssue, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.issues

    @property
    def noise_frac(self) -> float:
        """Relative error the compute curves may carry (0 when they pass every check)."""
        return max((i.noise_frac for i in self.issues if i.check in COMPUTE_CHECKS), default=0.0)

    @property
    def worst(self) -> QualityIssue | None:
        """The compute issue that sets ``noise_frac`` (what a one-line reason names)."""
        compute = [i for i in self.issues if i.check in COMPUTE_CHECKS]
        return max(compute, key=lambda i: i.noise_frac) if compute else None

    def relevant(self, batch_sizes: Sequence[int], equal: float) -> ProfileQuality:
        """The compute issues that touch the batch sizes a split runs (``batch_sizes``, by rank: the forward's, a
        micro-batch under accumulation) or the equal split's (``equal``) on their rank, down to
        ``RELEVANT_FRACTION`` of the smaller of the two; an issue without a batch size always does."""
        def touches(i: QualityIssue) -> bool:
            if i.batch_size is None:
                return True
            low = min((min(batch_sizes[k], equal) if k < len(batch_sizes) else equal for k in i.ranks), default=equal)
            return i.batch_size >= RELEVANT_FRACTION * low

        return ProfileQuality(issues=tuple(i for i in self.issues if i.check in COMPUTE_CHECKS and touches(i)))

    def noise_for(self, plan: Plan) -> float:
        """``noise_frac`` of the issues that touch ``plan``'s batch sizes or the equal split's (``relevant``)."""
        return self.relevant(*_split_of(plan)).noise_frac

    def warning_lines(self) -> list[str]:
        return [f"warning: {i.message}" for i in self.issues]


def _split_of(plan: Plan) -> tuple[list[int], float]:
    """(each rank's forward batch, by rank; the equal split's batch) of ``plan``: what ``relevant`` judges."""
    by_rank = sorted(plan.ranks, key=lambda r: r.rank)
    return [r.micro_batch_size or r.batch_size for r in by_rank], plan.global_batch / max(1, plan.world_size)


def _ms(t_s: float) -> str:
    ms = 1000 * t_s
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.1f} ms" if ms >= 1 else f"{ms:.2f} ms"


def _who(r: RankProfile) -> str:
    return f"rank {r.rank} ({r.device})"


def check_profile(profile: Profile, limits: QualityLimits | None = None) -> ProfileQuality:
    """Every quality problem of `profile`, compute curves first, in rank order."""
    lim = limits or QualityLimits()
    issues: list[QualityIssue] = []
    for r in profile.by_rank:
        issues.extend(_rank_issues(r, lim))
    issues.extend(_identical_device_issues(profile, lim))
    ddp = _ddp_issue(profile, lim)
    if ddp is not None:
        issues.append(ddp)
    return ProfileQuality(issues=tuple(issues))


def _spreads(r: RankProfile) -> list[tuple[int | None, float, int]]:
    """(batch, spread, repeats) per point when the profiler recorded them, else the one recorded maximum (with the
    fewest repeats a sweep takes, 3)."""
    per_point, repeats = r.meta.get("sweep_spread"), r.meta.get("sweep_repeats")
    if isinstance(per_point, list) and len(per_point) == len(r.compute):
        ns = repeats if isinstance(repeats, list) and len(repeats) == len(per_point) else [3] * len(per_point)
        return [(p.batch_size, float(s), int(n)) for p, s, n in zip(r.compute, per_point, ns, strict=True)
                if isinstance(s, (int, float)) and isinstance(n, int) and n > 0]
    worst = r.meta.get("sweep_spread_max")
    return [(None, float(worst), 3)] if isinstance(worst, (int, float)) and not isinstance(worst, bool) else []


def _rank_issues(r: RankProfile, lim: QualityLimits) -> list[QualityIssue]:
    out: list[QualityIssue] = []
    spreads = _spreads(r)
    if spreads:
        at, s, _ = max(spreads, key=lambda x: x[1])
        if s > lim.max_spread:
            where = f" at batch {at}" if at is not None else ""
            spread_at = [b for b, x, _ in spreads if x > lim.max_spread and b is not None]
            # Each point is a median of n repeats, whose own error is about spread / sqrt(n); and one disturbed
            # point does not move a curve fitted through all of them: the typical point's error is the noise.
            typical = statistics.median(x / math.sqrt(n) for _, x, n in spreads)
            out.append(QualityIssue(
                check="repeat_spread", ranks=(r.rank,), noise_frac=typical, subject=_who(r),
                what=f"repeated steps of one batch size differ by up to {s:.0%} of their median{where} "
                     f"(limit {lim.max_spread:.0%}): something else was running",
                batch_size=max(spread_at) if spread_at else None))
    pts = sorted(r.compute, key=lambda p: p.batch_size)
    if len(pts) >= 2:
        env = fit_envelope(r.compute)
        resid = env.max_rel_residual
        if resid > lim.max_fit_residual:
            off = [(abs(env(p.batch_size) - p.step_time_s) / p.step_time_s, p.batch_size) for p in pts
                   if p.step_time_s > 0]
            far = [b for x, b in off if x > lim.max_fit_residual]
            at = max(off)[1] if off else None
            out.append(QualityIssue(
                check="fit_residual", ranks=(r.rank,), noise_frac=resid, subject=_who(r),
                what=f"a measured step{f' (batch {at})' if at is not None else ''} is {resid:.0%} away from the "
                     f"fitted step-time curve (limit {lim.max_fit_residual:.0%}), so predictions for this rank "
                     f"{f'up to batch {max(far)} ' if far else ''}are unreliable",
                batch_size=max(far) if far else None))
    drops = [(a, b) for a, b in itertools.pairwise(pts) if a.step_time_s > lim.max_drop * b.step_time_s]
    if drops:
        a, b = max(drops, key=lambda ab: ab[0].step_time_s / ab[1].step_time_s)
        ratio = a.step_time_s / b.step_time_s
        out.append(QualityIssue(
            check="non_monotone", ranks=(r.rank,), noise_frac=ratio - 1.0, subject=_who(r),
            what=f"batch {a.batch_size} took {_ms(a.step_time_s)} but the larger batch {b.batch_size} took "
                 f"{_ms(b.step_time_s)} ({ratio:.1f}x less), which a real device does not do",
            batch_size=max(y.batch_size for _, y in drops)))
    jumps = [(a, b) for a, b in itertools.pairwise(pts)
             if b.step_time_s / a.step_time_s > lim.max_growth * b.batch_size / a.batch_size]
    if jumps:
        a, b = max(jumps, key=lambda ab: ab[1].step_time_s / ab[0].step_time_s * ab[0].batch_size / ab[1].batch_size)
        growth = (b.step_time_s / a.step_time_s) / (b.batch_size / a.batch_size)
        out.append(QualityIssue(
            check="implausible", ranks=(r.rank,), noise_frac=growth - 1.0, subject=_who(r),
            what=f"batch {b.batch_size} took {_ms(b.step_time_s)}, {b.step_time_s / a.step_time_s:.1f}x batch "
                 f"{a.batch_size}'s {_ms(a.step_time_s)} for {b.batch_size / a.batch_size:g}x the samples "
                 "(implausible)",
            batch_size=max(y.batch_size for _, y in jumps)))
    return out


def _kind(r: RankProfile) -> tuple[Any, ...] | None:
    """What must match for two ranks to be expected to measure alike; None when the device has no name."""
    if not r.device_name:
        return None
    m: Mapping[str, Any] = r.meta
    return (r.device_name, r.device.split(":")[0], m.get("torch_threads"), m.get("emulate_slowdown"), m.get("amp"),
            m.get("channels_last"))


def _identical_device_issues(profile: Profile, lim: QualityLimits) -> list[QualityIssue]:
    groups: dict[tuple[Any, ...], list[RankProfile]] = {}
    for r in profile.by_rank:
        key = _kind(r)
        if key is not None:
            groups.setdefault(key, []).append(r)
    out = []
    for ranks in groups.values():
        if len(ranks) < 2:
            continue
        # Compare the fitted curves (isotonic, so one stray point does not decide) at a batch all have measured
        # near: the median of the batch sizes they measured.
        b = int(statistics.median_low(sorted({p.batch_size for r in ranks for p in r.compute})))
        times = [(fit_envelope(r.compute)(b), r) for r in ranks]
        (t_fast, fast), (t_slow, slow) = min(times, key=lambda x: x[0]), max(times, key=lambda x: x[0])
        ratio = t_slow / t_fast
        if ratio > lim.max_identical_ratio:
            pair = sorted((fast, slow), key=lambda r: r.rank)
            out.append(QualityIssue(
                check="identical_devices", ranks=tuple(r.rank for r in pair), noise_frac=ratio - 1.0,
                subject=f"ranks {pair[0].rank} and {pair[1].rank}",
                what=f"the same device ({fast.device_name}) measured {ratio:.1f}x apart at batch {b} "
                     f"(fitted curves: rank {slow.rank} {_ms(t_slow)}, rank {fast.rank} {_ms(t_fast)})",
                fix=f"unless something really slows rank {slow.rank} (a co-tenant, throttling), {FIX}"))
    return out


def _ddp_issue(profile: Profile, lim: QualityLimits) -> QualityIssue | None:
    rounds = profile.meta.get("ddp_overhead_rounds_s")
    if not isinstance(rounds, list) or len(rounds) < 2 or not all(isinstance(x, (int, float)) for x in rounds):
        return None
    med = float(statistics.median(rounds))
    spread = max(rounds) - min(rounds)
    b = profile.meta.get("ddp_overhead_batch")
    step = max(fit_envelope(r.compute)(float(b) if isinstance(b, (int, float)) else r.compute[0].batch_size)
               for r in profile.ranks)
    if spread <= lim.max_ddp_spread * med or spread <= lim.min_ddp_spread_of_step * step:
        return None
    shown = ", ".join(_ms(x) for x in rounds)
    return QualityIssue(
        check="ddp_overhead", ranks=tuple(r.rank for r in profile.by_rank), noise_frac=spread / max(med, 1e-12),
        subject="DDP overhead", what=f"measured {shown} per step in {len(rounds)} rounds (the plan adds the median, "
                                     f"{_ms(med)}, to every step)")


# -- plans ---------------------------------------------------------------------------------------------------
def predicted_gain(plan: Plan) -> float | None:
    """The plan's predicted speed-up over the equal split minus 1 (None when the equal split does not fit)."""
    eq = plan.predicted.equal_split_samples_per_s
    return plan.predicted.samples_per_s / eq - 1.0 if eq > 0 else None


def within_noise(plan: Plan, quality: ProfileQuality) -> bool:
    """True when the plan departs from the equal split by less than the profile can tell apart at the batch sizes
    the two run (``ProfileQuality.noise_for``)."""
    gain = predicted_gain(plan)
    return gain is not None and gain > 0 and gain <= quality.noise_for(plan)


def keep_equal_within_noise(profile: Profile, plan: Plan, quality: ProfileQuality) -> Plan:
    """The equal split instead of `plan` when the plan's predicted gain is inside the profile's noise.

    The kept plan records the optimum it replaced and why in ``plan.solver`` (``kept_for: "profile noise"``,
    ``profile_noise``, ``optimum_batch_sizes``, ``optimum_step_time_s``): ``kept_within_noise`` reads it back.
    Workers stay the optimum's, as when ``solve`` keeps the equal split for ``min_gain``.
    """
    if not within_noise(plan, quality):
        return plan
    W, B = plan.world_size, plan.global_batch
    even = evaluate(profile, equal_split(B, W), num_workers=[r.num_workers for r in plan.ranks],
                    options=plan.options, method="equal")
    solver = {**plan.solver, "method": "equal (optimum within the profile's noise)",
              "optimum_batch_sizes": list(plan.batch_sizes), "optimum_step_time_s": plan.predicted.step_time_s,
              "kept_for": "profile noise", "profile_noise": round(quality.noise_for(plan), 4)}
    return replace(even, solver=solver, meta=plan.meta)


def solve_within_noise(profile: Profile, *, global_batch: int, options: SolveOptions | None = None,
                       quality: ProfileQuality | None = None, **overrides: Any) -> Plan:
    """``planner.solve``, then the quality gate: the equal split when the optimum's predicted gain is inside the
    profile's noise (``keep_equal_within_noise``).  ``min_gain=0`` asks for the optimum whatever the noise, as it
    does of ``solve``.  Every auto mode solves through it (`planner train --auto`, `planner bench`,
    ``profiler.lightning.auto_plan``); ``quality``: ``check_profile(profile)`` when already computed."""
    plan = solve(profile, global_batch=global_batch, options=options, **overrides)
    if plan.options.min_gain <= 0:
        return plan
    return keep_equal_within_noise(profile, plan, quality if quality is not None else check_profile(profile))


def kept_within_noise(plan: Plan) -> tuple[list[int], float, float] | None:
    """(optimum batches, its predicted gain, the profile's noise) when the equal split was kept for noise."""
    if plan.solver.get("kept_for") != "profile noise":
        return None
    optimum = plan.solver.get("optimum_batch_sizes")
    t_opt, noise = plan.solver.get("optimum_step_time_s"), plan.solver.get("profile_noise")
    if not isinstance(optimum, Sequence) or not isinstance(t_opt, (int, float)) or t_opt <= 0:
        return None
    return [int(b) for b in optimum], plan.predicted.step_time_s / t_opt - 1.0, float(noise or 0.0)


def _factor(frac: float) -> str:
    """A relative size for people: "35%" below 1, "2.8x" from there (a 1549% noise reads as 16.5x)."""
    return f"{frac:.0%}" if frac < 1.0 else f"{1.0 + frac:.1f}x"


def noise_line(plan: Plan, quality: ProfileQuality) -> str | None:
    """One line for people: why the equal split was kept, or why the plan's gain is not to be trusted."""
    kept = kept_within_noise(plan)
    batches, equal = _split_of(plan)
    if kept is not None:
        batches = kept[0]  # the optimum it was judged by
    worst = quality.relevant(batches, equal).worst
    cause = f" ({worst.subject}: {worst.what})" if worst is not None else ""
    if kept is not None:
        optimum, gain, noise = kept
        return (f"kept the equal split: the optimum {optimum} is predicted {1.0 + gain:.2f}x as fast, but the "
                f"profile's own measurements are off by up to {_factor(noise)}{cause}; {FIX} "
                "(--min-gain 0 plans the optimum anyway)")
    if within_noise(plan, quality):
        gain = predicted_gain(plan) or 0.0
        return (f"the plan's predicted {1.0 + gain:.2f}x over the equal split is inside the profile's own noise "
                f"(measurements off by up to {_factor(quality.noise_for(plan))}{cause}): do not trust it; {FIX}")
    return None


# -- extrapolation -------------------------------------------------------------------------------------------
def extrapolation_lines(plan: Plan, profile: Profile) -> list[str]:
    """One warning per rank planned past its largest measured batch with nothing capping its memory.

    Past the last point the step time is the last piece of the envelope extended linearly (planner/curves.py)
    and, with no memory data, nothing says the batch fits: the plan may be neither as fast as predicted nor
    runnable.  A rank with a memory cap is held below it by the solver, so only uncapped ranks are named.
    """
    out = []
    by_rank = {r.rank: r for r in profile.by_rank}
    for rp in plan.ranks:
        r = by_rank.get(rp.rank)
        if r is None or not r.compute or memory_cap(r.memory) is not None:
            continue
        # With accumulation the largest forward is the micro-batch; that is what the measured points cover.
        b = rp.micro_batch_size or rp.batch_size
        top = max(p.batch_size for p in r.compute)
        if b > top:
            past = f"{b / top:,.1f}x" if b < 10 * top else f"{b / top:,.0f}x"
            out.append(f"warning: {_who(r)} is planned a batch of {b:,}, {past} its largest measured batch "
                       f"of {top:,}, and its profile has no memory data: its step time there is extrapolated "
                       "linearly and nothing checks that it fits; profile larger batches (or record memory) first")
    return out
