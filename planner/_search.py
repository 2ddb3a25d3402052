"""The search behind planner.solve: batches, workers and micro-steps for a feasible global batch.

Without accumulation (every rank one micro-step) it is the program of planner.solve's docstring: a compute-only
MILP, the workers fixed by bisection when the loaders cannot keep up, a proportional balance among ties and a
one-sample polish.  Accumulation enters only where it can matter: when the global batch exceeds what the caps
hold in one micro-step, or when a memory-capped rank could finish more than its cap within the best step time
without accumulation (a cheap bisection tells).  Then the same steps run over (b, k) (planner._accumulation):
the micro-step counts are the fewest that hold B at the bracketed optimal step time, and the MILP places the
samples with them fixed.  Splits without accumulation are among the candidates, and the fewest micro-steps win
among equally fast ones, so accumulation is planned only where it is strictly faster -- and a cluster whose caps
do not bind plans exactly as it would without accumulation.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from planner._accumulation import Accumulation
from planner._model import RankModel
from planner._program import Pieces, bisect_workers, bracket, capacity, feed, solve_milp
from planner.curves import Envelope
from planner.errors import PlanError
from planner.options import SolveOptions
from planner.rounding import largest_remainder

Busy = Callable[[np.ndarray], np.ndarray]
Arrays = tuple[Pieces, np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True, kw_only=True, slots=True)
class Found:
    """What the search found: per-rank batches, micro-steps and workers, and how."""

    batch_sizes: np.ndarray
    steps: np.ndarray
    workers: np.ndarray
    method: str
    status: str
    plain_step_s: float | None = None
    """Best step time without accumulation when the plan accumulates (None when it does not, or none exists)."""


def search(models: list[RankModel], caps: list[int], budgets: dict[str, int], B: int, opts: SolveOptions) -> Found:
    """The plan's (b, k, w): without accumulation when that is feasible and nothing faster needs it."""
    arrays = _arrays(models, budgets)
    pieces = arrays[0]
    cap_arr = np.asarray(caps, dtype=np.int64)
    plain: Found | None = None
    t_plain: float | None = None
    if int(cap_arr.sum()) >= B:
        # The best step time without accumulation, compute only (cheap bisection): if no capped rank could use
        # more than its cap within it, plan exactly as without accumulation.
        t_plain = bracket(pieces, cap_arr, B, opts.min_batch)[1]
        if not _accumulation_may_help(models, B, t_plain):
            plain = _optimize(models, cap_arr, arrays, budgets, B, opts)
            t_plain = _step(models, plain)
            if not _accumulation_may_help(models, B, t_plain):  # the loaders' T can be larger
                return plain
    found = _optimize_accumulated(models, arrays, budgets, B, opts, start_hi=t_plain)
    if plain is not None and not _step(models, found) < _step(models, plain) * (1 - 1e-9):
        return plain
    if int(cap_arr.sum()) >= B and int(found.steps.max()) > 1:
        # What the step would be without accumulation (the plan's note): the full search's if it ran, else the
        # optimum at the same workers.
        t_same = t_plain if plain is not None else bracket(pieces, cap_arr, B, opts.min_batch, (arrays[1], found.workers))[1]
        return replace(found, plain_step_s=t_same)
    if int(found.steps.max()) == 1:  # searched with micro-steps, none paid off
        return replace(found, method=found.method.replace("+accumulation", ""))
    return found


def _step(models: list[RankModel], found: Found) -> float:
    return max(m.busy_time(int(b), int(w), int(k))[0]
               for m, b, w, k in zip(models, found.batch_sizes, found.workers, found.steps, strict=True))


def _accumulation_may_help(models: list[RankModel], B: int, T: float) -> bool:
    """Whether some rank that may accumulate could finish more than its memory cap within T if memory allowed.

    If none can, every split with accumulation that beats T would also run without it (tau >= t), so the plan
    without accumulation is optimal."""
    for m in models:
        room = B if m.batch_cap is None else min(m.batch_cap, B)
        if m.max_steps > 1 and m.micro_cap is not None and m.micro_cap < room:
            if _envelope_for(m).max_batch_within(T) >= m.micro_cap + 1:
                return True
    return False


# -- shared pieces ---------------------------------------------------------------------------------------------
def _envelope_for(m: RankModel) -> Envelope:
    """The rank's step as the program sees it: compute, plus loading when the training process loads, never
    faster than its batches' hand-over (one more piece, planner.loader.handover_costs_s)."""
    if m.serial_loader:
        return m.compute.plus_per_sample(m.sec_per_sample + m.handover_s)
    return m.compute.at_least_per_sample(m.handover_s)


def _arrays(models: list[RankModel], budgets: dict[str, int]) -> Arrays:
    """(pieces, loader cost of ranks with workers, host index per rank, worker budget per host index)."""
    pieces = Pieces.of([_envelope_for(m) for m in models])
    p = np.array([0.0 if m.serial_loader else m.sec_per_sample for m in models])
    names = sorted(budgets)
    index = {h: i for i, h in enumerate(names)}
    hosts = np.array([index[m.host] for m in models])
    return pieces, p, hosts, np.array([budgets[h] for h in names])


def _loader_time(p: np.ndarray, b: np.ndarray, w: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return np.where((p > 0) & (w > 0), p * b / np.maximum(w, 1), 0.0)


def _busy(pieces: Pieces, p: np.ndarray, b: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per-rank busy time: max(compute, loader) with workers, compute + loading when serial (folded in pieces)."""
    return np.maximum(pieces.times(b), _loader_time(p, b, w))


def _workers_at(models: list[RankModel], p: np.ndarray, b: np.ndarray, T: float) -> np.ndarray:
    """The fewest workers that feed b within T (0 for serial loaders)."""
    serial = np.array([m.serial_loader for m in models])
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        need = np.where(p > 0, np.ceil(p * b / T - 1e-9), 1.0)
    return np.where(serial, 0, np.maximum(need, 1)).astype(np.int64)


def _over_budget(models: list[RankModel], w: np.ndarray, hosts: np.ndarray, host_budget: np.ndarray) -> bool:
    used = np.bincount(hosts, weights=w, minlength=len(host_budget))
    return bool(np.any(used > host_budget) or np.any(w > np.array([m.max_workers for m in models])))


# -- without accumulation ----------------------------------------------------------------------------------------
def _optimize(models: list[RankModel], cap_arr: np.ndarray, arrays: Arrays, budgets: dict[str, int], B: int,
              opts: SolveOptions) -> Found:
    """See planner.solve's docstring for the two steps."""
    pieces, p, hosts, host_budget = arrays
    serial = np.array([m.serial_loader for m in models])
    # Step 1: compute only (serial loaders are already folded into their ranks' pieces).
    b, _, status = solve_milp(pieces, cap_arr, B, opts.min_batch, loader=None, time_limit_s=opts.time_limit_s)
    T = float(np.max(pieces.times(b)))
    method = "milp"
    w = _workers_at(models, p, b, T)
    if _over_budget(models, w, hosts, host_budget):
        # Step 2: the loaders cannot keep up at T.  Fix the workers (greedy at the bisected T), then the MILP
        # with p*b <= w*T linear again.
        max_w = np.array([m.max_workers for m in models])
        w = np.where(serial, 0, bisect_workers(pieces, cap_arr, B, opts.min_batch, p, hosts, host_budget, T, max_w)[0])
        b, _, status = solve_milp(pieces, cap_arr, B, opts.min_batch, loader=(p, w),
                                  time_limit_s=opts.time_limit_s)
        method = "milp+workers"
    w = _spread_spare_workers(models, b, w, budgets, float(np.max(_busy(pieces, p, b, w))))
    lo = np.full(len(b), opts.min_batch, dtype=np.int64)
    b = _settle(pieces, p, w, b, lo, cap_arr)
    return Found(batch_sizes=b, steps=np.ones(len(b), dtype=np.int64), workers=w, method=method, status=status)


def _settle(pieces: Pieces, p: np.ndarray, w: np.ndarray, b: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Balance among the ties at the step time, then polish by single samples (workers fixed)."""

    def busy(x: np.ndarray) -> np.ndarray:
        return _busy(pieces, p, x, w)

    T = float(np.max(busy(b)))
    b = _balance(busy, b, np.maximum(capacity(pieces, hi, T, (p, w)), b), lo, T)
    return _polish(busy, b, lo, hi)


MOVE_MIN_GAIN = 0.02
"""A worker move must make the predicted step at least this much faster: smaller gains are inside the model's
error, and chasing them walks the plan into corners (on the recorded profiles, moves led from [478, 34] on [28, 2]
workers to [495, 17] on [29, 1] for 0.01-2.8% -- the 2.8% by one move leaving rank 1 a single worker; on 2x H100
such a corner measured 124-157 ms a step against 121-138 for the splits beside it)."""
MAX_MOVES = 64
"""Most candidate moves ``improve_workers`` tries (one MILP each): past it -- a host of more than 8 loader-fed
ranks -- the search keeps the greedy workers."""


def improve_workers(found: Found, models: list[RankModel], models_at: Callable[[list[int]], list[RankModel]],
                    caps: list[int], budgets: dict[str, int], B: int,
                    opts: SolveOptions) -> tuple[Found, list[RankModel]]:
    """Move one loader worker between two ranks of a host when that makes the predicted step at least
    ``MOVE_MIN_GAIN`` faster, re-solving the batches at the candidate's workers (and the loader costs at its host
    load: ``models_at``; ``models``: at ``found``'s own workers); the best such move with its models, or ``found``
    with ``models``.

    Why: the workers are fixed greedily at a bisected step time (``bisect_workers``) and the MILP then places the
    samples around them, so a worker more on one rank and less on its neighbour is never tried.  On a
    skew profile (2x H100, rank 1 emulated 3x slower, all 30 workers of the host busy) the search planned
    [387, 125] on [22, 8] workers for a 103.1 ms step, while [393, 119] on [23, 7] predicts 100.1 ms
    (docs/PERFORMANCE.md).  One move, not a hill climb, and never taking a rank below 2 workers: the
    model's small gains lead to lopsided corners the runs did not bear out (``MOVE_MIN_GAIN``).  A plan without
    accumulation only, on hosts whose moves number at most ``MAX_MOVES``."""
    if int(found.steps.max()) > 1 or "workers" not in found.method:
        return found, models  # accumulating, or no loader bound the step (the compute-only MILP was optimal)
    on_host: dict[str, list[int]] = {}
    for i, m in enumerate(models):
        if not m.serial_loader:
            on_host.setdefault(m.host, []).append(i)
    if not 0 < sum(len(idx) * (len(idx) - 1) for idx in on_host.values()) <= MAX_MOVES:
        return found, models  # nothing to move, or too many moves to try (counted before listing)
    pairs = [(i, j) for idx in on_host.values() for i in idx for j in idx if i != j]
    best, best_models, t_best = found, models, _step(models, found) * (1 - MOVE_MIN_GAIN)
    for i, j in pairs:
        w = found.workers.copy()
        if w[i] <= 2 or w[j] >= models[j].max_workers:  # a loader of one worker has nothing to absorb a slow batch
            continue
        w[i] -= 1
        w[j] += 1
        moved = models_at(w.tolist())
        cand = at_workers(moved, caps, budgets, B, opts, w, method=f"{found.method}+move")
        t = _step(moved, cand)
        if t < t_best:
            best, best_models, t_best = cand, moved, t
    return best, best_models


def at_workers(models: list[RankModel], caps: list[int], budgets: dict[str, int], B: int, opts: SolveOptions,
               w: np.ndarray, *, method: str) -> Found:
    """The best batches with the workers fixed at ``w`` (``_optimize``'s second step, then the same settling)."""
    pieces, p, _, _ = _arrays(models, budgets)
    cap_arr = np.asarray(caps, dtype=np.int64)
    b, _, status = solve_milp(pieces, cap_arr, B, opts.min_batch, loader=(p, w), time_limit_s=opts.time_limit_s)
    b = _settle(pieces, p, w, b, np.full(len(b), opts.min_batch, dtype=np.int64), cap_arr)
    return Found(batch_sizes=b, steps=np.ones(len(b), dtype=np.int64), workers=w, method=method, status=status)


# -- with accumulation -------------------------------------------------------------------------------------------
def _accumulation(models: list[RankModel], pieces: Pieces, opts: SolveOptions) -> Accumulation:
    return Accumulation(
        pieces=pieces,
        optimizer_s=np.array([m.optimizer_s for m in models], dtype=float),
        micro_caps=np.array([np.inf if m.micro_cap is None else float(m.micro_cap) for m in models]),
        max_steps=np.array([m.max_steps for m in models], dtype=np.int64),
        min_batch=opts.min_batch,
        shared=opts.mode == "fsdp",
    )


def _optimize_accumulated(models: list[RankModel], arrays: Arrays, budgets: dict[str, int], B: int,
                          opts: SolveOptions, *, start_hi: float | None) -> Found:
    """The same two steps over (b, k).  The micro-steps come first: bisection on the step time with the
    capacities n_i(T) = max_k n_i(T, k) brackets the optimum T*, the second stage picks the fewest micro-steps
    that hold B at its upper end, and the MILP then places the samples with those k fixed -- the program without
    accumulation over the curves tau_i(., k_i).  Where that is infeasible (the min_batch edge of
    planner._accumulation) the MILP over (b, k) together decides."""
    pieces, p, hosts, host_budget = arrays
    acc = _accumulation(models, pieces, opts)
    caps = np.array([B if m.batch_cap is None else min(m.batch_cap, B) for m in models], dtype=np.int64)
    serial = np.array([m.serial_loader for m in models])
    b, k, status = _place(acc, pieces, caps, B, opts, loader=None, start_hi=start_hi)
    method = "milp+accumulation"
    T = float(np.max(acc.times(b, k)))
    w = _workers_at(models, p, b, T)
    if _over_budget(models, w, hosts, host_budget):
        max_w = np.array([m.max_workers for m in models])
        w, t_fed = bisect_workers(pieces, caps, B, opts.min_batch, p, hosts, host_budget, T, max_w, acc)
        w = np.where(serial, 0, w)
        b, k, status = _place(acc, pieces, caps, B, opts, loader=(p, w), start_hi=t_fed)
        method = "milp+accumulation+workers"
    w = _spread_spare_workers(models, b, w, budgets,
                              float(np.max(np.maximum(acc.times(b, k), _loader_time(p, b, w)))))
    b = _settle(acc.at_steps(k), p, w, b, opts.min_batch * k, np.minimum(caps, k * acc.micro_caps))
    return Found(batch_sizes=b, steps=np.minimum(k, acc.fewest(b)), workers=w, method=method, status=status)


def _place(acc: Accumulation, pieces: Pieces, caps: np.ndarray, B: int, opts: SolveOptions, *,
           loader: tuple[np.ndarray, np.ndarray] | None, start_hi: float | None) -> tuple[np.ndarray, np.ndarray, str]:
    """(b, k, status): the fewest micro-steps at the bracketed optimum, then the MILP with k fixed."""
    lo, hi = bracket(pieces, caps, B, opts.min_batch, loader, acc, start_hi)
    fewest = acc.fewest_steps(caps, hi * (1 + 1e-12), B, feed(hi * (1 + 1e-12), loader))
    if fewest is not None:
        k = fewest[0]
        try:
            # lo bounds every k (it is below the optimum over all of them); hi fits with these k.
            b, _, status = solve_milp(acc.at_steps(k), np.minimum(caps, k * acc.micro_caps).astype(np.int64),
                                      B, opts.min_batch * k, loader=loader, time_limit_s=opts.time_limit_s,
                                      known=(lo, hi * (1 + 1e-12)))
            return b, k, status
        except PlanError:
            pass
    return solve_milp(pieces, caps, B, opts.min_batch, loader=loader, time_limit_s=opts.time_limit_s, acc=acc)


# -- balance, polish, spare workers --------------------------------------------------------------------------------
def _balance(busy: Busy, b: np.ndarray, U: np.ndarray, lo: np.ndarray, T: float) -> np.ndarray:
    """Among splits with the optimal step time T*, take the one that loads every rank to the same fraction of
    what it can finish within T* (U): b_i proportional to n_i(T*), each at least lo_i.

    Where curves are steep this changes nothing (sum_i n_i(T*) is about B).  Where they are flat -- a GPU
    bound by kernel launches, not arithmetic -- many splits tie at T*, and the MILP would return an arbitrary
    extreme one (one rank with almost everything), which the first unmodelled overhead makes slower than an
    even split (seen on H200: ResNet-18 at 32x32, [1022, 2] ran 0.77x the equal split).  The proportional
    choice keeps every rank's slack alike, so errors in the model cost the least.
    """
    B = int(b.sum())
    x = B * U / U.sum()
    try:
        # Shifted by the (integer) lower bounds: exact in floating point, so a uniform bound rounds as before.
        out = lo + np.asarray(largest_remainder((x - lo).tolist(), B - int(lo.sum()), lo=0, hi=(U - lo).tolist()),
                              dtype=np.int64)
    except PlanError:
        return b
    if out.sum() != B or np.max(busy(out)) > T * (1 + 1e-12):
        return b
    return out


def _polish(busy: Busy, b: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Move single samples off the slowest rank while that lowers the step time (each b_i within [lo_i, hi_i]).

    The MILP is optimal up to HiGHS's tolerances; this pass makes the one-sample exchange property exact.
    """
    b = b.copy()
    n = len(b)
    if n == 1:
        return b
    for _ in range(10 * n + 1000):
        times = busy(b)
        j = int(np.argmax(times))
        if b[j] <= lo[j]:
            break
        plus = np.where(b < hi, busy(b + 1), np.inf)
        plus[j] = np.inf
        i = int(np.argmin(plus))
        bj = b.copy()
        bj[j] -= 1
        new_tj = float(busy(bj)[j])
        rest = np.delete(times, [i, j])
        new_max = max(float(plus[i]), new_tj, float(rest.max()) if rest.size else 0.0)
        if not new_max < times[j] * (1 - 1e-12):
            break
        b[i] += 1
        b[j] -= 1
    return b


SPARE_LOADER_SHARE = 0.5
"""Spare cores go to a rank's loader until its build time is at most this share of the step: twice the pace it needs,
against a host whose cores run 1.7x slower from one second to the next (docs/PERFORMANCE.md).  Past it a
worker only takes memory (its prefetched batches) and start-up time."""


def _spread_spare_workers(models: list[RankModel], b: np.ndarray, w: np.ndarray,
                          budgets: dict[str, int], step_s: float) -> np.ndarray:
    """Hand a host's unused cores to its busiest loaders first, up to each rank's worker cap, while the loader
    takes more than ``SPARE_LOADER_SHARE`` of the step ``step_s``."""
    w = w.copy()
    on_host: dict[str, list[int]] = {h: [] for h in budgets}
    for i, m in enumerate(models):
        if not m.serial_loader:
            on_host[m.host].append(i)
    enough = SPARE_LOADER_SHARE * step_s
    for h, budget in budgets.items():
        idx = on_host[h]
        spare = budget - int(sum(w[i] for i in idx))
        heap = [(-models[i].sec_per_sample * b[i] / w[i], i) for i in idx if w[i] < models[i].max_workers]
        heapq.heapify(heap)
        while spare > 0 and heap:
            load, i = heapq.heappop(heap)
            if -load <= enough:  # the busiest loader has its slack: so have the others
                break
            w[i] += 1
            spare -= 1
            if w[i] < models[i].max_workers:
                heapq.heappush(heap, (-models[i].sec_per_sample * b[i] / w[i], i))
    return w
