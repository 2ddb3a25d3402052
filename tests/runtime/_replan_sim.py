"""Simulated epochs for the Replanner tests: true per-rank curves, heavy-tailed step noise, StepStats as the timer
summarises them (median, MAD, 5-sigma outliers left out of the mean), and the run's decisions.

Noise as a shared 2-core box shows it (``Noise``): every step's compute is the true time times a lognormal jitter,
a few steps stall several-fold (another process took the core), and each rank's whole epoch drifts by a lognormal
factor (the other processes' load changes between epochs).  The step a rank waits in is the slowest rank's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

import planner
from planner.stats import StepStats
from runtime.replan import ReplanDecision, Replanner

Curve = Callable[[float], float]
TruthAt = Callable[[int], Sequence[Curve]]
"""The true curves of every rank in an epoch (a slowdown arrives at some epoch)."""

TAIL_S = 0.0005
"""Seconds per step after the slowest rank's compute (the all-reduce's exposed tail)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Noise:
    step_sigma: float = 0.0
    """Lognormal sigma of one step's compute around the epoch's mean."""
    stall_p: float = 0.0
    """Chance that a step stalls."""
    stall_x: tuple[float, float] = (2.0, 6.0)
    """A stalled step takes this many times longer (uniform)."""
    epoch_sigma: float = 0.0
    """Lognormal sigma of a rank's whole epoch (the host's load moving between epochs)."""
    steps: int = 40

    @classmethod
    def quiet(cls, rel: float = 0.01) -> Noise:
        return cls(step_sigma=rel)

    @classmethod
    def busy_box(cls) -> Noise:
        """A shared 2-core CPU box: 8% step jitter, 3% of steps stalled 2-6x, 3% epoch-to-epoch drift."""
        return cls(step_sigma=0.08, stall_p=0.03, epoch_sigma=0.03, steps=30)


def summarise(rank: int, epoch: int, batch: int, compute: np.ndarray, steps: np.ndarray) -> StepStats:
    """The StepTimer's summary of one rank's per-step compute and the job's per-step step times."""
    med = float(np.median(compute))
    mad = float(np.median(np.abs(compute - med)))
    inliers = compute[np.abs(compute - med) <= 5 * 1.4826 * mad] if mad > 0 else compute
    if len(inliers) < 0.75 * len(compute):
        inliers = compute
    return StepStats(rank=rank, epoch=epoch, num_steps=len(compute), batch_size=batch, num_workers=0,
                     data_wait_s=0.0, compute_s=float(inliers.mean()),
                     compute_s_std=float(inliers.std(ddof=1)) if len(inliers) > 1 else 0.0,
                     compute_s_median=med, compute_s_mad=mad, step_time_s=float(steps.mean()),
                     step_time_s_std=float(steps.std(ddof=1)), num_outliers=len(compute) - len(inliers))


def measure(batches: Sequence[int], truth: Sequence[Curve], epoch: int, rng: np.random.Generator,
            noise: Noise) -> list[StepStats]:
    """One epoch's StepStats of every rank running ``batches`` on the ``truth`` curves."""
    W, n = len(batches), noise.steps
    base = np.array([truth[i](b) for i, b in enumerate(batches)])
    drift = np.exp(rng.normal(0.0, noise.epoch_sigma, size=W)) if noise.epoch_sigma else np.ones(W)
    jitter = np.exp(rng.normal(0.0, noise.step_sigma, size=(W, n))) if noise.step_sigma else np.ones((W, n))
    if noise.stall_p:
        stalled = rng.random((W, n)) < noise.stall_p
        jitter = np.where(stalled, jitter * rng.uniform(*noise.stall_x, size=(W, n)), jitter)
    compute = (base * drift)[:, None] * jitter
    steps = compute.max(axis=0) + TAIL_S
    return [summarise(i, epoch, b, compute[i], steps) for i, b in enumerate(batches)]


def true_step_s(batches: Sequence[int], truth: Sequence[Curve]) -> float:
    """The noise-free synchronous step of ``batches``."""
    return max(t(b) for t, b in zip(truth, batches, strict=True)) + TAIL_S


def equal_split(global_batch: int, world: int) -> tuple[int, ...]:
    q, r = divmod(global_batch, world)
    return tuple(q + (i < r) for i in range(world))


@dataclass(kw_only=True, slots=True)
class Run:
    """What a simulated run did: per epoch the split that ran, its true step, and the decision after it."""

    batches: list[tuple[int, ...]] = field(default_factory=list)
    true_steps: list[float] = field(default_factory=list)
    measured_steps: list[float] = field(default_factory=list)
    decisions: list[ReplanDecision] = field(default_factory=list)
    eras: list[int] = field(default_factory=list)
    """The Replanner's era after each decision."""

    @property
    def mean_step_s(self) -> float:
        return float(np.mean(self.true_steps))


def simulate(rp: Replanner, truth_at: TruthAt, epochs: int, rng: np.random.Generator, noise: Noise) -> Run:
    """``epochs`` epochs under ``rp``: measure the running split, decide, run what it decided."""
    run = Run()
    for epoch in range(epochs):
        bs = rp.plan.batch_sizes
        truth = truth_at(epoch)
        stats = measure(bs, truth, epoch, rng, noise)
        run.batches.append(tuple(bs))
        run.true_steps.append(true_step_s(bs, truth))
        run.measured_steps.append(max(s.step_time_s for s in stats))
        d = rp.decide(stats, epoch)
        assert d.plan is rp.plan, d.reason
        run.decisions.append(d)
        run.eras.append(rp.era)
    return run


def baseline_step_s(batches: Sequence[int], truth_at: TruthAt, epochs: int) -> float:
    """The mean true step of running ``batches`` every epoch."""
    return float(np.mean([true_step_s(batches, truth_at(e)) for e in range(epochs)]))


def moves(run: Run) -> list[tuple[int, tuple[int, ...], tuple[int, ...], bool]]:
    """(epoch, from, to, is_revert) of every change of split the decisions made."""
    return [(d.epoch, tuple(d.old_plan.batch_sizes), tuple(d.plan.batch_sizes), d.reverted)
            for d in run.decisions if tuple(d.plan.batch_sizes) != tuple(d.old_plan.batch_sizes)]


def reversals_per_era(run: Run) -> dict[int, int]:
    """Per era: the reverts, and the moves opposite to the era's previous move (negative inner product)."""
    out: dict[int, int] = {}
    last: dict[int, np.ndarray] = {}
    for d, era in zip(run.decisions, run.eras, strict=True):
        a, b = np.array(d.old_plan.batch_sizes), np.array(d.plan.batch_sizes)
        if (a == b).all():
            continue
        move = b - a
        prev = last.get(era)
        if d.reverted or (prev is not None and float(move @ prev) < 0):
            out[era] = out.get(era, 0) + 1
        last[era] = move
    return out


def profile_of(curves: Sequence[Curve], sizes: Sequence[int], *, cores: int = 64) -> planner.Profile:
    """A one-host profile whose rank i measured ``curves[i]`` at ``sizes``."""
    ranks = [{"rank": i, "host": "n0", "device": f"cuda:{i}",
              "compute": [{"batch_size": b, "step_time_s": float(c(b))} for b in sizes]}
             for i, c in enumerate(curves)]
    return planner.Profile.from_dict({"version": 1, "kind": "profile",
                                      "hosts": [{"name": "n0", "cpu_cores": cores}], "ranks": ranks})


def knee(floor: float, per_sample: float, intercept: float = 0.0) -> Curve:
    """max(floor, intercept + per_sample * b): launch-bound at small batches, linear beyond."""
    return lambda b: max(floor, intercept + per_sample * b)


def per_sample_slowdown(curve: Curve, extra_s: float) -> Curve:
    """``curve`` plus ``extra_s`` a sample (a per-sample sleep, a transform moved into the loop)."""
    return lambda b: curve(b) + extra_s * b


def multiplied(curve: Curve, factor: float) -> Curve:
    return lambda b: factor * curve(b)


def relative_se(stats: Sequence[StepStats]) -> float:
    """The noisiest rank's relative standard error of its mean compute."""
    return max(s.compute_s_sigma / math.sqrt(s.num_steps) / s.compute_s for s in stats)
