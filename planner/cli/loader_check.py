"""The loader check of the auto-plan pipeline (planner.cli.autoplan: `planner train --auto`, `planner bench`): the
plan's DataLoaders timed at the plan's own batches and workers, every rank's at once, before training; the loader
curves are scaled to what they measured, and the plan's predictions with them.

Why.  The profile's loader curve R(n) is taken beside the compute sweep (profiler.loader.measure_scaling), under
whatever the sweep's phase puts on the host's cores, and the model loads it with the plan's workers
(planner.loader).  Against what a worker paid a sample *in training* (the step logs of 53 launches on 2x H100 and
2x H200, the PIL pipeline) the model's cost missed by a median 5.4% and by up to 21%, and the curve itself moved
between profiles of one host type: its top point R(32) ranged 4410-5602 samples/s over nine skew profiles on
2x H100.  A plan whose step a loader sets inherits that error whole: a skew launch on 2x H200 predicted its loaders
at 5.33 ms and they ran at 6.06 (+14%), and the Replanner could only confirm it an epoch later.

What.  After the plan is solved, every rank runs its plan's DataLoader (its workers, its batch) for
``seconds`` at the same time -- the host's real worker contention, which is what the curve is for -- and times
each batch in the workers (the mean build time, each worker's first batch left out: ``measure_scaling``).
A rank's measured seconds per sample per worker over the model's at the plan (``loader_costs_s``) scales its
loader curve (``scaled_loader``); the plan's predictions, and the Replanner's, then come from the scaled profile.
The split itself changes only for a gain of ``min_gain`` (the Replanner's threshold, ``after_check``): the
model's optimum is flat -- on skew profiles of 2x H200 splits as far apart as [393, 119] on [23, 7] workers and
[462, 50] on [27, 3] predicted within 1% of each other -- and a check that always took the new optimum jumped to
such far corners on 3-6% loader changes in both of two skew launches ([462, 50] and [478, 34]); they ran 20-28%
slower than the split they left, and the Replanner took an epoch to move back.  ``profile.meta["loader_check"]``
keeps what was measured.  The GPUs are idle meanwhile, so the training processes' own CPU (launches, pinning:
about a core each) is not on the host yet.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from typing import Any

import torch.distributed as dist

import planner
from planner.loader import loader_costs_s, scaled_loader
from planner.options import SolveOptions
from planner.plan import Plan
from planner.profile import Profile

CHECK_S = 3.0
"""Seconds each rank's check iterates its DataLoader (after each worker's first batch); ``--loader-check-s``."""
QUICK_CHECK_S = 1.0
"""The same under ``--quick`` (CI-sized runs)."""
SCALE_ROUNDS = 8
"""Refinements of the scale factors (``checked_profile``): a few suffice to 1e-4."""
MIN_CHANGE = 0.02
"""A measured cost within this fraction of the model's leaves the profile as it is (nothing to correct)."""


def time_rank_loader(dataset: Any, batch_size: int, num_workers: int, seconds: float) -> float | None:
    """Seconds per sample per worker of this rank's DataLoader at its plan (``num_workers`` workers building
    ``batch_size``-sample batches, prefetching as training will: ``planner.cli.steps.loader_prefetch``), every rank
    timing at once (a barrier first when distributed); None when the rank has no workers or nothing was timed."""
    from planner.cli.steps import loader_prefetch, shm_free_bytes, tensor_nbytes
    from profiler.loader import measure_scaling

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    if num_workers <= 0 or batch_size <= 0:
        return None
    try:
        sample = tensor_nbytes(dataset[0])
    except Exception:  # an iterable or failing dataset: torch's own prefetch
        sample = 0
    prefetch, _ = loader_prefetch(num_workers, sample * batch_size, shm_free_bytes(),
                                  int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    points = measure_scaling(dataset, [num_workers], batch_size=batch_size, seconds=seconds, prefetch_factor=prefetch)
    return num_workers / points[0].samples_per_s if points and points[0].samples_per_s > 0 else None


def check_seconds(given: float | None, quick: bool) -> float:
    """The check's seconds: ``--loader-check-s`` when given, else ``CHECK_S`` (``QUICK_CHECK_S`` with ``--quick``)."""
    return (QUICK_CHECK_S if quick else CHECK_S) if given is None else float(given)


def measure_plan_loaders(rank: int, dataset: Any, plan: Plan, seconds: float,
                         cap: int | None = None) -> list[float | None]:
    """Collective: every rank's ``time_rank_loader`` at ``plan`` (its workers, capped at ``cap``: an emulated
    worker cap), by rank."""
    from runtime.collectives import all_gather_json

    mine = next(r for r in plan.ranks if r.rank == rank)
    workers = mine.num_workers if cap is None else min(cap, mine.num_workers)
    return list(all_gather_json(time_rank_loader(dataset, mine.batch_size, workers, seconds)))


def checked_profile(profile: Profile, plan: Plan, options: SolveOptions,
                    measured: list[float | None], seconds: float) -> Profile | None:
    """The profile with each rank's loader curve scaled by measured / modelled seconds per sample per worker at
    ``plan`` (``measured`` by rank), and ``meta["loader_check"]``; None when no rank moved by ``MIN_CHANGE``."""
    by_rank = sorted(plan.ranks, key=lambda r: r.rank)
    workers = [r.num_workers for r in by_rank]
    modelled = loader_costs_s(profile, options, workers=workers)
    factors = [m / p if m is not None and p > 0 and r.loader is not None else None
               for m, p, r in zip(measured, modelled, profile.by_rank, strict=True)]
    if all(f is None or abs(f - 1.0) < MIN_CHANGE for f in factors):
        return None
    # Scaling a curve also moves the host's load the model counts from it (planner.loader.host_loads), so the
    # factors are refined until the checked profile's costs at the plan are the measured ones.
    total = [1.0 if f is None else f for f in factors]
    for _ in range(SCALE_ROUNDS):
        at = loader_costs_s(_scaled(profile, total), options, workers=workers)
        off = [m / a if m is not None and f is not None and a > 0 else 1.0
               for m, a, f in zip(measured, at, factors, strict=True)]
        if all(abs(o - 1.0) < 1e-4 for o in off):
            break
        total = [t * o for t, o in zip(total, off, strict=True)]
    checked = _scaled(profile, total)
    record = {"seconds": seconds, "batch_sizes": [r.batch_size for r in by_rank], "workers": workers,
              "measured_s_per_sample": measured, "modelled_s_per_sample": modelled, "factors": factors, "scale": total,
              "median_factor": statistics.median([f for f in factors if f is not None])}
    return dataclasses.replace(checked, meta={**profile.meta, "loader_check": record})


def _scaled(profile: Profile, factors: list[float]) -> Profile:
    ranks = tuple(r if f == 1.0 or r.loader is None else dataclasses.replace(r, loader=scaled_loader(r.loader, f))
                  for r, f in zip(profile.by_rank, factors, strict=True))
    return dataclasses.replace(profile, ranks=ranks)


def measured_line(checked: Profile) -> str:
    """One line of what a check measured, by rank, against the model (``checked.meta["loader_check"]``)."""
    rec = checked.meta["loader_check"]
    said = ", ".join(f"rank {i} {1e3 * m:.2f} (model {1e3 * p:.2f})"
                     for i, (m, p) in enumerate(zip(rec["measured_s_per_sample"], rec["modelled_s_per_sample"],
                                                    strict=True)) if m is not None)
    return f"loader check, ms a sample costs a worker at the plan: {said}"


def after_check(checked: Profile, plan: Plan, options: SolveOptions, min_gain: float) -> tuple[Plan, str]:
    """(plan, what was done): the split solved again on the checked profile when that predicts at least
    ``min_gain`` faster than ``plan``'s own split evaluated on it; else ``plan``'s split with its predictions from
    the checked profile (module docstring: the optimum is flat, and far corners ran slow)."""
    by_rank = sorted(plan.ranks, key=lambda r: r.rank)
    kept = planner.evaluate(checked, [r.batch_size for r in by_rank], [r.accumulation_steps for r in by_rank],
                            num_workers=[r.num_workers for r in by_rank], options=options)
    again = planner.solve(checked, global_batch=plan.global_batch, options=options)
    t_kept, t_again = kept.predicted.step_time_s, again.predicted.step_time_s
    if t_again <= t_kept * (1.0 - min_gain):
        return again, f"solved again: {1e3 * t_kept:.1f} ms -> {1e3 * t_again:.1f} ms predicted"
    solver = {**plan.solver, "profile_fingerprint": checked.fingerprint(),
              "loader_check": {"kept": True, "resolved_step_time_s": t_again,
                               "resolved_batch_sizes": [r.batch_size for r in again.ranks]}}
    return (dataclasses.replace(kept, solver=solver, meta=plan.meta),
            f"split kept, predicted {1e3 * t_kept:.1f} ms (a re-solve gained {1 - t_again / t_kept:.1%}, under "
            f"{min_gain:.0%})")
