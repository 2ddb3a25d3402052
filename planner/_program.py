"""The MILP and the fast bounds that keep it small.  Used by planner.solve; no public API here.

Notation (per rank i): compute pieces t_i(b) = max_k s_ik*b + c_ik, integer cap u_i, loader p_i CPU-s/sample,
w_i workers (fixed while the MILP runs).  For a step time T the most samples rank i can take is
    n_i(T) = min(u_i, floor(min_k (T - c_ik) / s_ik), floor(w_i * T / p_i))
which is non-decreasing in T, so  F(T) = sum_i n_i(T) >= B  is monotone and bisection on T brackets the optimal
step time T* between an infeasible `lo` and a feasible `hi` (relative width 1e-12) in ~50 vectorized passes.
The MILP (scipy.optimize.milp / HiGHS, b integer, T continuous) then runs with  lo <= T <= hi*(1+1e-9)  as
valid bounds -- they cut nothing off that could be optimal, and they let HiGHS finish at any scale instead of
branching over thousands of near-equivalent integer vectors (4096 ranks: ~0.3 s instead of > 20 s).

With gradient accumulation (an ``Accumulation``, planner._accumulation) each rank also has an integer micro-step
count k_i (one K shared by all ranks under fsdp), n_i(T) is the best over k of n_i(T, k), and the MILP gains the
rows  s_p b_i + (c_p - o_i) k_i + o_i <= T,  b_i <= u_i k_i  and  min_batch k_i <= b_i.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from planner.curves import Envelope
from planner.errors import PlanError

if TYPE_CHECKING:
    from planner._accumulation import Accumulation


@dataclass(frozen=True, slots=True)
class Pieces:
    """Every rank's envelope as padded (W, K) arrays; padding pieces never bind."""

    slopes: np.ndarray
    intercepts: np.ndarray
    _rising: np.ndarray = field(init=False, repr=False)
    _divisor: np.ndarray = field(init=False, repr=False)
    _flat: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # max_batch runs ~100 times per solve: its masks and a zero-free divisor are built once (no errstate).
        object.__setattr__(self, "_rising", self.slopes > 0)
        object.__setattr__(self, "_divisor", np.where(self.slopes > 0, self.slopes, 1.0))
        object.__setattr__(self, "_flat", self.slopes <= 0)

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
        with np.errstate(over="ignore", invalid="ignore"):  # tiny slopes: a bound past 1e308 is inf, as meant
            per_piece = np.where(self._rising, (T - self.intercepts) / self._divisor, np.inf)
        bound = np.min(per_piece, axis=1)
        flat_over = np.any(self._flat & (self.intercepts > T), axis=1)
        bound = np.where(flat_over, -1.0, bound)
        return np.floor(np.minimum(bound, 1e15) * (1 + 1e-12) + 1e-9)


def feed(T: float, loader: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray | None:
    """floor(w_i * T / p_i): the most samples rank i's workers load within T (None: no loader rows)."""
    if loader is None:
        return None
    p, w = loader
    with np.errstate(divide="ignore", over="ignore"):
        return np.where(p > 0, np.floor(w * T / np.where(p > 0, p, 1.0) * (1 + 1e-12) + 1e-9), np.inf)


def capacity(
    pieces: Pieces, caps: np.ndarray, T: float, loader: tuple[np.ndarray, np.ndarray] | None,
    acc: Accumulation | None = None,
) -> np.ndarray:
    """n_i(T): most samples each rank finishes within T (see module docstring)."""
    fed = feed(T, loader)
    if acc is not None:
        return acc.capacity(caps, T, fed)[0]
    n = np.minimum(caps, pieces.max_batch(T))
    return n if fed is None else np.minimum(n, fed)


SCALAR_RANKS = 32
"""Up to this many ranks (and without accumulation) ``bracket`` evaluates F(T) in plain Python floats: numpy's
per-call overhead on (W, K) arrays this small costs ~10x the arithmetic (~70 us a pass, ~40 passes a bracket).
The arithmetic is ``capacity``'s, operation for operation in IEEE double, so the bracket is the same to the bit."""


def _scalar_rows(pieces: Pieces, caps: np.ndarray,
                 loader: tuple[np.ndarray, np.ndarray] | None) -> list[tuple[list[tuple[float, float]], float, float,
                                                                             float, float]]:
    """Per rank: its rising pieces (c, s), the largest flat piece's value, its cap, its loader (w, p) or (0, 0)."""
    rows = []
    for i in range(len(caps)):
        rising = [(float(c), float(s)) for s, c in zip(pieces.slopes[i], pieces.intercepts[i], strict=True) if s > 0]
        flat = [float(c) for s, c in zip(pieces.slopes[i], pieces.intercepts[i], strict=True) if s <= 0]
        w, p = (float(loader[1][i]), float(loader[0][i])) if loader is not None else (0.0, 0.0)
        rows.append((rising, max(flat, default=-math.inf), float(caps[i]), w, p))
    return rows


def _scalar_total(rows: list[tuple[list[tuple[float, float]], float, float, float, float]], T: float) -> float:
    """sum_i max(n_i(T), 0) as ``capacity`` computes it (Pieces.max_batch, then feed)."""
    total = 0.0
    for rising, flat_max, cap, w, p in rows:
        if flat_max > T:
            bound = -1.0
        else:
            bound = min(((T - c) / s for c, s in rising), default=math.inf)
        n = min(cap, math.floor(min(bound, 1e15) * (1 + 1e-12) + 1e-9))
        if p > 0:
            fed = w * T / p * (1 + 1e-12) + 1e-9
            if fed != fed:  # 0 workers at T = inf: nan, which numpy carries into the sum (never >= B)
                return math.nan
            n = min(n, math.floor(fed) if fed < math.inf else fed)
        total += max(n, 0)
    return total


def bracket(
    pieces: Pieces,
    caps: np.ndarray,
    B: int,
    min_batch: int | np.ndarray,
    loader: tuple[np.ndarray, np.ndarray] | None = None,
    acc: Accumulation | None = None,
    start_hi: float | None = None,
) -> tuple[float, float]:
    """(lo, hi): F(lo) < B <= F(hi) (or lo == hi when the smallest admissible T already fits B).

    ``min_batch`` may differ per rank (min_batch * k_i with k_i micro-steps fixed); ``start_hi`` is a step time
    known to fit (the search doubles from there instead of from the largest batches' times)."""
    floor_t = float(np.max(pieces.times(np.broadcast_to(np.asarray(min_batch, dtype=float), (len(caps),)))))
    if loader is not None:
        p, w = loader
        floor_t = max(floor_t, float(np.max(np.where(w > 0, p * min_batch / np.maximum(w, 1), 0.0))))

    if acc is None and len(caps) <= SCALAR_RANKS:
        rows = _scalar_rows(pieces, caps, loader)

        def fits(T: float) -> bool:
            return _scalar_total(rows, T) >= B
    else:
        def fits(T: float) -> bool:
            return float(np.sum(np.maximum(capacity(pieces, caps, T, loader, acc), 0))) >= B

    if fits(floor_t):
        return floor_t, floor_t
    if start_hi is not None:
        hi = max(start_hi, floor_t * 2)
    elif acc is not None:  # caps are whole-step caps here (up to B): their times say little, double from the floor
        hi = floor_t * 2
    else:
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
    min_batch: int | np.ndarray,
    *,
    loader: tuple[np.ndarray, np.ndarray] | None,
    time_limit_s: float,
    acc: Accumulation | None = None,
    known: tuple[float, float] | None = None,
) -> tuple[np.ndarray, np.ndarray, str]:
    """Integer b (and micro-steps k) minimizing T = max_i step_i(b_i, k_i) with sum b = B (workers fixed).

    Returns (b, k, status); k is all ones without ``acc``.  ``min_batch`` may be per rank (see ``bracket``).
    ``known`` is a bracket (lo, hi) found by the caller: T* >= lo holds, and hi is checked to fit.
    """
    # Imported here: scipy.optimize takes ~0.7 s of CPU to import, and most processes that import the package never
    # solve (every rank but rank 0 receives its plan; `planner train --plan` solves nothing).
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csc_array

    n = len(caps)
    lower = np.broadcast_to(np.asarray(min_batch, dtype=np.int64), (n,))
    if known is not None and float(np.sum(np.maximum(capacity(pieces, caps, known[1], loader, acc), 0))) >= B:
        lo, hi = known
    else:
        lo, hi = bracket(pieces, caps, B, lower, loader, acc, None if known is None else known[1])
    scale = hi if hi > 0 else 1.0  # T about 1: HiGHS tolerances are absolute
    # Columns: b_0..b_{n-1}, then the micro-step counts (n, or one shared K under fsdp; none without acc), then T.
    nk = 0 if acc is None else (1 if acc.shared else n)
    t_col = n + nk
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    rhs: list[float] = []
    r = 0

    def row(entries: list[tuple[int, float]], bound: float) -> None:
        nonlocal r
        for col, v in entries:
            rows.append(r)
            cols.append(col)
            vals.append(v)
        rhs.append(bound)
        r += 1

    W, P = pieces.slopes.shape
    for i in range(W):
        for q in range(P):
            c = pieces.intercepts[i, q]
            if math.isfinite(c):
                row([(i, pieces.slopes[i, q] / scale), (t_col, -1.0)], -c / scale)  # s*b_i - T <= -c
    k_hi = np.ones(nk)
    if acc is not None:
        k_max = acc.steps_needed(caps, hi)  # more steps never help at T <= hi (planner._accumulation)
        k_hi = np.array([float(k_max.max())]) if acc.shared else k_max.astype(float)
        live = acc.live
        for i in range(n):
            kc = n + (0 if acc.shared else i)
            if acc.shared or k_max[i] > 1:
                o = float(acc.optimizer_s[i])
                for q in np.flatnonzero(live[i]).tolist():
                    # s*b_i + (c - o)*k_i - T <= -o
                    row([(i, pieces.slopes[i, q] / scale), (kc, (pieces.intercepts[i, q] - o) / scale),
                         (t_col, -1.0)], -o / scale)
                row([(kc, float(lower[i])), (i, -1.0)], 0.0)  # min_batch*k_i <= b_i: no micro-batch too small
            u = float(acc.micro_caps[i])
            if math.isfinite(u):
                row([(i, 1.0), (kc, -u)], 0.0)  # b_i <= u_i * k_i
    if loader is not None:
        p, w = loader
        for j in np.flatnonzero(p > 0).tolist():
            # p*b_j - w*T <= 0   (w fixed: the bilinear row becomes linear)
            row([(j, p[j] / scale), (t_col, -float(w[j]))], 0.0)
    row([(i, 1.0) for i in range(n)], float(B))  # sum b = B (its lower bound set below)
    # One constraint matrix, built in the column format HiGHS takes: milp converts and stacks nothing.
    A = csc_array((vals, (rows, cols)), shape=(r, t_col + 1))
    lower_rows = np.full(r, -np.inf)
    lower_rows[-1] = B
    constraint = LinearConstraint(A, lower_rows, np.array(rhs))
    cost = np.zeros(t_col + 1)
    cost[t_col] = 1.0
    status = ""
    for upper_T in (hi / scale * (1 + 1e-9), np.inf):
        res = milp(
            cost,
            constraints=constraint,
            bounds=Bounds(np.r_[lower.astype(float), np.ones(nk), lo / scale],
                          np.r_[caps.astype(float), k_hi, upper_T]),
            integrality=np.r_[np.ones(n + nk), 0.0],
            options={"time_limit": time_limit_s, "mip_rel_gap": 1e-9},
        )
        if res.x is not None and res.status in (0, 1):
            b = np.rint(res.x[:n]).astype(np.int64)
            k = np.ones(n, dtype=np.int64) if acc is None else np.rint(res.x[n:t_col]).astype(np.int64)
            k = np.broadcast_to(k, (n,)).copy()
            if int(b.sum()) == B and np.all(b >= lower) and np.all(b <= caps):
                return b, k, "optimal" if res.status == 0 else "time_limit"
        status = f"HiGHS status {res.status}"
        if acc is None or res.status != 2:
            break
        # Infeasible below `hi` happens only at the min_batch edge of accumulation (planner._accumulation):
        # search again without the upper bound.
    if acc is not None:
        n_hi, k = acc.capacity(caps, hi, feed(hi, loader))
        if float(np.maximum(n_hi, 0).sum()) < B:
            raise PlanError(f"no split of global batch {B} into micro-batches of at least min batch {int(lower[0])} "
                            f"within the memory caps was found ({status})")
        b = _from_capacity(n_hi, B, lower)
        return b, acc.fewest(b), f"bracket ({status})"
    # The bounds are valid, so this only happens on HiGHS numerical trouble; the bracket's capacities at `hi`
    # are themselves a feasible integer point with T <= hi.
    return _from_capacity(capacity(pieces, caps, hi, loader), B, lower), np.ones(n, dtype=np.int64), \
        f"bracket ({status})"


def _from_capacity(cap: np.ndarray, B: int, lower: np.ndarray) -> np.ndarray:
    """Integer b <= cap with sum B, trimming the ranks with the most spare first."""
    b = np.maximum(cap, lower).astype(np.int64)
    excess: int = int(b.sum()) - B
    order = np.argsort(-(b - lower), kind="stable")
    for i in order:
        if excess <= 0:
            break
        take = int(min(excess, int(b[i]) - int(lower[i])))
        b[i] -= take
        excess -= take
    return b


def greedy_workers(
    compute_cap: np.ndarray,
    p: np.ndarray,
    hosts: np.ndarray,
    budgets: np.ndarray,
    T: float,
    max_workers: np.ndarray,
) -> np.ndarray:
    """Workers per rank at step time T: one each, then spare cores to the loaders that turn one more worker
    into the most extra samples (cheapest per-sample cost first), until a rank's compute cap (what it can finish
    within T, ``compute_cap``) or its own worker cap is reached.

    Ranks of a host whose loaders cost the same per sample (the usual case: one dataset and pipeline) tie: any
    split of the cores among them feeds as many samples.  Where the cores cannot give all of them what they need,
    they share in proportion to it, so every rank is fed the same fraction of its compute cap.  Handed out in rank
    order instead, the first ranks took all they needed and the last were starved (2x H100, rank 1
    emulated 3x slower: 29 workers and 1, [495, 17] -- rank 0 with its compute, loader and hand-over all at the
    step; it ran 124-157 ms a step, splits fed [23, 7] to [25, 5] 121-138 ms in other launches)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        per_worker = np.where(p > 0, T / np.where(p > 0, p, 1.0), np.inf)  # samples one worker feeds in T
        need = np.where(p > 0, np.ceil(np.maximum(compute_cap, 1) / per_worker - 1e-9), 1.0)
    need = np.minimum(np.maximum(need, 1), np.maximum(max_workers, 1)).astype(np.int64)
    # Host by host, groups of equal loading cost, cheapest first, each group taking what it needs of the host's
    # spare cores while they last, shared in proportion to its ranks' needs when they do not (all vectorized:
    # this runs ~100 times a solve, over thousands of ranks).
    order = np.lexsort((-per_worker, hosts))
    h, c = hosts[order], per_worker[order]
    new_group = np.r_[True, (h[1:] != h[:-1]) | ~np.isclose(c[1:], c[:-1], rtol=1e-9, atol=0.0)]
    group = np.cumsum(new_group) - 1  # group index of each rank in ``order``
    starts = np.flatnonzero(new_group)
    extra = (need[order] - 1).astype(np.int64)
    want = np.add.reduceat(extra, starts)  # each group's extra workers
    gh = h[starts]  # each group's host
    host_first = np.r_[True, gh[1:] != gh[:-1]]
    before = np.cumsum(want) - want  # wanted by earlier groups, counted over all hosts ...
    before -= np.repeat(before[host_first], np.diff(np.r_[np.flatnonzero(host_first), len(gh)]))  # ... of its host
    spare = budgets[gh] - np.bincount(hosts, minlength=len(budgets))[gh]
    got = np.clip(spare - before, 0, want)  # what each group gets
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(want[group] > 0, extra * (got / np.maximum(want, 1))[group], 0.0)
    give = np.floor(share + 1e-9).astype(np.int64)
    rest = got - np.add.reduceat(give, starts)  # cores left in each group by the rounding down
    # The largest remainders take them (ties to the lower rank): rank within the group by remainder.
    by = np.lexsort((order, -(share - give), group))
    pos = np.empty(len(order), dtype=np.int64)
    pos[by] = np.arange(len(order)) - starts[group[by]]
    give += (pos < rest[group]).astype(np.int64)
    w = np.ones(len(p), dtype=np.int64)
    w[order] += give
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
    acc: Accumulation | None = None,
) -> tuple[np.ndarray, float]:
    """Fix the workers: the greedy allocation at the smallest T (bisection) where it feeds the global batch.
    Returns (workers, that T)."""

    def fits(T: float) -> tuple[bool, np.ndarray]:
        compute_cap = capacity(pieces, caps, T, None, acc)
        w = greedy_workers(compute_cap, p, hosts, budgets, T, max_workers)
        fed = feed(T, (p, w))
        assert fed is not None
        # = capacity(pieces, caps, T, (p, w), acc): the feed caps every micro-step count alike
        n = np.minimum(compute_cap, fed)
        if acc is not None:
            n = np.where(fed < min_batch, -1.0, n)
        return float(np.sum(np.maximum(n, 0))) >= B, w

    ok, w = fits(t_lo)
    if ok:
        return w, t_lo
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
    return w, hi
