"""The loader model: worker budgets, and what a rank's DataLoader delivers while every rank of its host trains.

The loader under host contention: what a rank's DataLoader delivers while every rank of its host trains.

Why not ``workers / sec_per_sample``: ``sec_per_sample`` is one worker's cost with the host otherwise idle.  In
training the host also runs the other ranks' workers and every rank's main process (pinning thread, CUDA
launches), and on SMT hosts a worker's rate falls as the cores fill up.  Measured on 2x H100 (32 logical cores,
ResNet-50 PIL pipeline, tests/data/h100x2_resnet50_loader_skew_8_workers_341_171_*): 8 workers at 3.08 ms/sample
predict 2597 samples/s; alone, the DataLoader delivered 2364/s; in training it delivered ~1900/s.

The model.  The profiler's scaling run gives R(n): samples/s of one DataLoader with n workers (one main process)
on an otherwise idle host.  While training, the host carries

    n_h = sum_{i on h} busy_i + reserve * (ranks_h - 1)       busy_i = min(w_i, p_i / s_i)

busy worker-equivalents: a rank's workers are busy only as far as its GPU consumes samples (p_i CPU-s/sample
over s_i GPU-s/sample, the compute curve's steepest slope: a loader-bound rank has all w_i busy, a fast loader
feeding a slow GPU idles), plus each other rank's main process (``cpu_reserve_per_rank`` cores, the same
reserve the worker budget keeps).  Every busy worker on the host then runs at R(n_h) / n_h samples/s, so the
rank's effective cost per sample per worker is

    p_eff_i = n_h / R(n_h)

which the program uses in place of p_i (``b_i * p_eff_i <= w_i * T``).  R is piecewise linear through the
measured points; past the last one the per-worker rate stays at the last point's (the profiler measures up to the
usable cores, so that is rarely needed).  Workers w_i are fixed while the program runs, so it stays linear:
``planner.solve`` solves at the host's budget split equally, then again at its plan's own workers until they
agree (``loader_costs_s``).  A rank without a scaling run keeps its ``sec_per_sample`` (old profiles plan as
before).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from planner.curves import Envelope, fit_envelope
from planner.options import SolveOptions
from planner.profile import LoaderPoint, LoaderProfile, Profile


def rate_at(loader: LoaderProfile, n: float) -> float:
    """R(n): samples/s of the measured DataLoader with n workers (n may be fractional), 0 without a curve."""
    pts = sorted((p.num_workers, p.samples_per_s) for p in loader.scaling if p.num_workers > 0)
    if not pts:
        return 0.0
    w = np.array([0.0, *(p[0] for p in pts)])
    r = np.array([0.0, *(p[1] for p in pts)])
    if n >= w[-1]:
        return float(r[-1] / w[-1] * n)  # the last point's per-worker rate
    return float(np.interp(n, w, r))


def base_cost_s(loader: LoaderProfile | None) -> float:
    """One worker's seconds per sample as a DataLoader delivers it alone: 1 / R(1) when measured (it includes
    the hand-over to the main process that ``sec_per_sample`` leaves out), else ``sec_per_sample``."""
    if loader is None:
        return 0.0
    r1 = rate_at(loader, 1.0)
    return 1.0 / r1 if r1 > 0 else loader.sec_per_sample


def host_loads(profile: Profile, workers: Sequence[int], gpu_s_per_sample: Sequence[float],
               reserve_per_rank: int) -> dict[str, float]:
    """n_h per host (see module docstring); ranks in ``profile.by_rank`` order."""
    per_host = Counter(r.host for r in profile.ranks)
    load = {h: float(reserve_per_rank * (n - 1)) for h, n in per_host.items()}
    for r, w, s in zip(profile.by_rank, workers, gpu_s_per_sample, strict=True):
        if r.loader is None or w <= 0:
            continue
        p = base_cost_s(r.loader)
        load[r.host] += min(float(w), p / s) if s > 0 else float(w)
    return load


def contended_costs_s(profile: Profile, workers: Sequence[int], gpu_s_per_sample: Sequence[float],
                      reserve_per_rank: int) -> list[float]:
    """p_eff_i per rank (``profile.by_rank`` order): seconds per sample per worker at the host's training load;
    ``sec_per_sample`` for a rank without a scaling run, 0 without loader data."""
    loads = host_loads(profile, workers, gpu_s_per_sample, reserve_per_rank)
    out = []
    for r in profile.by_rank:
        if r.loader is None:
            out.append(0.0)
            continue
        n = max(1.0, loads[r.host])
        rate = rate_at(r.loader, n)
        out.append(n / rate if rate > 0 else r.loader.sec_per_sample)
    return out


def handover_costs_s(profile: Profile) -> list[float]:
    """Seconds per sample each rank's training process spends taking a delivered batch over (its pin-memory
    thread's copy into pinned memory, one thread for the rank: ``sample_bytes / handover_bytes_per_s``, measured
    at full worker load), by rank; 0 where not measured.  A rank's batch per step can take no longer than the
    step: on 2x H100/H200, 274-298 MB batches took 85-107 ms to pin on an idle host
    and rank 0's steps ran at 129-137 ms with its workers' builds at 93 ms, its data
    wait 34 ms a step (docs/PERFORMANCE.md)."""
    out = []
    for r in profile.by_rank:
        lp = r.loader
        ok = lp is not None and lp.sample_bytes and lp.handover_bytes_per_s
        out.append(lp.sample_bytes / lp.handover_bytes_per_s if ok else 0.0)  # type: ignore[operator,union-attr]
    return out


def worker_budgets(profile: Profile, opts: SolveOptions) -> dict[str, int]:
    """Loader workers each host can run: its cores minus `cpu_reserve_per_rank` per training process."""
    per_host = Counter(r.host for r in profile.ranks)
    return {h.name: max(0, h.cpu_cores - opts.cpu_reserve_per_rank * per_host[h.name]) for h in profile.hosts}


def loader_costs_s(profile: Profile, opts: SolveOptions, envelopes: Sequence[Envelope] | None = None,
                   workers: Sequence[int] | None = None) -> list[float]:
    """Each rank's loader seconds per sample per worker while the whole job trains, by rank (what the program
    and every prediction use: ``planner.solve``, ``planner.evaluate``, the Replanner's correction, the bench).

    The load counts each rank's workers -- ``workers`` (by rank: a plan's), else the host's budget split
    equally, capped at the rank's max (the rule of ``equal_split_workers``) -- and the rank's GPU cost per
    sample at its steepest piece; a host too small for one worker per rank loads in the training processes,
    which keep the plain ``sec_per_sample``.  ``planner.solve`` starts from the equal split and solves again at
    its plan's own workers (a capped rank's share of the budget goes to its peers: on 2x H100, rank 1
    capped at 2 workers, rank 0 given 28 -- loaded as 15, the model made the host's loaders 12% faster than they
    ran).  ``envelopes``: the ranks' fitted compute curves when the caller has them (by rank), else fitted here."""
    budgets = worker_budgets(profile, opts)
    per_host = Counter(r.host for r in profile.ranks)
    gpu_s = [max((envelopes[i] if envelopes is not None else fit_envelope(r.compute)).slopes)
             for i, r in enumerate(profile.by_rank)]
    if workers is None:
        workers = []
        for r in profile.by_rank:
            cap = opts.worker_cap(budgets[r.host], r.loader.max_workers if r.loader else None)
            serial = budgets[r.host] < per_host[r.host]
            workers.append(0 if serial else min(cap, max(1, budgets[r.host] // per_host[r.host])))
    elif len(workers) != len(profile.by_rank):
        raise ValueError(f"{len(workers)} worker counts for {len(profile.by_rank)} ranks")
    costs = contended_costs_s(profile, workers, gpu_s, opts.cpu_reserve_per_rank)
    return [c if w > 0 or r.loader is None else r.loader.sec_per_sample
            for c, w, r in zip(costs, workers, profile.by_rank, strict=True)]


def scaled_loader(loader: LoaderProfile, factor: float) -> LoaderProfile:
    """The same loader ``factor`` times as costly per sample: ``sec_per_sample`` times it, every measured rate
    over it (the Replanner's correction when training showed the loader slower than modelled)."""
    return replace(
        loader,
        sec_per_sample=loader.sec_per_sample * factor,
        scaling=tuple(LoaderPoint(num_workers=p.num_workers, samples_per_s=p.samples_per_s / factor)
                      for p in loader.scaling),
    )
