"""The MILP and the fast bounds that keep it small.  Used by planner.solve; no public API here.

Notation (per rank i): compute pieces t_i(b) = max_k s_ik*b + c_ik, integer cap u_i, loader p_i CPU-s/sample,
w_i workers (fixed while the MILP runs).  For a step time T the most samples rank i can take is
    n_i(T) = min(u_i, floor(min_k (T - c_ik) / s_ik), floor(w_i * T / p_i))
which is non-decreasing in T, so  F(T) = sum_i n_i(T) >= B  is monotone and bisection on T brackets the optimal
step time T* between an infeasible `lo` and a feasible `hi` (relative width 1e-12) in ~50 vectorized passes.
The MILP (scipy.optimize.milp / HiGHS, b integer, T continuous) then runs with  lo <= T <= hi*(1+1e-9)  as
valid bounds -- they cut nothing off that could be optimal, and they let HiGHS finish at any scale instead of
branching over thousands of near-equivalent integer vectors (4096 ranks: ~0.3 s instead of > 20 s).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from planner.curves import Envelope
from planner.errors import PlanError


@dataclass(frozen=True, slots=True)
class Pieces:
    """Every rank's envelope as padded (W, K) arrays; padding pieces never bind."""

    slopes: np.ndarray
    intercepts: np.ndarray

    @classmethod
    def of(cls, envs: Sequence[Envelope]) -> Pieces:
        k = max(len(e.slopes) for e in envs)
        s = np.zeros((len(envs), k))
        c = np.full((len(envs), k), -np.inf)
        for i, e in enumerate(envs):
            s[i, : len(e.slopes)] = e.slopes
            c[i, : len(e.intercepts)] = e.intercepts
        return cls(s, c)

    def times(self, b: np.ndarray) -> np.ndarray:
        return np.max(self.slopes * np.asarray(b, dtype=float)[:, None] + self.intercepts, axis=1)

    def max_batch(self, T: float) -> np.ndarray:
        """floor of the largest b with t_i(b) <= T (a large number where every piece is flat and below T)."""
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            per_piece = np.where(self.slopes > 0, (T - self.intercepts) / self.slopes, np.inf)
        bound = np.min(per_piece, axis=1)
        flat_over = np.any((self.slopes <= 0) & (self.intercepts > T), axis=1)
        bound = np.where(flat_over, -1.0, bound)
        return np.floor(np.minimum(bound, 1e15) * (1 + 1e-12) + 1e-9)


def capacity(
    pieces: Pieces, caps: np.ndarray, T: float, loader: tuple[np.ndarray, np.ndarray] | None
) -> np.ndarray:
    """n_i(T): most samples each rank finishes within T (see module docstring)."""
    n = np.minimum(caps, pieces.max_batch(T))
    if loader is not None:
        p, w = loader
        with np.errstate(divide="ignore", over="ignore"):
            feed = np.where(p > 0, np.floor(w * T / np.where(p > 0, p, 1.0) * (1 + 1e-12) + 1e-9), np.inf)
        n = np.minimum(n, feed)
    return n


def bracket(
    pieces: Pieces,
    caps: np.ndarray,
    B: int,
    min_batch: int,
    loader: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[float, float]:
    """(lo, hi): F(lo) < B <= F(hi) (or lo == hi when the smallest admissible T already fits B)."""
    floor_t = float(np.max(pieces.times(np.full(len(caps), min_batch))))
    if loader is not None:
        p, w = loader
        floor_t = max(floor_t, float(np.max(np.where(w > 0, p * min_batch / np.maximum(w, 1), 0.0))))

    def fits(T: float) -> bool:
        return float(np.sum(np.maximum(capacity(pieces, caps, T, loader), 0))) >= B

    if fits(floor_t):
        return floor_t, floor_t
    hi = max(floor_t * 2, float(np.max(pieces.times(caps.astype(float)))))
    for _ in range(200):
        if fits(hi):
            break
        hi *= 2
    else:  # pragma: no cover - caps were checked to hold B
        raise PlanError(f"global batch {B} cannot be reached at any step time")
    lo = floor_t
    for _ in range(200):
        if hi - lo <= 1e-12 * hi:
            break
        mid = 0.5 * (lo + hi)
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return lo, hi


def solve_milp(
    pieces: Pieces,
    caps: np.ndarray,
    B: int,
    min_batch: int,
    *,
    loader: tuple[np.ndarray, np.ndarray] | None,
    time_limit_s: float,
) -> tuple[np.ndarray, str]:
    """Integer b minimizing T = max_i step_i(b_i) with sum b = B (workers fixed).  Returns (b, status)."""
    n = len(caps)
    lo, hi = bracket(pieces, caps, B, min_batch, loader)
    scale = hi if hi > 0 else 1.0  # T about 1: HiGHS tolerances are absolute
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    rhs: list[float] = []
    r = 0
    W, K = pieces.slopes.shape
    for i in range(W):
        for k in range(K):
            c = pieces.intercepts[i, k]
            if not math.isfinite(c):
                continue
            # s*b_i - T <= -c
            rows += [r, r]
            cols += [i, n]
            vals += [pieces.slopes[i, k] / scale, -1.0]
            rhs.append(-c / scale)
            r += 1
    if loader is not None:
        p, w = loader
        for j in np.flatnonzero(p > 0).tolist():
            # p*b_j - w*T <= 0   (w fixed: the bilinear row becomes linear)
            rows += [r, r]
            cols += [j, n]
            vals += [p[j] / scale, -float(w[j])]
            rhs.append(0.0)
            r += 1
    A = coo_matrix((vals, (rows, cols)), shape=(r, n + 1)).tocsr()
    A_sum = coo_matrix((np.ones(n), (np.zeros(n, dtype=int), np.arange(n))), shape=(1, n + 1)).tocsr()
    cost = np.zeros(n + 1)
    cost[n] = 1.0
    upper_T = hi / scale * (1 + 1e-9)
    res = milp(
        cost,
        constraints=[LinearConstraint(A, -np.inf, np.array(rhs)), LinearConstraint(A_sum, B, B)],
        bounds=Bounds(np.r_[np.full(n, float(min_batch)), lo / scale], np.r_[caps.astype(float), upper_T]),
        integrality=np.r_[np.ones(n), 0.0],
        options={"time_limit": time_limit_s, "mip_rel_gap": 1e-9},
    )
    if res.x is not None and res.status in (0, 1):
        b = np.rint(res.x[:n]).astype(np.int64)
        if int(b.sum()) == B and np.all(b >= min_batch) and np.all(b <= caps):
            return b, "optimal" if res.status == 0 else "time_limit"
    # The bounds are valid, so this only happens on HiGHS numerical trouble; the bracket's capacities at `hi`
    # are themselves a feasible integer point with T <= hi.
    return _from_capacity(capacity(pieces, caps, hi, loader), B, min_batch), f"bracket (HiGHS status {res.status})"


def _from_capacity(cap: np.ndarray, B: int, min_batch: int) -> np.ndarray:
    """Integer b <= cap with sum B, trimming the ranks with the most spare first."""
    b = np.maximum(cap, min_batch).astype(np.int64)
    excess: int = int(b.sum()) - B
    order = np.argsort(-(b - min_batch), kind="stable")
    for i in order:
        if excess <= 0:
            break
        take = int(min(excess, int(b[i]) - min_batch))
        b[i] -= take
        excess -= take
    return b


def greedy_workers(
    pieces: Pieces,
    caps: np.ndarray,
    p: np.ndarray,
    hosts: np.ndarray,
    budgets: np.ndarray,
    T: float,
    max_workers: np.ndarray,
) -> np.ndarray:
    """Workers per rank at step time T: one each, then spare cores to the loaders that turn one more worker
    into the most extra samples (cheapest per-sample cost first), until a rank's compute cap or its own
    worker cap is reached."""
    compute_cap = np.minimum(caps, pieces.max_batch(T))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        per_worker = np.where(p > 0, T / np.where(p > 0, p, 1.0), np.inf)  # samples one worker feeds in T
        need = np.where(p > 0, np.ceil(np.maximum(compute_cap, 1) / per_worker - 1e-9), 1.0)
    need = np.minimum(np.maximum(need, 1), np.maximum(max_workers, 1)).astype(np.int64)
    w = np.ones(len(caps), dtype=np.int64)
    for h in np.unique(hosts):
        idx = np.flatnonzero(hosts == h)
        spare = int(budgets[h]) - len(idx)
        if spare <= 0:
            continue
        order = idx[np.argsort(-per_worker[idx], kind="stable")]
        extra = need[order] - 1
        before = np.cumsum(extra) - extra
        w[order] += np.clip(spare - before, 0, extra)
    return w


def bisect_workers(
    pieces: Pieces,
    caps: np.ndarray,
    B: int,
    min_batch: int,
    p: np.ndarray,
    hosts: np.ndarray,
    budgets: np.ndarray,
    t_lo: float,
    max_workers: np.ndarray,
) -> np.ndarray:
    """Fix the workers: the greedy allocation at the smallest T (bisection) where it feeds the global batch."""

    def fits(T: float) -> tuple[bool, np.ndarray]:
        w = greedy_workers(pieces, caps, p, hosts, budgets, T, max_workers)
        return float(np.sum(np.maximum(capacity(pieces, caps, T, (p, w)), 0))) >= B, w

    ok, w = fits(t_lo)
    if ok:
        return w
    hi = t_lo * 2
    for _ in range(200):
        ok, w = fits(hi)
        if ok:
            break
        hi *= 2
    else:
        raise PlanError("the hosts' cores cannot feed the global batch at any step time")
    lo = t_lo
    while hi - lo > 1e-9 * hi:
        mid = 0.5 * (lo + hi)
        ok, wm = fits(mid)
        if ok:
            hi, w = mid, wm
        else:
            lo = mid
    return w
