"""Gradient accumulation in the program: micro-steps under a memory cap, what they cost, what they hold.

Used by planner._program and planner.solve; no public API here.

The model.  Rank i's optimizer step is k_i micro-steps (forward+backward) whose micro-batches sum to its batch
b_i, each at most its memory cap u_i, then one optimizer step.  The profile's curve t_i(b) = max_p s_p b + c_p
times a full step, optimizer included; with o_i the optimizer step's time (``RankProfile.optimizer_step_s``, 0
when unmeasured -- which charges it on every micro-step, the conservative side) a micro-batch m costs t_i(m) - o_i,
so k micro-batches of b/k cost

    k * (t_i(b/k) - o_i) + o_i  =  max_p (s_p * b + (c_p - o_i) * k) + o_i

the perspective of a convex piecewise-linear function: LINEAR in (b, k), one row per piece, so the program stays a
MILP with integer k_i >= 1 and  b_i <= u_i * k_i.  Real micro-batches are b/k rounded (sizes ceil(b/k) then
floor(b/k)); by convexity uneven micro-batches cost at least the even split the formula prices, and with one piece
the formula is exact.  Every micro-batch holds at least min_batch samples (BatchNorm runs on each forward):
b_i >= min_batch * k_i.

One more row per piece, the curve itself  T >= s_p * b + c_p,  says that k micro-steps never finish sooner than
the same samples in one step.  Without it a fitted piece with a negative intercept (every flat-then-linear GPU
curve past its knot has one) would make splitting a batch look cheaper than running it whole -- an artifact of
the fit, not what a GPU does -- and ranks with memory to spare would accumulate "for speed".  With it, the pieces
with c_p <= o_i are dominated and never bind on k, and the modelled step time

    tau_i(b, k) = max(t_i(b),  max_{p: c_p > o_i} s_p b + (c_p - o_i) k + o_i)

is non-decreasing in b and in k.  Hence the most samples rank i finishes within T in k micro-steps,

    n_i(T, k) = min(cap_i, k u_i, floor max{b: tau_i(b, k) <= T})     (-1 when below min_batch * k),

bounds every feasible (b_i, k_i) -- any b in [min_batch * k, n_i(T, k)] runs in k micro-steps or fewer within T
(up to the min_batch edge where u_i < 2 min_batch - 1) -- and more micro-steps than
k0_i = ceil(min(cap_i, max{b: t_i(b) <= T}) / u_i)  never add capacity.  Under mode "fsdp" every rank runs the
same K (one integer shared by all ranks).

Fewest micro-steps among equal optima.  After the MILP has found the optimal step time T*, a second stage picks
the micro-step counts with the smallest sum that still hold B at T*.  It is not a second MILP: rank i's best
capacity with at most k micro-steps, R_i(k) = max_{j <= k} n_i(T*, j), grows by u_i per step and then by less,
never more (concave), so taking the largest next gain first is exact for "fewest steps whose capacities reach B"
(separable concave allocation) and costs a heap pass instead of a MILP.  An epsilon term on sum k in the
objective was the alternative; it would trade step time against micro-steps at a scale HiGHS's tolerances blur.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from planner._program import Pieces


def _floor(x: np.ndarray) -> np.ndarray:
    """floor, forgiving the last bits of rounding (as Pieces.max_batch does)."""
    return np.floor(np.minimum(x, 1e15) * (1 + 1e-12) + 1e-9)


@dataclass(frozen=True, slots=True)
class Accumulation:
    """Per-rank micro-step data over the ranks' curves: optimizer time o_i, micro-batch cap u_i (inf = none),
    most micro-steps."""

    pieces: Pieces
    optimizer_s: np.ndarray
    micro_caps: np.ndarray
    max_steps: np.ndarray
    min_batch: int
    shared: bool
    """mode "fsdp": one K for every rank."""
    live: np.ndarray = field(init=False, repr=False)
    """(W, P) mask of the pieces whose micro-step row can bind: c_p > o_i (the rest are dominated)."""

    _per_step: np.ndarray = field(init=False, repr=False)
    """(W, P): min_batch * s_p + c_p - o_i on live pieces (> 0), inf elsewhere: each micro-step's least cost."""

    def __post_init__(self) -> None:
        live = self.pieces.intercepts > self.optimizer_s[:, None]
        object.__setattr__(self, "live", live)
        with np.errstate(invalid="ignore"):
            per_step = self.min_batch * self.pieces.slopes + self.pieces.intercepts - self.optimizer_s[:, None]
        object.__setattr__(self, "_per_step", np.where(live, per_step, np.inf))

    def times(self, b: np.ndarray, k: np.ndarray) -> np.ndarray:
        """tau_i(b_i, k_i): rank i's compute time for an optimizer step of b_i samples in k_i micro-steps."""
        b = np.asarray(b, dtype=float)
        k = np.asarray(k, dtype=float)
        o = self.optimizer_s
        with np.errstate(invalid="ignore"):
            micro = self.pieces.slopes * b[:, None] + (self.pieces.intercepts - o[:, None]) * k[:, None] + o[:, None]
        micro = np.where(self.live, micro, -np.inf)
        return np.maximum(self.pieces.times(b), np.max(micro, axis=1))

    def fewest(self, b: np.ndarray) -> np.ndarray:
        """The fewest micro-steps that fit each b_i in its memory cap (the same K for all under fsdp)."""
        b = np.asarray(b, dtype=float)
        with np.errstate(divide="ignore", invalid="ignore"):
            k = np.where(np.isfinite(self.micro_caps), np.ceil(b / np.maximum(self.micro_caps, 1e-300) - 1e-9), 1.0)
        k = np.maximum(k, 1).astype(np.int64)
        return np.full_like(k, int(k.max())) if self.shared else k

    def steps_needed(self, caps: np.ndarray, T: float) -> np.ndarray:
        """Per rank, the most micro-steps worth trying at step times up to T: more than k0_i(T) never add capacity
        (module docstring), and more than fit min_batch samples each within T never run.  Under fsdp one bound
        for all: the shared K must run on every rank."""
        return self._steps_for(np.minimum(caps, self.pieces.max_batch(T)).astype(float), T)

    def _steps_for(self, reach: np.ndarray, T: float) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            k0 = np.ceil(np.maximum(reach, 1) / self.micro_caps - 1e-9)  # 0 where uncapped (u = inf)
            # k micro-steps of min_batch need  (min_batch s_p + c_p - o) k + o <= T  on every live piece.
            runs = np.floor(np.min(np.where(self.live, (T - self.optimizer_s[:, None]) / self._per_step, np.inf),
                                   axis=1) * (1 + 1e-9) + 1e-9)
        runs = np.nan_to_num(runs, nan=1.0, posinf=float(self.max_steps.max()))
        if self.shared:
            K = np.clip(min(float(k0.max()), float(runs.min())), 1, self.max_steps.max())
            return np.full(len(k0), int(K), dtype=np.int64)
        return np.clip(np.minimum(k0, runs), 1, self.max_steps).astype(np.int64)

    def by_steps(self, caps: np.ndarray, T: float, feed: np.ndarray | None = None) -> np.ndarray:
        """(W, S) matrix of n_i(T, k) for k = 1..S (S = the most steps that can matter), -1 where infeasible.

        Under ddp only the ranks that could use a second micro-step within T get the k > 1 columns (-1 for the
        rest: those columns could never beat k = 1)."""
        whole, k0 = self._whole(caps, T, feed)
        S = int(k0.max())
        one = np.minimum(whole, self.micro_caps)  # k = 1: the micro-step rows coincide with the curve's
        N = np.full((len(caps), S), -1.0)
        N[:, 0] = np.where(one < self.min_batch, -1.0, one)
        idx = np.arange(len(caps)) if self.shared else np.flatnonzero(k0 > 1)
        if S > 1 and idx.size:
            N[idx] = self._held(idx, np.broadcast_to(np.arange(1, S + 1, dtype=float), (idx.size, S)), T, whole)
        return N

    def _whole(self, caps: np.ndarray, T: float, feed: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """(the most each rank holds within T in one step or any, memory aside; the most steps worth trying)."""
        reach = np.minimum(caps, self.pieces.max_batch(T)).astype(float)
        return (reach if feed is None else np.minimum(reach, feed)), self._steps_for(reach, T)

    def _held(self, idx: np.ndarray, ks: np.ndarray, T: float, whole: np.ndarray) -> np.ndarray:
        """n_i(T, k) for the ranks `idx` at the (len(idx), C) micro-step counts `ks`; -1 where they cannot run."""
        k = ks[:, :, None]
        s, c = self.pieces.slopes[idx, None, :], self.pieces.intercepts[idx, None, :]
        o = self.optimizer_s[idx, None, None]
        live = self.live[idx, None, :]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            cc = (c - o) * k + o  # the piece's intercept at k micro-steps
            per = np.where(live & (s > 0), (T - cc) / np.where(s > 0, s, 1.0), np.inf)
        flat_over = np.any(live & (s <= 0) & (cc > T), axis=2)
        micro_bound = np.where(flat_over, -1.0, _floor(np.min(per, axis=2)))
        n = np.minimum(np.minimum(whole[idx, None], ks * self.micro_caps[idx, None]), micro_bound)
        bad = (ks > self.max_steps[idx, None]) | (n < self.min_batch * ks) | (whole[idx, None] < self.min_batch)
        return np.where(bad, -1.0, n)

    def _best(self, caps: np.ndarray, T: float, feed: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """ddp's (n_i(T), k_i) without the whole matrix.  n_i(T, k) = floor f(k) with f(k) = min(whole, k u,
        G(k)) concave in k (G, the micro-step rows' bound, falls with k), so the best integer k -- the fewest among
        ties -- is 1, the start of the plateau ceil(whole / u), a neighbour of the crossing k u = G(k), or the most
        that can run at all: five candidates per rank that could use a second step, instead of every k."""
        whole, k_top = self._whole(caps, T, feed)
        one = np.minimum(whole, self.micro_caps)
        n = np.where(one < self.min_batch, -1.0, one)
        k = np.ones(len(caps), dtype=np.int64)
        idx = np.flatnonzero(k_top > 1)
        if idx.size == 0:
            return n, k
        u = self.micro_caps[idx]
        s, c, o = self.pieces.slopes[idx], self.pieces.intercepts[idx], self.optimizer_s[idx, None]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            cross = np.min(np.where(self.live[idx], (T - o) / (u[:, None] * s + c - o), np.inf), axis=1)
            plateau = np.ceil(whole[idx] / u - 1e-9)
            runnable = np.floor(whole[idx] / self.min_batch)
        cands = np.stack([np.ones(idx.size), plateau, np.floor(cross), np.ceil(cross), runnable], axis=1)
        cands = np.clip(np.nan_to_num(cands, nan=1.0, posinf=1.0, neginf=1.0), 1, k_top[idx, None])
        cands.sort(axis=1)
        held = self._held(idx, cands, T, whole)
        j = np.argmax(held, axis=1)  # first maximum: the fewest steps among ties
        rows = np.arange(idx.size)
        n[idx] = held[rows, j]
        k[idx] = cands[rows, j].astype(np.int64)
        return n, k

    def at_steps(self, steps: np.ndarray) -> Pieces:
        """The curves of tau_i(., k_i) for fixed micro-step counts: each rank's own pieces plus, where k_i > 1, its
        live pieces with intercept (c_p - o_i) k_i + o_i.  With k fixed the program is the one without
        accumulation over these pieces, caps k_i u_i and lower bounds min_batch k_i."""
        k = np.asarray(steps, dtype=float)[:, None]
        extra = np.where(self.live & (k > 1), (self.pieces.intercepts - self.optimizer_s[:, None]) * k
                         + self.optimizer_s[:, None], -np.inf)
        keep = np.flatnonzero(np.any(np.isfinite(extra), axis=0))
        return Pieces(np.hstack([self.pieces.slopes, self.pieces.slopes[:, keep]]), np.hstack([self.pieces.intercepts, extra[:, keep]]))

    def capacity(self, caps: np.ndarray, T: float, feed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(n_i(T), k_i): the most each rank finishes within T, and in how few micro-steps (fsdp: one K for all)."""
        if not self.shared:
            return self._best(caps, T, feed)
        N = self.by_steps(caps, T, feed)
        ok = np.all(N >= 0, axis=0)
        total = np.where(ok, N.sum(axis=0), -1.0)
        K = int(np.argmax(total))
        return N[:, K], np.full(len(N), K + 1, dtype=np.int64)

    def fewest_steps(self, caps: np.ndarray, T: float, B: int, feed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray] | None:
        """Second stage: (k, capacities) with the smallest sum of k that still hold B within T; None if none do."""
        N = self.by_steps(caps, T, feed)
        W, S = N.shape
        if np.any(N[:, 0] < 0):
            return None
        if self.shared:
            for K in range(S):
                if np.all(N[:, K] >= 0) and N[:, K].sum() >= B:
                    return np.full(W, K + 1, dtype=np.int64), N[:, K]
            return None
        R = np.maximum.accumulate(N, axis=1)  # best with at most k steps
        steps = np.ones(W, dtype=np.int64)
        total = float(R[:, 0].sum())
        heap = [(-(R[i, 1] - R[i, 0]), i) for i in range(W) if S > 1 and R[i, 1] > R[i, 0]]
        heapq.heapify(heap)
        while total < B:
            if not heap:
                return None
            gain, i = heapq.heappop(heap)
            steps[i] += 1
            total -= gain
            j = steps[i]
            if j < S and R[i, j] > R[i, j - 1]:
                heapq.heappush(heap, (-(R[i, j] - R[i, j - 1]), i))
        held = R[np.arange(W), steps - 1]
        # The fewest steps giving that capacity (a plateau of R may have been walked over).
        k = np.argmax(N >= held[:, None], axis=1) + 1
        return k.astype(np.int64), held
