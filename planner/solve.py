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
two ranks lowers the predicted step time.  The workers step 2 fixes are the host's cores shared greedily at the
bisected T (planner._program.greedy_workers), and the host's load then moves each loader's cost (planner.loader),
so the batches are solved again at the plan's own workers; last, one worker moved between two loader-fed ranks of
a host is tried, and kept when it predicts a step at least 2% faster (planner._search.improve_workers).

Gradient accumulation (memory-heterogeneous clusters).  A rank's batch b_i may run as k_i micro-steps of at most
its memory cap u_i each, then one optimizer step; the step time is linear in (b_i, k_i) (planner._accumulation),
so the program keeps its shape with integer k_i >= 1, b_i <= u_i k_i and min_batch k_i <= b_i (each micro-batch
runs a forward: BatchNorm's min batch applies to it).  Under ``mode="ddp"`` k_i is per rank, under
``mode="fsdp"`` one K for all.  The search (planner._search) plans without accumulation whenever that is feasible
and nothing faster needs it -- exactly the program above -- and among equally fast plans takes the fewest
micro-steps.  ``--max-batch-per-rank`` caps a rank's whole batch per optimizer step; the memory cap (the profile's
fit, or ``--max-micro-batch`` where it is lower) caps each micro-batch.  A global batch is refused only where no
accumulation within ``max_accumulation_steps`` reaches it.

Communication: one all-reduce per optimizer step (DDP's no_sync skips it on the other micro-steps), mostly hidden
behind backward; the exposed part is added to the predicted synchronous step (it does not change the split).
Under fsdp each micro-step's forward all-gathers and its backward reduce-scatters; the model does not see that
yet beyond what the profile's step times contain.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from planner._model import (
    DDP_BUCKET_BYTES,
    RankModel,
    build_models,
    equal_split_workers,
    exposed_comm_s,
    fewest_steps,
    worker_budgets,
)
from planner._multiple import check_global_batch, equal_multiples, steps_for, to_multiples
from planner._search import Found, at_workers, improve_workers, search
from planner.comm_model import applied_span_factors, links_meta, span_under_ddp_s
from planner.errors import PlanError, ValidationError
from planner.options import SolveOptions, resolve_options
from planner.plan import Bottleneck, Plan, Predicted, RankPlan, synchronous_step_s
from planner.profile import CommProfile, Profile

LOAD_ROUNDS = 4
"""Most re-solves at a plan's own loader workers (``solve``): each moves the host's load, hence the loader costs;
they settle in one or two."""

__all__ = [
    "DDP_BUCKET_BYTES",
    "RankModel",
    "SolveOptions",
    "accumulation_note",
    "best_subset",
    "build_models",
    "equal_accumulation_split",
    "equal_split",
    "equal_split_workers",
    "evaluate",
    "exposed_comm_s",
    "kept_equal_split",
    "rank_step_s",
    "restrict_profile",
    "solve",
    "subset_line",
    "with_subset",
    "worker_budgets",
]


# -- the public entry points ---------------------------------------------------------------------------------
def solve(
    profile: Profile,
    *,
    global_batch: int,
    options: SolveOptions | None = None,
    num_workers: Sequence[int] | None = None,
    **overrides: Any,
) -> Plan:
    """Plan integer per-rank batch sizes, micro-steps, shares and loader workers for `global_batch` (never
    changed).

    ``num_workers`` fixes each rank's loader workers (a training loop that keeps its DataLoader when the split
    changes): the best batches for those workers, one micro-step each.

    Settings come from ``options`` (a ``SolveOptions``; default ``SolveOptions()``), and any of its fields may
    also be given as a keyword, which wins: ``solve(p, global_batch=512, min_batch=2)`` and
    ``solve(p, global_batch=512, options=SolveOptions(min_batch=2))`` are the same.  The plan records the
    options in ``plan.solver["options"]`` (``plan.options`` reads them back).

    When the optimum is predicted less than ``min_gain`` faster than the equal split (and the equal split fits,
    with the fewest micro-steps each rank's memory needs), the equal split is returned, with the optimum's batches
    and step time in ``plan.solver``: a plan must earn its departure from what DistributedSampler does.
    ``min_gain=0`` always returns the optimum.

    Raises:
        PlanError: no assignment satisfies the caps; the message names the binding constraint with its numbers.
        ValidationError: an option is out of range or unknown.
    """
    opts = resolve_options(options, overrides)
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValidationError(f"global batch must be a positive integer, got {global_batch!r}")
    check_global_batch(global_batch, profile.world_size, opts)
    t0 = time.perf_counter()
    models = build_models(profile, opts)
    caps = _check_feasible(models, global_batch, opts)
    budgets = worker_budgets(profile, opts)
    if num_workers is not None:
        if len(num_workers) != profile.world_size or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in num_workers):
            raise ValidationError(f"num_workers must give {profile.world_size} worker counts >= 0, got "
                                  f"{list(num_workers)}")
        w = np.asarray([int(x) for x in num_workers], dtype=np.int64)
        models = build_models(profile, opts, workers=w.tolist())
        found = at_workers(models, _check_feasible(models, global_batch, opts), budgets, global_batch, opts, w,
                           method="milp at fixed workers")
    else:
        found, models = _search_with_workers(profile, models, caps, budgets, global_batch, opts)
    b, k, workers = found.batch_sizes, found.steps, found.workers
    method = found.method
    if opts.batch_multiple > 1:  # the optimum moved to multiples of M (planner/_multiple.py)
        b, k = to_multiples(models, b, workers, global_batch, opts)
        method = f"{method}, in multiples of {opts.batch_multiple}"
    solver: dict[str, object] = {"method": method, "status": found.status, "solve_time_s": 0.0,
                                 "profile_fingerprint": profile.fingerprint(), "options": opts.to_dict()}
    if found.plain_step_s is not None:
        solver["no_accumulation_step_time_s"] = found.plain_step_s + exposed_comm_s(profile, opts.mode)
    plan = _make_plan(profile, models, b, workers, opts, solver=solver, steps=k)
    if opts.batch_multiple > 1:
        eq = np.asarray(equal_multiples(global_batch, len(models), opts), dtype=np.int64)
        eq_steps = steps_for(models, (eq // opts.batch_multiple).tolist(), opts)
        eq_k, fits = (eq_steps or [1] * len(models)), eq_steps is not None
    else:
        eq = np.asarray(equal_split(global_batch, len(models)), dtype=np.int64)
        eq_k, fits = fewest_steps(models, eq.tolist(), opts)
    fits = fits and all(e >= opts.min_batch for e in eq.tolist())
    if opts.min_gain > 0 and fits and not (np.array_equal(eq, b) and list(k) == eq_k):
        even = _make_plan(profile, models, eq, workers, opts, solver=solver, steps=eq_k)
        t_opt, t_eq = plan.predicted.step_time_s, even.predicted.step_time_s
        if t_eq <= t_opt * (1.0 + opts.min_gain):
            solver = {**solver, "method": f"equal ({method} optimum within min_gain)",
                      "optimum_batch_sizes": [int(x) for x in b], "optimum_step_time_s": t_opt}
            if plan.accumulates:
                solver["optimum_accumulation_steps"] = [int(x) for x in k]
            plan = even
    return replace(plan, solver={**solver, "solve_time_s": round(time.perf_counter() - t0, 6)})


def _search_with_workers(profile: Profile, models: list[RankModel], caps: list[int], budgets: dict[str, int],
                         global_batch: int, opts: SolveOptions) -> tuple[Found, list[RankModel]]:
    """``solve``'s search over batches, micro-steps and loader workers together."""
    found = search(models, caps, budgets, global_batch, opts)
    # The host's loader load counts the workers the plan runs (planner.loader): solve again at the plan's own
    # workers until the loader costs they imply are the ones solved with.
    for _ in range(LOAD_ROUNDS):
        at_plan = build_models(profile, opts, workers=found.workers.tolist())
        if all(math.isclose(a.sec_per_sample, m.sec_per_sample, rel_tol=1e-3) for a, m in zip(at_plan, models,
                                                                                             strict=True)):
            break
        models = at_plan
        found = search(models, _check_feasible(models, global_batch, opts), budgets, global_batch, opts)
    else:
        models = build_models(profile, opts, workers=found.workers.tolist())  # predictions at its own workers
    # one loader worker moved between two ranks of a host, when the greedy workers left a clearly faster split
    return improve_workers(found, models, lambda w: build_models(profile, opts, workers=w),
                           _check_feasible(models, global_batch, opts), budgets, global_batch, opts)


def evaluate(
    profile: Profile,
    batch_sizes: Sequence[int],
    accumulation_steps: Sequence[int] | None = None,
    *,
    num_workers: Sequence[int] | None = None,
    options: SolveOptions | None = None,
    method: str = "given",
    **overrides: Any,
) -> Plan:
    """The Plan (with predictions) for a split chosen elsewhere: an equal split, a heuristic, a hand-picked one.

    ``accumulation_steps`` gives each rank's micro-steps per optimizer step; by default each rank runs the fewest
    that fit its memory cap (the largest of them on every rank under ``mode="fsdp"``; one where no count within
    ``max_accumulation_steps`` fits).  ``options`` and keyword overrides as in ``solve`` (the search settings
    ``time_limit_s`` and ``min_gain`` do not apply to a given split).  Workers default to the host's budget shared
    equally (what a DataLoader user would set).

    Raises:
        ValidationError: a list has the wrong length, or a given micro-step count does not fit (below 1, more
            than the samples, a micro-batch above the rank's memory cap, unequal counts under fsdp).
    """
    opts = resolve_options(options, overrides)
    if len(batch_sizes) != profile.world_size:
        raise ValidationError(
            f"{len(batch_sizes)} batch sizes given for a profile of {profile.world_size} ranks"
        )
    b = np.asarray([int(x) for x in batch_sizes], dtype=np.int64)
    if num_workers is None:
        models = build_models(profile, opts)
        w = equal_split_workers(profile, models, opts)
    else:
        if len(num_workers) != profile.world_size:
            raise ValidationError(f"{len(num_workers)} worker counts given for {profile.world_size} ranks")
        w = np.asarray([int(x) for x in num_workers], dtype=np.int64)
        models = build_models(profile, opts, workers=w.tolist())  # the host's load with these workers
    if accumulation_steps is None:
        steps = fewest_steps(models, b.tolist(), opts)[0]
    else:
        if len(accumulation_steps) != profile.world_size:
            raise ValidationError(
                f"{len(accumulation_steps)} accumulation steps given for {profile.world_size} ranks"
            )
        steps = [int(x) for x in accumulation_steps]
    return _make_plan(profile, models, b, w, opts, solver={"method": method}, steps=steps)


def calibrate_overhead(profile: Profile, batch_sizes: Sequence[int], measured_step_s: float, *,
                       source: str, options: SolveOptions | None = None, **overrides: Any) -> Profile:
    """The profile with ``comm.exposed_s`` set so that ``batch_sizes`` predicts ``measured_step_s``.

    ``exposed_s`` is what the training loop adds to every step beyond the ranks' compute (planner.comm_model); the
    profiler measures it in its own DDP loop at the equal split.  A framework's loop adds more -- the HF Trainer's
    per-step host work, its synchronizations, its callbacks: 7-8 ms a step on 2 H100s for a 110M LM, 3% of the
    equal split's step -- and the same amount at any split, so it moves every prediction, never the split.  Give
    the loop's own measured mean step at a split (``runtime.adapters.hf.measure_trainer_overhead`` does, for the
    Trainer) and every plan solved from the result predicts that loop; predictions at ``batch_sizes`` itself are
    then in-sample.  ``source`` names the loop in ``meta["exposed_calibration"]`` (with the numbers).

    Raises:
        ValidationError: one rank (no step overhead to model), or a measured time that is not a positive number.

    A measured step shorter than the profile's compute at the split sets the overhead to 0, with a warning that
    gives the numbers (recorded as ``clamped_at_zero``).
    """
    if profile.world_size < 2:
        raise ValidationError("calibrate_overhead: one rank has no DDP step overhead to calibrate")
    if not (isinstance(measured_step_s, (int, float)) and math.isfinite(measured_step_s) and measured_step_s > 0):
        raise ValidationError(f"calibrate_overhead: measured step {measured_step_s!r} s is not a positive time")
    before = evaluate(profile, batch_sizes, options=options, method="calibration", **overrides)
    e_old = before.predicted.comm_s or 0.0
    e_new = float(e_old + measured_step_s - before.predicted.step_time_s)
    clamped = e_new < 0
    if clamped:  # the loop ran faster than the profile's compute alone: noise, or a busier machine at profile time
        warnings.warn(
            f"calibrate_overhead: {source} measured {1000 * measured_step_s:.2f} ms a step at {list(batch_sizes)}, "
            f"{-1000 * e_new:.2f} ms under the profile's compute there "
            f"({1000 * (before.predicted.step_time_s - e_old):.2f} ms); the step overhead is set to 0 -- if this "
            "repeats, re-profile on the machine as it trains", stacklevel=2)
        e_new = 0.0
    out, field = with_exposed_comm_s(profile, e_new, before.mode)
    meta = {**profile.meta, "exposed_calibration": {
        "source": source, "batch_sizes": [int(b) for b in batch_sizes], "measured_step_s": float(measured_step_s),
        "predicted_step_s_before": float(before.predicted.step_time_s), "exposed_s_before": float(e_old),
        "exposed_s": e_new, "clamped_at_zero": clamped, "field": field}}
    return replace(out, meta=meta)


def with_exposed_comm_s(profile: Profile, exposed_s: float, mode: str) -> tuple[Profile, str]:
    """The profile whose exposed communication term (``exposed_comm_s``, what every step adds beyond the slowest
    rank) is ``exposed_s`` under ``mode``, and the field that holds it: the tail after the spans under DDP
    (``comm.span_tail_s``) where the plan reads that one, else ``comm.exposed_s``."""
    comm = profile.comm if profile.comm is not None else CommProfile()
    field = "span_tail_s" if comm.span_tail_s is not None and applied_span_factors(profile, mode) else "exposed_s"
    comm = replace(comm, span_tail_s=exposed_s) if field == "span_tail_s" else replace(comm, exposed_s=exposed_s)
    return replace(profile, comm=comm), field


def equal_accumulation_split(
    profile: Profile, global_batch: int, *, options: SolveOptions | None = None, **overrides: Any
) -> Plan:
    """What a user does by hand today on ranks with different memory: the same micro-batch everywhere, at most
    the smallest memory cap, and the same accumulation everywhere -- B split equally into W * K micro-batches with
    the fewest K that fits the smallest cap.  A baseline for benchmarks, evaluated like ``evaluate``.

    Raises:
        PlanError: the smallest memory cap holds no sample.
    """
    opts = resolve_options(options, overrides)
    models = build_models(profile, opts)
    eq = equal_split(global_batch, len(models))
    caps = [m.micro_cap for m in models if m.micro_cap is not None]
    K = 1
    if caps and max(eq) > min(caps):
        if min(caps) < 1:
            raise PlanError(f"the smallest memory cap is {min(caps)} samples: no micro-batch fits it")
        K = math.ceil(max(eq) / min(caps))
    return evaluate(profile, eq, [K] * len(models), options=opts, method="equal accumulation")


def kept_equal_split(plan: Plan) -> tuple[list[int], float, float] | None:
    """(optimum batches, its predicted gain over the equal split, min_gain) when ``solve`` kept the equal split for
    ``min_gain``; None otherwise -- also when it was kept for the profile's noise (``quality.kept_within_noise``),
    whose gain can be far above ``min_gain``."""
    if plan.solver.get("kept_for") == "profile noise":
        return None
    kept = plan.solver.get("optimum_batch_sizes")
    t_opt = plan.solver.get("optimum_step_time_s")
    if not kept or not isinstance(t_opt, (int, float)) or t_opt <= 0:
        return None
    min_gain = plan.options.min_gain
    return [int(b) for b in kept], plan.predicted.step_time_s / t_opt - 1.0, min_gain


def accumulation_note(plan: Plan) -> str | None:
    """One line saying why the plan accumulates (None when no rank does), e.g.
    ``global batch 4096 exceeds the sum of memory caps 3100: ranks accumulate (rank 0: 4 x 225, ...)``."""
    if not plan.accumulates:
        return None
    acc = [r for r in plan.ranks if r.accumulation_steps > 1]
    listed = ", ".join(f"rank {r.rank}: {r.accumulation_steps} x {r.micro_batch_size}" for r in acc[:6])
    listed += ", ..." if len(acc) > 6 else ""
    caps = [r.max_batch_size for r in plan.ranks]
    t_plain = plan.solver.get("no_accumulation_step_time_s")
    if all(c is not None for c in caps) and plan.global_batch > sum(c for c in caps if c is not None):
        return (f"global batch {plan.global_batch} exceeds the sum of memory caps "
                f"{sum(c for c in caps if c is not None)}: ranks accumulate ({listed})")
    if isinstance(t_plain, (int, float)):
        return (f"memory-capped ranks accumulate to take more of the batch ({listed}): predicted step "
                f"{1000 * plan.predicted.step_time_s:.2f} ms vs {1000 * t_plain:.2f} ms without accumulation")
    return f"ranks accumulate ({listed})"


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


def _reach(models: list[RankModel], B: int, steps: int) -> int:
    """Most samples the ranks hold per optimizer step with at most `steps` micro-steps each."""
    total = 0
    for m in models:
        room = B if m.batch_cap is None else min(m.batch_cap, B)
        total += room if m.micro_cap is None else min(room, m.micro_cap * steps)
    return total


def _check_feasible(models: list[RankModel], B: int, opts: SolveOptions) -> list[int]:
    """Per-rank integer upper bounds without accumulation, or a PlanError naming the constraint that makes the
    program infeasible even with accumulation."""
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
    kmax = opts.max_accumulation_steps
    # Under fsdp all ranks run K micro-steps of at least min_batch each: K <= B / (W * min_batch).
    k_fits = min(kmax, B // (W * opts.min_batch)) if opts.mode == "fsdp" else kmax
    if total >= B or _reach(models, B, k_fits) >= B:
        return caps
    reasons = sorted({m.cap_reason for m in models if m.cap is not None})
    what = "memory caps" if reasons == ["memory"] else " / ".join(reasons) + " caps"
    listed = ", ".join(str(c) for c in caps[:16]) + (", ..." if W > 16 else "")
    head = f"global batch {B} exceeds the sum of {what} {total}: {_fmt_ranks([m.rank for m in models])} cap at {listed}"
    unbounded = _reach(models, B, B)
    if unbounded < B:  # --max-batch-per-rank caps the whole batch: no accumulation helps
        raise PlanError(f"{head}; per optimizer step they hold at most {unbounded} even with gradient accumulation: "
                        "lower the global batch, raise --max-batch-per-rank or add devices (--max-micro-batch caps "
                        "one micro-batch instead, and accumulates past it)")
    need = next(k for k in _doubling(k_fits) if _reach(models, B, k) >= B)
    lo = need // 2
    while need - lo > 1:  # the fewest steps that reach B
        mid = (lo + need) // 2
        lo, need = (mid, need) if _reach(models, B, mid) < B else (lo, mid)
    if opts.mode == "fsdp" and need * W * opts.min_batch > B:
        raise PlanError(f"{head}; under fsdp every rank would run {need} micro-steps of at least min batch "
                        f"{opts.min_batch}, more than the global batch holds: lower --min-batch, use --mode ddp or "
                        "add devices")
    held = _reach(models, B, k_fits)
    raise PlanError(f"{head}; with at most {kmax} accumulation steps per rank they hold {held}: "
                    f"--max-accumulation-steps {need} would reach it, or lower the global batch or add devices")


def rank_step_s(m: RankModel, spans: Sequence[float] | None, b: int, workers: int,
                steps: int = 1) -> tuple[float, float, float]:
    """(the rank's predicted step, its compute part, its loader part) at batch ``b`` in ``steps`` micro-steps with
    ``workers`` loader workers: the one per-rank prediction a plan prints, logs and is measured against
    (``RankPlan.predicted_step_time_s``; ``planner.plan.synchronous_step_s`` makes the plan's step of them).

    The rank alone: max(compute, loader) with workers, compute + loader in the training process
    (``RankModel.busy_time``).  Under DDP, where the profile measured the rank's span factor f
    (``CommProfile.span_factors``), a compute-bound rank with one micro-step runs its forward and backward f times
    slower than alone (the all-reduce of the earlier buckets shares the device with its backward), then its
    optimizer step o:  (t - o) f + o,  never below its loader's time.  That is what its step timer's busy time
    (compute span plus data wait) and the synchronous step follow; the solver balances the standalone curves, so
    the factors move the prediction, never the split.  Without factors, for a loader-bound rank (the loader paces
    its whole step), one that loads in the training process (its data wait adds to the step) and one with
    micro-steps (only the last one's backward overlaps the all-reduce), the rank alone is the prediction."""
    t, tc, tl = m.busy_time(b, workers, steps)
    if spans is None or steps != 1 or tl > tc or ((workers == 0 or m.serial_loader) and tl > 0):
        return t, tc, tl
    return max(span_under_ddp_s(tc, m.optimizer_s, spans[m.rank]) + m.optimizer_s, tl), tc, tl


def _doubling(start: int) -> Sequence[int]:
    out, k = [], max(1, start)
    while True:
        k *= 2
        out.append(k)
        if k >= 1 << 40:
            return out


# -- assemble ------------------------------------------------------------------------------------------------
def _make_plan(
    profile: Profile,
    models: list[RankModel],
    b: np.ndarray,
    w: np.ndarray,
    opts: SolveOptions,
    *,
    solver: dict[str, object],
    steps: Sequence[int] | np.ndarray,
) -> Plan:
    B = int(b.sum())
    comm = exposed_comm_s(profile, opts.mode)
    spans = applied_span_factors(profile, opts.mode)
    ranks = []
    alone = []
    for i, m in enumerate(models):
        ki = int(steps[i])
        if ki < 1 or ki > int(b[i]):
            raise ValidationError(f"rank {m.rank}: {ki} accumulation steps for a batch of {int(b[i])}: give 1.."
                                  f"{int(b[i])}")
        t, tc, tl = rank_step_s(m, spans, int(b[i]), int(w[i]), ki)
        alone.append(m.busy_time(int(b[i]), int(w[i]), ki)[0])
        ranks.append((m, int(b[i]), int(w[i]), ki, t, tc, tl))
    t_max = max(alone)  # what the solver balanced
    rank_plans = []
    for (m, bi, wi, ki, t, tc, tl), a in zip(ranks, alone, strict=True):
        bottleneck: Bottleneck = "compute"
        # "memory": the cap holds the rank back -- it waits at its cap, or it runs micro-steps to get past it.
        if ki > 1 or (m.cap is not None and bi >= m.cap and a < t_max * (1 - 1e-9)):
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
                accumulation_steps=ki,
            )
        )
    step = synchronous_step_s([r.timer_busy_s for r in rank_plans], comm)
    ideal = sum(bi / t for (_, bi, _, _, t, _, _) in ranks if t > 0)
    # The equal split as a user would run it: B/W per rank, each with the fewest micro-steps its memory needs.
    eq_b = equal_split(B, len(models))
    eq_w = equal_split_workers(profile, models, opts)
    eq_k, eq_fits = fewest_steps(models, eq_b, opts)
    eq_step = synchronous_step_s([rank_step_s(m, spans, eb, int(ew), ek)[0]
                                  for m, eb, ew, ek in zip(models, eq_b, eq_w.tolist(), eq_k, strict=True)], comm)
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
        mode=opts.mode,
        # Recorded only when the profile measured it to help (planner.comm_model.choose_launch_env).
        launch_env=dict(profile.comm.launch_env) if profile.comm and profile.comm.launch_env else {},
        meta=links_meta(profile),  # ranks spanning hosts: the host groups of the all-reduce (planner.comm_model)
        made_for=made_for(profile),
    )


def made_for(profile: Profile) -> dict[str, Any]:
    """``Plan.made_for`` of a plan solved from ``profile``: its content fingerprint, the model it measured and each
    rank's device and host, what a run compares with itself at start (runtime.workload): the split balances these
    step times, on this model, these devices and these hosts' cores."""
    cores = {h.name: h.cpu_cores for h in profile.hosts}
    ranks = [{"rank": r.rank, "device": r.device, **({"device_name": r.device_name} if r.device_name else {}),
              "host": r.host, "cpu_cores": cores[r.host]} for r in profile.by_rank]
    out: dict[str, Any] = {"profile_fingerprint": profile.fingerprint(), "ranks": ranks}
    m = profile.model
    if m is not None:
        out["model"] = {k: v for k, v in (("name", m.name), ("num_params", m.num_params), ("structure", m.structure))
                        if v is not None}
    return out


# -- leaving ranks out ---------------------------------------------------------------------------------------
SUBSET_MIN_GAIN = 0.10
"""Least predicted gain for which a plan names ranks to leave out (``best_subset``; ``min_gain`` where higher):
leaving a rank out is a relaunch and a device idle, so it must earn more than a split does."""

SUBSET_MAX_SINGLES = 8
"""Up to this many ranks, ``best_subset`` tries leaving out each single rank; beyond, only whole hosts and whole
device kinds (each while there are at most this many)."""


def restrict_profile(profile: Profile, keep: Sequence[int]) -> Profile:
    """The profile of ranks ``keep`` only (old rank ids), renumbered 0..k-1 in that order (``keep[j]`` becomes
    rank j; ``meta["restricted_from"]`` records the map and the whole profile's fingerprint).

    Communication of the smaller group: one rank has none (no all-reduce, ``exposed_comm_s``).  Several keep the
    whole group's measured terms with each kept rank's own factors -- the all-reduce of a ring is paced by its
    slowest link, which a smaller group on the same links still crosses -- except that a group left on one host of
    a profile spanning hosts takes that host's own all-reduce (``meta["allreduce_by_host_s"]``), the exposed term
    scaled by it over the whole job's.

    Raises:
        ValidationError: ``keep`` is empty, repeats a rank or names one the profile does not have.
    """
    W = profile.world_size
    keep = [int(i) for i in keep]
    if not keep or len(set(keep)) != len(keep) or any(not 0 <= i < W for i in keep):
        raise ValidationError(f"ranks to keep must be distinct ids in 0..{W - 1}, got {keep}")
    by_rank = profile.by_rank
    ranks = tuple(replace(by_rank[old], rank=new) for new, old in enumerate(keep))
    used = {r.host for r in ranks}
    hosts = tuple(h for h in profile.hosts if h.name in used)
    comm = profile.comm
    if comm is not None and len(keep) == 1:
        comm = None  # one rank: no all-reduce, no DDP
    elif comm is not None:
        def pick(values: tuple[float, ...] | None) -> tuple[float, ...] | None:
            return None if values is None or len(values) != W else tuple(values[i] for i in keep)

        comm = replace(comm, wait_factors=pick(comm.wait_factors), span_factors=pick(comm.span_factors))
        by_host = profile.meta.get("allreduce_by_host_s")
        spans = len({r.host for r in by_rank}) > 1
        if spans and len(used) == 1 and isinstance(by_host, Mapping) and comm.allreduce_s:
            own = by_host.get(next(iter(used)))
            if isinstance(own, (int, float)) and 0 <= own < comm.allreduce_s:
                ratio = float(own) / comm.allreduce_s
                comm = replace(comm, allreduce_s=float(own),
                               exposed_s=None if comm.exposed_s is None else comm.exposed_s * ratio,
                               span_tail_s=None if comm.span_tail_s is None else comm.span_tail_s * ratio)
    meta = {**profile.meta, "restricted_from": {"ranks": keep, "profile_fingerprint": profile.fingerprint()}}
    return replace(profile, ranks=ranks, hosts=hosts, comm=comm, meta=meta)


def subset_candidates(profile: Profile) -> list[tuple[int, ...]]:
    """The rank sets ``best_subset`` tries leaving out (old ids, each sorted, never every rank): each single rank
    (up to ``SUBSET_MAX_SINGLES`` ranks), each whole host and each whole device kind (cpu, cuda, ...) where the
    profile has 2..``SUBSET_MAX_SINGLES`` of them."""
    ranks = profile.by_rank
    W = len(ranks)
    out: list[tuple[int, ...]] = []
    if W <= SUBSET_MAX_SINGLES:
        out += [(r.rank,) for r in ranks]
    for key in (lambda r: r.host, lambda r: r.device.split(":")[0]):
        groups: dict[str, list[int]] = {}
        for r in ranks:
            groups.setdefault(key(r), []).append(r.rank)
        if 1 < len(groups) <= SUBSET_MAX_SINGLES:  # each a solve: a few, never one per host of a large job
            out += [tuple(g) for g in groups.values()]
    return [c for c in dict.fromkeys(out) if 0 < len(c) < W]


def best_subset(profile: Profile, plan: Plan, *,
                plan_for: Callable[[Profile], Plan] | None = None) -> dict[str, Any] | None:
    """The ranks to leave out when the plan over the rest is predicted clearly faster, else None.

    Each candidate (``subset_candidates``) is planned by ``plan_for`` on ``restrict_profile`` of the kept ranks --
    what ``planner plan --exclude-ranks`` runs, by default ``solve`` with ``plan``'s options and global batch -- so
    the predicted step compared is the one that plan prints.  A candidate whose kept ranks cannot hold the global batch is skipped.  The fastest wins when
    ``plan``'s predicted step is more than ``max(SUBSET_MIN_GAIN, min_gain)`` above its step: a rank whose samples
    are worth more than what it adds to the all-reduce (and to the slowest rank) is never named.

    Returns ``{"exclude_ranks", "keep_ranks", "step_time_s", "samples_per_s", "gain", "batch_sizes",
    "candidates"}``: ``gain`` = plan's step over the subset's, ``keep_ranks[j]`` = the old id of the subset
    plan's rank j, ``candidates`` the number tried.
    """
    opts = plan.options
    if plan_for is None:
        def plan_for(p: Profile) -> Plan:
            return solve(p, global_batch=plan.global_batch, options=opts)
    if profile.world_size < 2:
        return None
    threshold = max(SUBSET_MIN_GAIN, opts.min_gain)
    t_plan = plan.predicted.step_time_s
    best: tuple[float, tuple[int, ...], Plan] | None = None
    tried = 0
    for left_out in subset_candidates(profile):
        keep = [r for r in range(profile.world_size) if r not in left_out]
        tried += 1
        try:
            sub = plan_for(restrict_profile(profile, keep))
        except PlanError:
            continue
        t = sub.predicted.step_time_s
        if t > 0 and (best is None or t < best[0]):
            best = (t, left_out, sub)
    if best is None or t_plan <= best[0] * (1.0 + threshold):
        return None
    t, left_out, sub = best
    return {"exclude_ranks": list(left_out), "keep_ranks": [r for r in range(profile.world_size)
                                                            if r not in left_out],
            "step_time_s": t, "samples_per_s": sub.predicted.samples_per_s, "gain": t_plan / t,
            "batch_sizes": [r.batch_size for r in sub.ranks], "candidates": tried}


def with_subset(profile: Profile, plan: Plan, plan_for: Callable[[Profile], Plan] | None = None) -> Plan:
    """``plan`` with ``solver["subset"]`` (``best_subset``) where leaving ranks out is predicted clearly faster."""
    found = best_subset(profile, plan, plan_for=plan_for)
    return plan if found is None else replace(plan, solver={**plan.solver, "subset": found})


def subset_line(plan: Plan, profile: Profile | None = None, *, command: str | None = None) -> str | None:
    """One line naming the ranks ``solver["subset"]`` leaves out, the predicted gain and the launch (``command``:
    the `planner plan` call with ``--exclude-ranks`` added), e.g. ``leaving out rank 1 (cpu) is predicted 3.10x
    faster: planner plan ... --exclude-ranks 1 (then launch 1 rank)``; None when the plan records none."""
    found = plan.solver.get("subset")
    if not isinstance(found, Mapping) or not found.get("exclude_ranks"):
        return None
    out = [int(r) for r in found["exclude_ranks"]]
    keep = len(found.get("keep_ranks") or []) or plan.world_size - len(out)
    devices = {r.rank: r.device for r in (profile.by_rank if profile is not None else plan.ranks)}
    named = ", ".join(f"{r} ({devices.get(r, '?')})" for r in out)
    what = f"rank {named}" if len(out) == 1 else f"ranks {named}"
    ids = ",".join(map(str, out))
    launch = command if command is not None else "planner plan --profile PROFILE --global-batch " \
                                                 f"{plan.global_batch}"
    return (f"leaving out {what} is predicted {float(found['gain']):.2f}x faster "
            f"({1000 * float(found['step_time_s']):.2f} ms a step): {launch} --exclude-ranks {ids} "
            f"(then launch {keep} rank{'s' if keep != 1 else ''})")
