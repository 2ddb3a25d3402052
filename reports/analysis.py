"""All the numbers of a capacity report, as plain data: per-rank curves, the plan table with memory headroom,
equal split vs plan vs ideal, the sweeps and what-ifs (reports.whatif), the run log, and the findings.

``analyze`` is pure (no files, no figures), so every number is testable without HTML; ``Report.to_dict`` is the
``--json`` form.  Figures and HTML are thin layers over this.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from planner.curves import fit_envelope, fit_memory
from planner.errors import ValidationError
from planner.plan import Plan
from planner.profile import Profile
from planner.runlog import RunLog
from planner.solve import (
    SolveOptions,
    build_models,
    equal_split,
    equal_split_workers,
    kept_equal_split,
    solve,
    worker_budgets,
)
from reports.causes import Causes, find_causes
from reports.whatif import (
    ScalePoint,
    SweepPoint,
    WhatIf,
    best_range,
    epoch_time_s,
    rank_label,
    scaling,
    sweep,
    sweep_batches,
    what_if_add,
    what_if_drop,
    what_if_upgrade,
)

DEFAULT_DATASET_SIZE = 50_000
BINDING_TOL = 0.01
"""A rank whose busy time is within 1% of the slowest one is counted as setting the step time."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankRow:
    """One rank of the plan, with what the model says about it."""

    rank: int
    host: str
    device: str
    label: str
    batch_size: int
    share: float
    num_workers: int
    predicted_step_time_s: float
    """Busy time alone: max(compute, loader), or their sum when loading runs in the training process."""
    predicted_compute_s: float
    predicted_loader_s: float
    bottleneck: str
    cap: int | None
    """Largest batch the solver allows this rank (memory fit with headroom, measured max, user cap)."""
    capacity_bytes: int | None
    predicted_peak_bytes: float | None
    """Affine memory fit at the planned batch; None without memory points."""
    memory_free_frac: float | None
    """1 - predicted peak / capacity at the planned batch."""
    equal_split_step_time_s: float
    """This rank's busy time under DistributedSampler's equal split (default workers)."""
    measured_points: tuple[tuple[int, float], ...]
    envelope_knots: tuple[tuple[float, float], ...]
    envelope_slopes: tuple[float, ...]
    envelope_intercepts: tuple[float, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Throughput:
    global_batch: int
    dataset_size: int
    step_time_s: float
    comm_s: float
    plan_samples_per_s: float
    equal_split_samples_per_s: float
    """0 when the equal split does not fit a rank's memory cap."""
    ideal_samples_per_s: float
    resolved_samples_per_s: float
    """planner.solve at this global batch on this profile (equals plan_samples_per_s when the plan was solved)."""
    epoch_time_s: float
    equal_split_epoch_time_s: float | None


@dataclass(frozen=True, kw_only=True, slots=True)
class LoaderNeed:
    rank: int
    num_workers: int
    workers_needed: int
    """ceil(loader CPU seconds per step / compute seconds per step): workers that keep the loader off the path."""
    host: str
    host_worker_budget: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Findings:
    lines: tuple[str, ...]
    """The plain-language summary, most important first."""
    binding_ranks: tuple[int, ...]
    best_batch_range: tuple[int, int] | None
    drop_ranks: tuple[int, ...]
    """Ranks whose removal raises samples/s at the same global batch."""
    upgrade_ranks: tuple[int, ...]
    """Ranks whose upgrade to the fastest device kind gains at least 5% samples/s."""
    loader_starved: tuple[LoaderNeed, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Report:
    world_size: int
    model_name: str | None
    plan_method: str
    plan_fingerprint: str
    min_batch: int
    ranks: tuple[RankRow, ...]
    throughput: Throughput
    sweep: tuple[SweepPoint, ...]
    what_ifs: tuple[WhatIf, ...]
    scaling: tuple[ScalePoint, ...]
    findings: Findings
    log: RunLog | None = None
    causes: Causes | None = None
    """Why slow ranks are slow (reports.causes); its lines also lead the findings."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kind"] = "report"
        d["version"] = 1
        if self.log is not None:
            d["log"]["start_plan"] = self.log.start_plan.to_dict() if self.log.start_plan else None
            d["log"]["replans"] = [r.to_dict() for r in self.log.replans]
            d["log"]["resizes"] = [r.to_dict() for r in self.log.resizes]
            d["log"]["epochs"] = [None] * len(self.log.epochs)
            for i, rec in enumerate(self.log.epochs):
                d["log"]["epochs"][i] = {**rec.to_dict(), "measured_compute_s": list(rec.measured_compute_s),
                                         "measured_data_wait_s": list(rec.measured_data_wait_s),
                                         "measured_step_time_s": list(rec.measured_step_time_s),
                                         "measured_busy_s": list(rec.measured_busy_s)}
        return d


def options_for(plan: Plan, **overrides: Any) -> SolveOptions:
    """Solve options for the report's re-solves: the plan's own (``plan.options``), with the overrides that are
    not None applied."""
    return plan.options.with_overrides({k: v for k, v in overrides.items() if v is not None})


def analyze(
    profile: Profile,
    plan: Plan,
    opts: SolveOptions,
    *,
    dataset_size: int = DEFAULT_DATASET_SIZE,
    log: RunLog | None = None,
    sweep_points: list[int] | None = None,
) -> Report:
    """Every number of the report for `plan` on `profile` (what-ifs re-solved at the plan's global batch).

    Raises:
        ValidationError: the plan does not belong to the profile (different world size) or dataset_size < 1.
    """
    if plan.world_size != profile.world_size:
        raise ValidationError(
            f"the plan has {plan.world_size} ranks but the profile has {profile.world_size}; "
            "pass the profile the plan was made from"
        )
    if dataset_size < 1:
        raise ValidationError(f"--dataset-size must be >= 1, got {dataset_size}")
    B = plan.global_batch
    rows = _rank_rows(profile, plan, opts)
    base = solve(profile, global_batch=B, options=opts)
    p = plan.predicted
    eq_step = p.equal_split_step_time_s
    thr = Throughput(
        global_batch=B,
        dataset_size=dataset_size,
        step_time_s=p.step_time_s,
        comm_s=p.comm_s,
        plan_samples_per_s=p.samples_per_s,
        equal_split_samples_per_s=p.equal_split_samples_per_s,
        ideal_samples_per_s=p.ideal_samples_per_s,
        resolved_samples_per_s=base.predicted.samples_per_s,
        epoch_time_s=epoch_time_s(p.step_time_s, B, dataset_size),
        equal_split_epoch_time_s=None if eq_step is None else epoch_time_s(eq_step, B, dataset_size),
    )
    batches = sweep_points or sweep_batches(profile, opts, include=[B])
    points = sweep(profile, batches, opts, dataset_size=dataset_size)
    ref = base.predicted.samples_per_s
    what_ifs = (
        what_if_drop(profile, B, ref, opts) + what_if_add(profile, B, ref, opts) + what_if_upgrade(profile, B, ref, opts)
    )
    scale = scaling(profile, B, opts)
    findings = make_findings(profile, plan, rows, thr, points, what_ifs, opts)
    causes = find_causes(profile, global_batch=B, base_samples_per_s=ref, opts=opts, log=log)
    # Right after "step time is set by ...": who is slow, then why.
    findings = replace(findings, lines=findings.lines[:1] + causes.lines + findings.lines[1:])
    return Report(
        world_size=profile.world_size,
        model_name=profile.model.name if profile.model else None,
        plan_method=str(plan.solver.get("method", "unknown")),
        plan_fingerprint=plan.fingerprint,
        min_batch=plan.min_batch,
        ranks=tuple(rows),
        throughput=thr,
        sweep=points,
        what_ifs=tuple(what_ifs),
        scaling=scale,
        findings=findings,
        log=log,
        causes=causes,
    )


def _rank_rows(profile: Profile, plan: Plan, opts: SolveOptions) -> list[RankRow]:
    models = build_models(profile, opts)
    eq_b = equal_split(plan.global_batch, plan.world_size)
    # Equal split with the workers a DataLoader user would set: the plan's own rule (planner.solve).
    eq_ws = equal_split_workers(profile, models, opts).tolist()
    rows = []
    for r, m, rp, eb, eq_w in zip(profile.by_rank, models, plan.ranks, eq_b, eq_ws, strict=True):
        _, tc, tl = m.busy_time(rp.batch_size, rp.num_workers)
        env = fit_envelope(r.compute)
        fit = fit_memory(r.memory) if r.memory is not None else None
        cap_bytes = r.memory.capacity_bytes if r.memory is not None else None
        peak = fit(rp.batch_size) if fit is not None else None
        rows.append(
            RankRow(
                rank=r.rank,
                host=r.host,
                device=r.device,
                label=rank_label(r),
                batch_size=rp.batch_size,
                share=rp.share,
                num_workers=rp.num_workers,
                predicted_step_time_s=rp.predicted_step_time_s,
                predicted_compute_s=tc,
                predicted_loader_s=tl,
                bottleneck=rp.bottleneck,
                cap=m.cap,
                capacity_bytes=cap_bytes,
                predicted_peak_bytes=peak,
                memory_free_frac=None if peak is None or not cap_bytes else 1.0 - peak / cap_bytes,
                equal_split_step_time_s=m.busy_time(eb, eq_w)[0],
                measured_points=tuple((p.batch_size, p.step_time_s) for p in r.compute),
                envelope_knots=env.knots,
                envelope_slopes=env.slopes,
                envelope_intercepts=env.intercepts,
            )
        )
    return rows


# -- findings ------------------------------------------------------------------------------------------------
def loader_needs(profile: Profile, rows: list[RankRow], opts: SolveOptions) -> list[LoaderNeed]:
    """Ranks whose loader is slower than their compute at the planned batch, and the workers that would fix it."""
    budgets = worker_budgets(profile, opts)
    out = []
    for r in rows:
        if r.predicted_loader_s <= r.predicted_compute_s or r.predicted_compute_s <= 0:
            continue
        sec = profile.rank(r.rank).loader
        cpu_s = (sec.sec_per_sample if sec else 0.0) * r.batch_size
        out.append(
            LoaderNeed(
                rank=r.rank,
                num_workers=r.num_workers,
                workers_needed=max(1, math.ceil(cpu_s / r.predicted_compute_s - 1e-9)),
                host=r.host,
                host_worker_budget=budgets[r.host],
            )
        )
    return out


def make_findings(
    profile: Profile,
    plan: Plan,
    rows: list[RankRow],
    thr: Throughput,
    points: tuple[SweepPoint, ...],
    what_ifs: list[WhatIf],
    opts: SolveOptions,
) -> Findings:
    lines: list[str] = []
    t_max = max(r.predicted_step_time_s for r in rows)
    binding = tuple(r.rank for r in rows if r.predicted_step_time_s >= (1 - BINDING_TOL) * t_max)
    what = sorted({rows[i].bottleneck for i in binding})
    who = ", ".join(f"rank {i} ({rows[i].label})" for i in binding)
    comm = f", plus {1000 * thr.comm_s:.1f} ms of exposed communication" if thr.comm_s > 0 else ""
    if len(binding) == len(rows) and len(rows) > 1:
        lines.append(f"All {len(rows)} ranks finish their step together at {1000 * t_max:.1f} ms "
                     f"({' / '.join(what)}-bound){comm}: the split is balanced and nobody waits.")
    else:
        lines.append(f"Step time {1000 * thr.step_time_s:.1f} ms is set by {who} ({' / '.join(what)}-bound){comm}.")
    eq = thr.equal_split_samples_per_s
    gain = f" = {thr.plan_samples_per_s / eq:.2f}x the equal split ({eq:,.0f})" if eq > 0 else \
        " (the equal split does not fit in memory)"
    lines.append(
        f"The plan gives {thr.plan_samples_per_s:,.0f} samples/s at global batch {thr.global_batch}{gain}; "
        f"ideal {thr.ideal_samples_per_s:,.0f}; an epoch of {thr.dataset_size:,} samples takes "
        f"{_fmt_s(thr.epoch_time_s)}."
    )
    kept = kept_equal_split(plan)
    if kept is not None:
        optimum, opt_gain, min_gain = kept
        lines.append(
            f"The equal split was kept: the optimum {optimum} is predicted only "
            f"{opt_gain:.1%} faster, under the min gain of {min_gain:.0%} -- within "
            "the planner's prediction error, and on flat (launch-bound) curves such lopsided splits measured slower; "
            "`planner plan --min-gain 0` plans it anyway."
        )
    if thr.resolved_samples_per_s > thr.plan_samples_per_s * 1.001:
        lines.append(
            f"Re-solving this profile gives {thr.resolved_samples_per_s:,.0f} samples/s "
            f"({thr.resolved_samples_per_s / thr.plan_samples_per_s:.2f}x the given plan): run `planner plan` again."
        )
    rng = best_range(points)
    if rng is not None:
        best = max(p.samples_per_s for p in points if p.feasible)
        lines.append(
            f"Best global batch range: {rng[0]}..{rng[1]} (within 5% of the sweep's best {best:,.0f} samples/s)"
            + ("" if rng[0] <= thr.global_batch <= rng[1] else f"; {thr.global_batch} is outside it")
            + ". The global batch is your convergence choice; the planner never changes it."
        )
    drops = sorted((w for w in what_ifs if w.kind == "drop" and w.feasible and w.delta_samples_per_s > 0),
                   key=lambda w: -w.delta_samples_per_s)
    if drops:
        listed = ", ".join(f"rank {w.subject_rank} ({rows[w.subject_rank].label}) +{100 * w.delta_frac:.1f}%"
                           for w in drops)
        lines.append(f"Dropping one of these ranks raises throughput: {listed}. They cost more than they add "
                     "(each what-if drops one rank at the same global batch).")
    elif profile.world_size > 1:
        lines.append("Every rank adds throughput: dropping any of them lowers samples/s.")
    ups = sorted((w for w in what_ifs if w.kind == "upgrade" and w.feasible and w.delta_frac >= 0.05),
                 key=lambda w: -w.delta_samples_per_s)
    if ups:
        w = ups[0]
        lines.append(f"Best upgrade: {w.label} (+{100 * w.delta_frac:.0f}%, {w.samples_per_s:,.0f} samples/s).")
    adds = sorted((w for w in what_ifs if w.kind == "add" and w.feasible), key=lambda w: -w.delta_samples_per_s)
    if adds and adds[0].delta_samples_per_s > 0:
        w = adds[0]
        lines.append(f"Best addition: {w.label} (+{100 * w.delta_frac:.0f}%, {w.samples_per_s:,.0f} samples/s).")
    starved = loader_needs(profile, rows, opts)
    lines.extend(_loader_lines(profile, starved, opts))
    if not starved:
        lines.append("No rank is loader-starved at the planned batch.")
    return Findings(
        lines=tuple(lines),
        binding_ranks=binding,
        best_batch_range=rng,
        drop_ranks=tuple(w.subject_rank for w in drops),
        upgrade_ranks=tuple(w.subject_rank for w in ups),
        loader_starved=tuple(starved),
    )


def _loader_lines(profile: Profile, starved: list[LoaderNeed], opts: SolveOptions) -> list[str]:
    """One line per host: which ranks wait for data and how many workers each needs."""
    lines = []
    for host in sorted({n.host for n in starved}):
        needs = [n for n in starved if n.host == host]
        n_ranks = sum(1 for r in profile.ranks if r.host == host)
        h = profile.host(host)
        if all(n.num_workers == 0 for n in needs):
            # worker_budgets gave fewer spare cores than ranks: loading runs inside the training process.
            lines.append(
                f"Loader-starved on {host}: rank(s) {', '.join(str(n.rank) for n in needs)} load data in the training "
                f"process because {h.cpu_cores} cores for {n_ranks} ranks leave {needs[0].host_worker_budget} for "
                f"workers (fewer than one per rank); they need "
                + ", ".join(f"{n.workers_needed}" for n in needs)
                + " worker(s) respectively: give the host more cores or run fewer ranks on it."
            )
            continue
        listed = ", ".join(f"rank {n.rank} needs {n.workers_needed} (has {n.num_workers})" for n in needs)
        lines.append(
            f"Loader-starved on {host}: data takes longer than compute; {listed} worker(s); the host can give "
            f"{needs[0].host_worker_budget} in all ({h.cpu_cores} cores minus {opts.cpu_reserve_per_rank} per rank)."
        )
    return lines


def _fmt_s(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


__all__ = ["DEFAULT_DATASET_SIZE", "Findings", "LoaderNeed", "RankRow", "Report", "Throughput", "analyze",
           "options_for"]
