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
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from planner._program import Pieces, bisect_workers, capacity, solve_milp
from planner.curves import Envelope, fit_envelope, memory_cap
from planner.errors import PlanError, ValidationError
from planner.options import SolveOptions, resolve_options
from planner.plan import Bottleneck, Plan, Predicted, RankPlan
from planner.profile import Profile
from planner.rounding import largest_remainder

DDP_BUCKET_BYTES = 25 * 1024 * 1024
"""DDP's default bucket_cap_mb: the last bucket's all-reduce runs after backward and is exposed."""


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
    max_workers: int = 8
    """Most loader workers this rank may get (profile's loader.max_workers, else --max-workers-per-rank)."""

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
    per_host = Counter(r.host for r in profile.ranks)
    models = []
    for r in profile.by_rank:
        cap, reason = memory_cap(r.memory, headroom=opts.memory_headroom), "memory"
        if opts.max_batch_per_rank is not None and (cap is None or opts.max_batch_per_rank < cap):
            cap, reason = opts.max_batch_per_rank, "max-batch-per-rank"
        models.append(
            RankModel(
                rank=r.rank,
                host=r.host,
                device=r.device,
                compute=fit_envelope(r.compute),
                sec_per_sample=r.loader.sec_per_sample if r.loader else 0.0,
                cap=cap,
                cap_reason=reason,
                serial_loader=budgets[r.host] < per_host[r.host],
                max_workers=min(opts.max_workers_per_rank, r.loader.max_workers or opts.max_workers_per_rank)
                if r.loader else opts.max_workers_per_rank,
            )
        )
    return models


def worker_budgets(profile: Profile, opts: SolveOptions) -> dict[str, int]:
    """Loader workers each host can run: its cores minus `cpu_reserve_per_rank` per training process."""
    per_host = Counter(r.host for r in profile.ranks)
    return {h.name: max(0, h.cpu_cores - opts.cpu_reserve_per_rank * per_host[h.name]) for h in profile.hosts}


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
    options: SolveOptions | None = None,
    **overrides: Any,
) -> Plan:
    """Plan integer per-rank batch sizes, shares and loader workers for `global_batch` (never changed).

    Settings come from ``options`` (a ``SolveOptions``; default ``SolveOptions()``), and any of its fields may
    also be given as a keyword, which wins: ``solve(p, global_batch=512, min_batch=2)`` and
    ``solve(p, global_batch=512, options=SolveOptions(min_batch=2))`` are the same.  The plan records the
    options in ``plan.solver["options"]`` (``plan.options`` reads them back).

    When the optimum is predicted less than ``min_gain`` faster than the equal split (and the equal split fits),
    the equal split is returned, with the optimum's batches and step time in ``plan.solver``: a plan must earn
    its departure from what DistributedSampler does. ``min_gain=0`` always returns the optimum.

    Raises:
        PlanError: no assignment satisfies the caps; the message names the binding constraint with its numbers.
        ValidationError: an option is out of range or unknown.
    """
    opts = resolve_options(options, overrides)
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValidationError(f"global batch must be a positive integer, got {global_batch!r}")
    t0 = time.perf_counter()
    models = build_models(profile, opts)
    caps = _check_feasible(models, global_batch, opts)
    budgets = worker_budgets(profile, opts)

    b, workers, method, status = _optimize(models, caps, budgets, global_batch, opts)
    solver: dict[str, object] = {"method": method, "status": status, "solve_time_s": 0.0,
                                 "profile_fingerprint": profile.fingerprint(), "options": opts.to_dict()}
    plan = _make_plan(profile, models, b, workers, caps, opts, solver=solver)
    eq = np.asarray(equal_split(global_batch, len(models)), dtype=np.int64)
    fits = all(opts.min_batch <= e <= c for e, c in zip(eq.tolist(), caps, strict=True))
    if opts.min_gain > 0 and fits and not np.array_equal(eq, b):
        even = _make_plan(profile, models, eq, workers, caps, opts, solver=solver)
        t_opt, t_eq = plan.predicted.step_time_s, even.predicted.step_time_s
        if t_eq <= t_opt * (1.0 + opts.min_gain):
            solver = {**solver, "method": f"equal ({method} optimum within min_gain)",
                      "optimum_batch_sizes": [int(x) for x in b], "optimum_step_time_s": t_opt}
            plan = even
    return replace(plan, solver={**solver, "solve_time_s": round(time.perf_counter() - t0, 6)})


def evaluate(
    profile: Profile,
    batch_sizes: Sequence[int],
    *,
    num_workers: Sequence[int] | None = None,
    options: SolveOptions | None = None,
    method: str = "given",
    **overrides: Any,
) -> Plan:
    """The Plan (with predictions) for a split chosen elsewhere: an equal split, a heuristic, a hand-picked one.

    ``options`` and keyword overrides as in ``solve`` (the search settings ``time_limit_s`` and ``min_gain`` do
    not apply to a given split).  Workers default to the host's budget shared equally (what a DataLoader user
    would set).
    """
    opts = resolve_options(options, overrides)
    if len(batch_sizes) != profile.world_size:
        raise ValidationError(
            f"{len(batch_sizes)} batch sizes given for a profile of {profile.world_size} ranks"
        )
    models = build_models(profile, opts)
    b = np.asarray([int(x) for x in batch_sizes], dtype=np.int64)
    if num_workers is None:
        w = equal_split_workers(profile, models, opts)
    else:
        if len(num_workers) != profile.world_size:
            raise ValidationError(f"{len(num_workers)} worker counts given for {profile.world_size} ranks")
        w = np.asarray([int(x) for x in num_workers], dtype=np.int64)
    caps = [m.cap for m in models]
    return _make_plan(profile, models, b, w, caps, opts, solver={"method": method})


def kept_equal_split(plan: Plan) -> tuple[list[int], float, float] | None:
    """(optimum batches, its predicted gain over the equal split, min_gain) when ``solve`` kept the equal split."""
    kept = plan.solver.get("optimum_batch_sizes")
    t_opt = plan.solver.get("optimum_step_time_s")
    if not kept or not isinstance(t_opt, (int, float)) or t_opt <= 0:
        return None
    min_gain = plan.options.min_gain
    return [int(b) for b in kept], plan.predicted.step_time_s / t_opt - 1.0, min_gain


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


# -- the optimization --------------------------------------------------------------------------------------
def _envelope_for(m: RankModel) -> Envelope:
    return m.compute.plus_per_sample(m.sec_per_sample) if m.serial_loader else m.compute


def _arrays(models: list[RankModel], budgets: dict[str, int]) -> tuple[Pieces, np.ndarray, np.ndarray, np.ndarray]:
    """(pieces, loader cost of ranks with workers, host index per rank, worker budget per host index)."""
    pieces = Pieces.of([_envelope_for(m) for m in models])
    p = np.array([0.0 if m.serial_loader else m.sec_per_sample for m in models])
    names = sorted(budgets)
    hosts = np.array([names.index(m.host) for m in models])
    return pieces, p, hosts, np.array([budgets[h] for h in names])


def _busy(pieces: Pieces, p: np.ndarray, b: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per-rank busy time: max(compute, loader) with workers, compute + loading when serial (folded in pieces)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        feed = np.where((p > 0) & (w > 0), p * b / np.maximum(w, 1), 0.0)
    return np.maximum(pieces.times(b), feed)


def _optimize(
    models: list[RankModel], caps: list[int], budgets: dict[str, int], B: int, opts: SolveOptions
) -> tuple[np.ndarray, np.ndarray, str, str]:
    """(batch sizes, workers, method, status).  See the module docstring for the two steps."""
    pieces, p, hosts, host_budget = _arrays(models, budgets)
    cap_arr = np.asarray(caps, dtype=np.int64)
    serial = np.array([m.serial_loader for m in models])
    # Step 1: compute only (serial loaders are already folded into their ranks' pieces).
    b, status = solve_milp(pieces, cap_arr, B, opts.min_batch, loader=None, time_limit_s=opts.time_limit_s)
    T = float(np.max(pieces.times(b)))
    method = "milp"
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        need = np.where(p > 0, np.ceil(p * b / T - 1e-9), 1.0)
    w = np.where(serial, 0, np.maximum(need, 1)).astype(np.int64)
    max_w = np.array([m.max_workers for m in models])
    used = np.bincount(hosts, weights=w, minlength=len(host_budget))
    if np.any(used > host_budget) or np.any(w > max_w):
        # Step 2: the loaders cannot keep up at T.  Fix the workers (greedy at the bisected T), then the MILP
        # with p*b <= w*T linear again.
        w = bisect_workers(pieces, cap_arr, B, opts.min_batch, p, hosts, host_budget, T, max_w)
        w = np.where(serial, 0, w)
        b, status = solve_milp(pieces, cap_arr, B, opts.min_batch, loader=(p, w), time_limit_s=opts.time_limit_s)
        method = "milp+workers"
    w = _spread_spare_workers(models, b, w, budgets, opts)
    b = _balance(pieces, p, b, w, cap_arr, opts.min_batch)
    b = _polish(pieces, p, b, w, cap_arr, opts.min_batch)
    return b, w, method, status


def _balance(pieces: Pieces, p: np.ndarray, b: np.ndarray, w: np.ndarray, caps: np.ndarray,
             min_batch: int) -> np.ndarray:
    """Among splits with the optimal step time T*, take the one that loads every rank to the same fraction of
    what it can finish within T*: b_i proportional to n_i(T*).

    Where curves are steep this changes nothing (sum_i n_i(T*) is about B).  Where they are flat -- a GPU
    bound by kernel launches, not arithmetic -- many splits tie at T*, and the MILP would return an arbitrary
    extreme one (one rank with almost everything), which the first unmodelled overhead makes slower than an
    even split (seen on H200: ResNet-18 at 32x32, [1022, 2] ran 0.77x the equal split).  The proportional
    choice keeps every rank's slack alike, so errors in the model cost the least.
    """
    T = float(np.max(_busy(pieces, p, b, w)))
    U = np.maximum(capacity(pieces, caps, T, (p, w)), b).astype(np.int64)
    B = int(b.sum())
    x = B * U / U.sum()
    try:
        out = np.asarray(largest_remainder(x.tolist(), B, lo=min_batch, hi=U.tolist()), dtype=np.int64)
    except PlanError:
        return b
    if out.sum() != B or np.max(_busy(pieces, p, out, w)) > T * (1 + 1e-12):
        return b
    return out


def _spread_spare_workers(
    models: list[RankModel], b: np.ndarray, w: np.ndarray, budgets: dict[str, int], opts: SolveOptions
) -> np.ndarray:
    """Hand a host's unused cores to its busiest loaders first, up to max_workers_per_rank each."""
    w = w.copy()
    for h, budget in budgets.items():
        idx = [i for i, m in enumerate(models) if m.host == h and not m.serial_loader]
        spare = budget - int(sum(w[i] for i in idx))
        heap = [(-models[i].sec_per_sample * b[i] / w[i], i) for i in idx if w[i] < models[i].max_workers]
        heapq.heapify(heap)
        while spare > 0 and heap:
            _, i = heapq.heappop(heap)
            w[i] += 1
            spare -= 1
            if w[i] < models[i].max_workers:
                heapq.heappush(heap, (-models[i].sec_per_sample * b[i] / w[i], i))
    return w


def equal_split_workers(profile: Profile, models: list[RankModel], opts: SolveOptions) -> np.ndarray:
    """What a DataLoader user sets without a planner: the host's worker budget split equally."""
    budgets = worker_budgets(profile, opts)
    per_host = Counter(m.host for m in models)
    w = np.zeros(len(models), dtype=np.int64)
    for i, m in enumerate(models):
        if not m.serial_loader:
            w[i] = min(m.max_workers, max(1, budgets[m.host] // per_host[m.host]))
    return w


# -- polish and assemble ----------------------------------------------------------------------------------
def _polish(
    pieces: Pieces, p: np.ndarray, b: np.ndarray, w: np.ndarray, caps: np.ndarray, min_batch: int
) -> np.ndarray:
    """Move single samples off the slowest rank while that lowers the step time.

    The MILP is optimal up to HiGHS's tolerances; this pass makes the one-sample exchange property exact.
    """
    b = b.copy()
    n = len(b)
    if n == 1:
        return b
    for _ in range(10 * n + 1000):
        times = _busy(pieces, p, b, w)
        j = int(np.argmax(times))
        if b[j] <= min_batch:
            break
        plus = np.where(b < caps, _busy(pieces, p, b + 1, w), np.inf)
        plus[j] = np.inf
        i = int(np.argmin(plus))
        bj = b.copy()
        bj[j] -= 1
        new_tj = float(_busy(pieces, p, bj, w)[j])
        rest = np.delete(times, [i, j])
        new_max = max(float(plus[i]), new_tj, float(rest.max()) if rest.size else 0.0)
        if not new_max < times[j] * (1 - 1e-12):
            break
        b[i] += 1
        b[j] -= 1
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
    eq_w = equal_split_workers(profile, models, opts)
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
