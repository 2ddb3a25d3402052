"""The program: integer per-rank batch sizes and loader workers so every rank finishes its step together.

Per rank i (planner.curves): compute time t_i(b) = max_k (s_ik * b + c_ik), a cap b <= u_i (memory fit with
headroom, measured max, --max-batch-per-rank), and loader cost p_i CPU-seconds per sample.  With w_i >= 1
background workers the loader keeps up while  p_i * b_i <= w_i * T; a host whose cores cannot give every rank a
worker runs loaders in the training process (w_i = 0), which adds p_i * b to the step:  t_i(b) + p_i * b <= T.

    minimize T   s.t.   s_ik * b_i + c_ik <= T          every rank i, every piece k
                        p_i * b_i <= w_i * T            ranks with workers
                        sum_i b_i = B
                        min_batch <= b_i <= u_i,  b_i integer
                        sum_{i on host h} w_i <= cores_h - reserve * n_h,  w_i >= 1 integer

How it is solved.  Step 1 drops the loader rows and solves the remaining MILP exactly with
scipy.optimize.milp (HiGHS) -- T continuous, b integer, never a rounded relaxation.  If the loaders keep up at
that T with the host's cores (checked by a MILP over b and w at fixed T), that is the optimum.  Otherwise the
loader rows bind; p_i * b_i <= w_i * T is bilinear in (w, T), so step 2 bisects on T, each probe a feasibility
MILP over integer (b, w) at fixed T (where the row is linear), to a relative tolerance of 1e-5.  Finally a
one-sample exchange pass removes any improvement smaller than the MILP gap, so no single sample moved between
two ranks lowers the predicted step time.

Communication: one all-reduce per step, mostly hidden behind backward; the exposed part is added to the
predicted synchronous step (it does not change the split).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from planner.curves import Envelope, fit_envelope, memory_cap
from planner.errors import PlanError, ValidationError
from planner.plan import Bottleneck, Plan, Predicted, RankPlan
from planner.profile import Profile

DDP_BUCKET_BYTES = 25 * 1024 * 1024
"""DDP's default bucket_cap_mb: the last bucket's all-reduce runs after backward and is exposed."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SolveOptions:
    min_batch: int = 1
    """Smallest local batch any rank may get (2 or more for BatchNorm models)."""
    max_batch_per_rank: int | None = None
    """User cap on every rank's local batch, on top of the memory caps."""
    memory_headroom: float = 0.10
    """Fraction of device memory kept free when deriving the memory cap from the fit."""
    cpu_reserve_per_rank: int = 1
    """Cores per rank kept for the training process itself (not given to loader workers)."""
    max_workers_per_rank: int = 8
    """Upper bound on loader workers per rank when spare cores are handed out."""
    time_limit_s: float = 20.0
    """HiGHS time limit per MILP call."""

    def __post_init__(self) -> None:
        if self.min_batch < 1:
            raise ValidationError(f"min_batch must be >= 1, got {self.min_batch}")
        if self.max_batch_per_rank is not None and self.max_batch_per_rank < 1:
            raise ValidationError(f"max_batch_per_rank must be >= 1, got {self.max_batch_per_rank}")
        if not 0.0 <= self.memory_headroom < 1.0:
            raise ValidationError(f"memory_headroom must be in [0, 1), got {self.memory_headroom}")
        if self.cpu_reserve_per_rank < 0:
            raise ValidationError(f"cpu_reserve_per_rank must be >= 0, got {self.cpu_reserve_per_rank}")
        if self.max_workers_per_rank < 1:
            raise ValidationError(f"max_workers_per_rank must be >= 1, got {self.max_workers_per_rank}")


@dataclass(frozen=True, kw_only=True, slots=True)
class RankModel:
    """What the solver knows about one rank."""

    rank: int
    host: str
    device: str
    compute: Envelope
    sec_per_sample: float
    """Loader CPU seconds per sample (0 when the profile has no loader data)."""
    cap: int | None
    cap_reason: str
    serial_loader: bool
    """True when the host has too few cores for one worker per rank: data is loaded in the training process."""

    def busy_time(self, b: float, workers: int) -> tuple[float, float, float]:
        """(step time, compute part, loader part) of this rank alone at batch b with `workers` workers."""
        tc = self.compute(b)
        if self.serial_loader or workers == 0:
            tl = self.sec_per_sample * b
            return tc + tl, tc, tl
        tl = self.sec_per_sample * b / workers
        return max(tc, tl), tc, tl


def build_models(profile: Profile, opts: SolveOptions) -> list[RankModel]:
    budgets = worker_budgets(profile, opts)
    models = []
    for r in profile.by_rank:
        cap, reason = memory_cap(r.memory, headroom=opts.memory_headroom), "memory"
        if opts.max_batch_per_rank is not None and (cap is None or opts.max_batch_per_rank < cap):
            cap, reason = opts.max_batch_per_rank, "max-batch-per-rank"
        hosts_ranks = sum(1 for q in profile.ranks if q.host == r.host)
        models.append(
            RankModel(
                rank=r.rank,
                host=r.host,
                device=r.device,
                compute=fit_envelope(r.compute),
                sec_per_sample=r.loader.sec_per_sample if r.loader else 0.0,
                cap=cap,
                cap_reason=reason,
                serial_loader=budgets[r.host] < hosts_ranks,
            )
        )
    return models


def worker_budgets(profile: Profile, opts: SolveOptions) -> dict[str, int]:
    """Loader workers each host can run: its cores minus `cpu_reserve_per_rank` per training process."""
    out = {}
    for h in profile.hosts:
        n = sum(1 for r in profile.ranks if r.host == h.name)
        out[h.name] = max(0, h.cpu_cores - opts.cpu_reserve_per_rank * n)
    return out


def exposed_comm_s(profile: Profile) -> float:
    """Communication left exposed after the slowest rank's backward ends (0 on one rank)."""
    comm = profile.comm
    if profile.world_size == 1 or comm is None:
        return 0.0
    if comm.exposed_s is not None:
        return comm.exposed_s
    if comm.allreduce_s is None:
        return 0.0
    grad = profile.model.grad_bytes if profile.model and profile.model.grad_bytes else None
    # Buckets fill in reverse layer order; all but the last overlap backward, the last one is pure tail.
    frac = 1.0 if not grad else min(1.0, DDP_BUCKET_BYTES / grad)
    return comm.allreduce_s * frac


# -- the public entry points ---------------------------------------------------------------------------------
def solve(
    profile: Profile,
    *,
    global_batch: int,
    min_batch: int = 1,
    max_batch_per_rank: int | None = None,
    memory_headroom: float = 0.10,
    cpu_reserve_per_rank: int = 1,
    max_workers_per_rank: int = 8,
    time_limit_s: float = 20.0,
) -> Plan:
    """Plan integer per-rank batch sizes, shares and loader workers for `global_batch` (never changed).

    Raises:
        PlanError: no assignment satisfies the caps; the message names the binding constraint with its numbers.
        ValidationError: an option is out of range.
    """
    opts = SolveOptions(
        min_batch=min_batch,
        max_batch_per_rank=max_batch_per_rank,
        memory_headroom=memory_headroom,
        cpu_reserve_per_rank=cpu_reserve_per_rank,
        max_workers_per_rank=max_workers_per_rank,
        time_limit_s=time_limit_s,
    )
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValidationError(f"global batch must be a positive integer, got {global_batch!r}")
    t0 = time.perf_counter()
    models = build_models(profile, opts)
    caps = _check_feasible(models, global_batch, opts)
    budgets = worker_budgets(profile, opts)

    b, t_compute, status = _solve_compute(models, caps, global_batch, opts)
    method = "milp"
    workers = _min_workers(models, b, t_compute)
    if not _workers_fit(models, workers, budgets):
        # The compute-optimal split starves a loader; the same T may still work with another split.
        found = _feasible_at(models, caps, budgets, global_batch, t_compute, opts)
        if found is None:
            b, workers = _bisect_loader(models, caps, budgets, global_batch, t_compute, opts)
            method = "milp+bisection"
        else:
            b, workers = found
            method = "milp+workers"
    b = _polish(models, b, workers, caps, opts.min_batch)
    workers = _spread_spare_workers(models, b, workers, budgets, opts)
    solve_s = time.perf_counter() - t0
    return _make_plan(
        profile,
        models,
        b,
        workers,
        caps,
        opts,
        solver={"method": method, "status": status, "solve_time_s": round(solve_s, 6),
                "profile_fingerprint": profile.fingerprint()},
    )


def evaluate(
    profile: Profile,
    batch_sizes: Sequence[int],
    *,
    num_workers: Sequence[int] | None = None,
    min_batch: int = 1,
    max_batch_per_rank: int | None = None,
    memory_headroom: float = 0.10,
    cpu_reserve_per_rank: int = 1,
    max_workers_per_rank: int = 8,
    method: str = "given",
) -> Plan:
    """The Plan (with predictions) for a split chosen elsewhere: an equal split, a heuristic, a hand-picked one.

    Workers default to the host's budget shared equally (what a DataLoader user would set).
    """
    opts = SolveOptions(
        min_batch=min_batch,
        max_batch_per_rank=max_batch_per_rank,
        memory_headroom=memory_headroom,
        cpu_reserve_per_rank=cpu_reserve_per_rank,
        max_workers_per_rank=max_workers_per_rank,
    )
    if len(batch_sizes) != profile.world_size:
        raise ValidationError(
            f"{len(batch_sizes)} batch sizes given for a profile of {profile.world_size} ranks"
        )
    models = build_models(profile, opts)
    b = np.asarray([int(x) for x in batch_sizes], dtype=np.int64)
    if num_workers is None:
        w = _default_workers(profile, models, opts)
    else:
        if len(num_workers) != profile.world_size:
            raise ValidationError(f"{len(num_workers)} worker counts given for {profile.world_size} ranks")
        w = np.asarray([int(x) for x in num_workers], dtype=np.int64)
    caps = [m.cap for m in models]
    return _make_plan(profile, models, b, w, caps, opts, solver={"method": method})


def equal_split(global_batch: int, world_size: int) -> list[int]:
    """B split as evenly as integers allow (the first B % W ranks get one more)."""
    q, r = divmod(global_batch, world_size)
    return [q + (1 if i < r else 0) for i in range(world_size)]


# -- feasibility and messages --------------------------------------------------------------------------------
def _fmt_ranks(ids: Sequence[int]) -> str:
    ids = list(ids)
    if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"ranks {ids[0]}..{ids[-1]}"
    return ("rank " if len(ids) == 1 else "ranks ") + ", ".join(map(str, ids))


def _check_feasible(models: list[RankModel], B: int, opts: SolveOptions) -> list[int]:
    """Per-rank integer upper bounds, or a PlanError naming the constraint that makes the program infeasible."""
    W = len(models)
    if W * opts.min_batch > B:
        raise PlanError(
            f"global batch {B} is below world size {W} x min batch {opts.min_batch} = {W * opts.min_batch}: "
            f"raise the global batch to at least {W * opts.min_batch} or lower --min-batch"
        )
    caps = [B if m.cap is None else min(m.cap, B) for m in models]
    low = [m.rank for m, c in zip(models, caps, strict=True) if c < opts.min_batch]
    if low:
        shown = ", ".join(f"{caps[i]}" for i in low)
        raise PlanError(
            f"min batch {opts.min_batch} exceeds the {models[low[0]].cap_reason} cap of {_fmt_ranks(low)} "
            f"({shown}): lower --min-batch, free memory on those devices, or leave them out"
        )
    total = sum(caps)
    if total < B:
        reasons = sorted({m.cap_reason for m in models if m.cap is not None})
        what = "memory caps" if reasons == ["memory"] else " / ".join(reasons) + " caps"
        listed = ", ".join(str(c) for c in caps[:16]) + (", ..." if W > 16 else "")
        raise PlanError(
            f"global batch {B} exceeds the sum of {what} {total}: {_fmt_ranks([m.rank for m in models])} "
            f"cap at {listed}; lower the global batch (or use gradient accumulation) or add devices"
        )
    return caps


# -- step 1: compute-only MILP ------------------------------------------------------------------------------
def _envelope_for(m: RankModel) -> Envelope:
    return m.compute.plus_per_sample(m.sec_per_sample) if m.serial_loader else m.compute


def _solve_compute(
    models: list[RankModel], caps: list[int], B: int, opts: SolveOptions
) -> tuple[np.ndarray, float, str]:
    n = len(models)
    envs = [_envelope_for(m) for m in models]
    # Times are scaled so T is about 1: HiGHS tolerances are absolute.
    eq = equal_split(B, n)
    scale = max(e(b) for e, b in zip(envs, eq, strict=True)) or 1.0
    rows, cols, vals, ub = [], [], [], []
    r = 0
    for i, e in enumerate(envs):
        for s, c in zip(e.slopes, e.intercepts, strict=True):
            # s*b_i - T <= -c   (all in units of `scale`)
            rows += [r, r]
            cols += [i, n]
            vals += [s / scale, -1.0]
            ub.append(-c / scale)
            r += 1
    A_piece = coo_matrix((vals, (rows, cols)), shape=(r, n + 1)).tocsr()
    A_sum = coo_matrix((np.ones(n), (np.zeros(n, dtype=int), np.arange(n))), shape=(1, n + 1)).tocsr()
    cost = np.zeros(n + 1)
    cost[n] = 1.0
    res = milp(
        cost,
        constraints=[LinearConstraint(A_piece, -np.inf, np.array(ub)), LinearConstraint(A_sum, B, B)],
        bounds=Bounds(np.r_[np.full(n, opts.min_batch), 0.0], np.r_[np.asarray(caps, dtype=float), np.inf]),
        integrality=np.r_[np.ones(n), 0.0],
        options={"time_limit": opts.time_limit_s, "mip_rel_gap": 1e-6},
    )
    status = _status(res, "compute")
    b = np.rint(res.x[:n]).astype(np.int64)  # integral up to HiGHS's integrality tolerance, not a relaxation
    _fix_sum(b, B, caps, opts.min_batch)
    t = max(e(x) for e, x in zip(envs, b.tolist(), strict=True))
    return b, t, status


def _status(res: object, what: str) -> str:
    status = getattr(res, "status")
    x = getattr(res, "x")
    if status == 0:
        return "optimal"
    if status == 1 and x is not None:
        return "time_limit"  # feasible incumbent; the exchange pass still makes it locally optimal
    if status == 2:
        raise PlanError(f"the {what} program is infeasible: {getattr(res, 'message')}")
    raise RuntimeError(f"HiGHS failed on the {what} program (status {status}): {getattr(res, 'message')}")


def _fix_sum(b: np.ndarray, B: int, caps: Sequence[int], min_batch: int) -> None:
    """Guard against integrality tolerance leaving the sum off by one (never seen; cheap to ensure)."""
    diff = B - int(b.sum())
    i = 0
    while diff != 0 and i < 10 * len(b):
        j = i % len(b)
        if diff > 0 and b[j] < caps[j]:
            b[j] += 1
            diff -= 1
        elif diff < 0 and b[j] > min_batch:
            b[j] -= 1
            diff += 1
        i += 1
    assert diff == 0, "could not restore the batch sum"


# -- loaders --------------------------------------------------------------------------------------------------
def _min_workers(models: list[RankModel], b: np.ndarray, T: float) -> np.ndarray:
    """Fewest workers keeping each loader up at step time T (>= 1 where workers are used, else 0)."""
    w = np.zeros(len(models), dtype=np.int64)
    for i, m in enumerate(models):
        if not m.serial_loader:
            need = m.sec_per_sample * b[i] / T if T > 0 else 0.0
            w[i] = max(1, math.ceil(need - 1e-9))
    return w


def _workers_fit(models: list[RankModel], w: np.ndarray, budgets: dict[str, int]) -> bool:
    used: dict[str, int] = {}
    for m, x in zip(models, w.tolist(), strict=True):
        used[m.host] = used.get(m.host, 0) + x
    return all(used[h] <= budgets[h] for h in used)


def _feasible_at(
    models: list[RankModel], caps: list[int], budgets: dict[str, int], B: int, T: float, opts: SolveOptions
) -> tuple[np.ndarray, np.ndarray] | None:
    """Integer (b, w) with every rank done by T, loaders included, or None (a feasibility MILP at fixed T)."""
    n = len(models)
    ub_b = np.zeros(n)
    for i, m in enumerate(models):
        bt = _envelope_for(m).max_batch_within(T * (1 + 1e-12))
        ub_b[i] = min(caps[i], math.floor(bt + 1e-9))
    if np.any(ub_b < opts.min_batch) or ub_b.sum() < B:
        return None
    async_idx = [i for i, m in enumerate(models) if not m.serial_loader]
    k = len(async_idx)
    # x = [b_0..b_{n-1}, w for async ranks]
    rows, cols, vals, hi = [], [], [], []
    r = 0
    for j, i in enumerate(async_idx):
        p = models[i].sec_per_sample
        if p > 0:  # p*b_i - T*w_i <= 0, in units of T
            rows += [r, r]
            cols += [i, n + j]
            vals += [p / T, -1.0]
            hi.append(0.0)
            r += 1
    hosts = sorted({models[i].host for i in async_idx})
    for h in hosts:
        for j, i in enumerate(async_idx):
            if models[i].host == h:
                rows.append(r)
                cols.append(n + j)
                vals.append(1.0)
        hi.append(float(budgets[h]))
        r += 1
    constraints = []
    if r:
        A = coo_matrix((vals, (rows, cols)), shape=(r, n + k)).tocsr()
        constraints.append(LinearConstraint(A, -np.inf, np.array(hi)))
    A_sum = coo_matrix((np.ones(n), (np.zeros(n, dtype=int), np.arange(n))), shape=(1, n + k)).tocsr()
    constraints.append(LinearConstraint(A_sum, B, B))
    cost = np.r_[np.zeros(n), np.ones(k)]  # fewest workers; spare ones are handed out afterwards
    res = milp(
        cost,
        constraints=constraints,
        bounds=Bounds(np.r_[np.full(n, opts.min_batch), np.ones(k)], np.r_[ub_b, np.full(k, np.inf)]),
        integrality=np.ones(n + k),
        options={"time_limit": opts.time_limit_s},
    )
    if res.status == 2 or res.x is None:
        return None
    if res.status not in (0, 1):
        raise RuntimeError(f"HiGHS failed on the loader program (status {res.status}): {res.message}")
    x = np.rint(res.x).astype(np.int64)
    w = np.zeros(n, dtype=np.int64)
    for j, i in enumerate(async_idx):
        w[i] = x[n + j]
    return x[:n], w


def _bisect_loader(
    models: list[RankModel], caps: list[int], budgets: dict[str, int], B: int, t_lo: float, opts: SolveOptions
) -> tuple[np.ndarray, np.ndarray]:
    """Smallest T (to 1e-5 relative) at which a feasible integer (b, w) exists, by bisection on T."""
    hi = t_lo * 2
    best = _feasible_at(models, caps, budgets, B, hi, opts)
    for _ in range(60):
        if best is not None:
            break
        t_lo, hi = hi, hi * 2
        best = _feasible_at(models, caps, budgets, B, hi, opts)
    if best is None:
        raise PlanError("no loader-feasible plan found: the hosts' cores cannot feed the global batch at any step time")
    lo = t_lo
    while (hi - lo) / hi > 1e-5:
        mid = 0.5 * (lo + hi)
        found = _feasible_at(models, caps, budgets, B, mid, opts)
        if found is None:
            lo = mid
        else:
            hi, best = mid, found
    return best


def _spread_spare_workers(
    models: list[RankModel], b: np.ndarray, w: np.ndarray, budgets: dict[str, int], opts: SolveOptions
) -> np.ndarray:
    """Hand a host's unused cores to its busiest loaders first, up to max_workers_per_rank each."""
    w = w.copy()
    for h, budget in budgets.items():
        idx = [i for i, m in enumerate(models) if m.host == h and not m.serial_loader]
        spare = budget - int(sum(w[i] for i in idx))
        heap = [(-models[i].sec_per_sample * b[i] / w[i], i) for i in idx if w[i] < opts.max_workers_per_rank]
        heapq.heapify(heap)
        while spare > 0 and heap:
            _, i = heapq.heappop(heap)
            w[i] += 1
            spare -= 1
            if w[i] < opts.max_workers_per_rank:
                heapq.heappush(heap, (-models[i].sec_per_sample * b[i] / w[i], i))
    return w


def _default_workers(profile: Profile, models: list[RankModel], opts: SolveOptions) -> np.ndarray:
    """What a DataLoader user sets without a planner: the host's worker budget split equally."""
    budgets = worker_budgets(profile, opts)
    w = np.zeros(len(models), dtype=np.int64)
    for i, m in enumerate(models):
        if not m.serial_loader:
            n = sum(1 for q in models if q.host == m.host)
            w[i] = min(opts.max_workers_per_rank, max(1, budgets[m.host] // n))
    return w


# -- polish and assemble ----------------------------------------------------------------------------------
def _polish(models: list[RankModel], b: np.ndarray, w: np.ndarray, caps: list[int], min_batch: int) -> np.ndarray:
    """Move single samples off the slowest rank while that lowers the step time (removes MILP-gap slack)."""
    b = b.copy()
    n = len(b)
    if n == 1:
        return b
    times = np.array([models[i].busy_time(b[i], int(w[i]))[0] for i in range(n)])
    for _ in range(10 * n + 1000):
        j = int(np.argmax(times))
        if b[j] <= min_batch:
            break
        # Where would one more sample finish earliest?
        plus = np.array(
            [models[i].busy_time(b[i] + 1, int(w[i]))[0] if b[i] < caps[i] and i != j else np.inf for i in range(n)]
        )
        i = int(np.argmin(plus))
        new_tj = models[j].busy_time(b[j] - 1, int(w[j]))[0]
        others = np.delete(times, [i, j]) if n > 2 else np.array([])
        new_max = max(plus[i], new_tj, float(others.max()) if others.size else 0.0)
        if not new_max < times[j] * (1 - 1e-12):
            break
        b[i] += 1
        b[j] -= 1
        times[i], times[j] = plus[i], new_tj
    return b


def _make_plan(
    profile: Profile,
    models: list[RankModel],
    b: np.ndarray,
    w: np.ndarray,
    caps: Sequence[int | None],
    opts: SolveOptions,
    *,
    solver: dict[str, object],
) -> Plan:
    B = int(b.sum())
    comm = exposed_comm_s(profile)
    ranks = []
    busy = []
    for i, m in enumerate(models):
        t, tc, tl = m.busy_time(int(b[i]), int(w[i]))
        busy.append(t)
        ranks.append((m, int(b[i]), int(w[i]), t, tc, tl))
    t_max = max(busy)
    rank_plans = []
    for m, bi, wi, t, tc, tl in ranks:
        bottleneck: Bottleneck = "compute"
        cap = caps[m.rank]
        if cap is not None and bi >= cap and m.cap is not None and t < t_max * (1 - 1e-9):
            bottleneck = "memory"
        elif tl > tc:
            bottleneck = "loader"
        rank_plans.append(
            RankPlan(
                rank=m.rank,
                host=m.host,
                device=m.device,
                batch_size=bi,
                share=bi / B,
                num_workers=wi,
                predicted_step_time_s=t,
                predicted_compute_s=tc,
                predicted_loader_s=tl,
                bottleneck=bottleneck,
                max_batch_size=m.cap,
            )
        )
    step = t_max + comm
    ideal = sum(bi / t for (_, bi, _, t, _, _) in ranks if t > 0)
    eq_b = equal_split(B, len(models))
    eq_w = _default_workers(profile, models, opts)
    eq_fits = all(m.cap is None or eb <= m.cap for m, eb in zip(models, eq_b, strict=True))
    eq_step = max(m.busy_time(eb, int(ew))[0] for m, eb, ew in zip(models, eq_b, eq_w.tolist(), strict=True)) + comm
    predicted = Predicted(
        step_time_s=step,
        samples_per_s=B / step,
        equal_split_samples_per_s=B / eq_step if eq_fits else 0.0,
        equal_split_step_time_s=eq_step if eq_fits else None,
        ideal_samples_per_s=ideal,
        comm_s=comm,
    )
    return Plan(
        world_size=len(models),
        global_batch=B,
        min_batch=opts.min_batch,
        ranks=tuple(rank_plans),
        predicted=predicted,
        solver=solver,
    )
