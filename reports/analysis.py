"""All the numbers of a capacity report, as plain data: per-rank curves, the plan table with memory headroom,
equal split vs plan vs ideal, the sweeps and what-ifs (reports.whatif; with a run log, on its measured rank speeds
and communication, reports.as_measured), the run log, and the findings.

``analyze`` is pure (no files, no figures), so every number is testable without HTML; ``Report.to_dict`` is the
``--json`` form.  Figures and HTML are thin layers over this.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from planner.comm_model import applied_span_factors
from planner.curves import fit_envelope, fit_memory
from planner.errors import PlanError, ValidationError
from planner.plan import Plan
from planner.profile import Profile
from planner.quality import ProfileQuality, check_profile
from planner.runlog import RunLog
from planner.solve import SolveOptions, build_models, equal_split, equal_split_workers, rank_step_s, solve
from reports.as_measured import as_measured
from reports.causes import Causes, find_causes
from reports.findings import BINDING_TOL, Findings, LoaderNeed, make_findings
from reports.whatif import (
    FULL_DETAIL_RANKS,
    MAX_ADD_KINDS,
    ScalePoint,
    SweepPoint,
    WhatIf,
    epoch_time_s,
    rank_label,
    representatives,
    scaling,
    sweep,
    sweep_batches,
    what_if_add,
    what_if_drop,
    what_if_upgrade,
)

DEFAULT_DATASET_SIZE = 50_000


@dataclass(frozen=True, kw_only=True, slots=True)
class RankRow:
    """One rank of the plan, with what the model says about it."""

    rank: int
    host: str
    device: str
    label: str
    batch_size: int
    micro_batch_size: int = 0
    """Largest micro-batch (batch_size with one micro-step): what must fit the rank's memory cap."""
    accumulation_steps: int = 1
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
    """planner.solve at this global batch on this profile (equals plan_samples_per_s when the plan was solved; 0 when
    the profile cannot hold the global batch -- a plan forced over its caps)."""
    epoch_time_s: float
    equal_split_epoch_time_s: float | None
    dataset_size_source: str = "given"
    """Where dataset_size came from: "--dataset-size", the run log, or "default" (DEFAULT_DATASET_SIZE)."""


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
    quality: ProfileQuality | None = None
    """The profile-quality gate's verdict (planner.quality); its problems lead the findings."""
    causes: Causes | None = None
    """Why slow ranks are slow (reports.causes); its lines also lead the findings."""
    what_if_basis: str = ""
    """What the what-ifs read beside the profile: a run log's measured rank speeds and communication
    (reports.as_measured), in words; "" when the profile alone."""

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
    quality: ProfileQuality | None = None,
    dataset_size_source: str = "given",
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
    if quality is None:  # the profile-quality gate (planner.quality) leads the findings whoever calls
        quality = check_profile(profile)
    B = plan.global_batch
    rows = _rank_rows(profile, plan, opts)
    try:
        resolved = solve(profile, global_batch=B, options=opts).predicted.samples_per_s
    except PlanError:  # a split forced over the caps (plan --from-batches --force): a finding, not an error
        resolved = 0.0
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
        resolved_samples_per_s=resolved,
        epoch_time_s=epoch_time_s(p.step_time_s, B, dataset_size),
        equal_split_epoch_time_s=None if eq_step is None else epoch_time_s(eq_step, B, dataset_size),
        dataset_size_source=dataset_size_source,
    )
    batches = sweep_points or sweep_batches(profile, opts, include=[B])
    points = sweep(profile, batches, opts, dataset_size=dataset_size)
    ref = resolved or p.samples_per_s
    # With a run log, the what-ifs read what it measured: each rank's curve scaled to its measured compute, and
    # the exposed communication never above what the measured step left for it (reports.as_measured).
    basis = as_measured(profile, log, opts.mode) if log is not None else None
    wprof, wref, basis_text = profile, ref, ""
    if basis is not None and basis.changed:
        wprof, basis_text = basis.profile, f"as measured in the run log's epoch {basis.epoch}: {basis.text}"
        wref = _solved_samples_per_s(wprof, B, opts) or ref
    # A drop must beat the best split of the whole cluster, not only the one kept within the min gain.
    floor = max(wref, _solved_samples_per_s(wprof, B, opts.with_overrides({"min_gain": 0.0})))
    # Past FULL_DETAIL_RANKS ranks, one what-if per (device kind, bottleneck) instead of one per rank.
    subjects, like, max_kinds = None, None, None
    if profile.world_size > FULL_DETAIL_RANKS:
        like = representatives(profile, [r.bottleneck for r in rows])
        subjects, max_kinds = sorted(like), MAX_ADD_KINDS
    what_ifs = (
        what_if_drop(wprof, B, wref, opts, subjects, like) + what_if_add(wprof, B, wref, opts, max_kinds)
        + what_if_upgrade(wprof, B, wref, opts, subjects, like)
    )
    scale = scaling(profile, B, opts)
    findings = make_findings(profile, plan, rows, thr, points, what_ifs, opts, quality=quality, log=log,
                             drop_floor_samples_per_s=floor, what_if_basis=basis_text)
    causes = find_causes(profile, global_batch=B, base_samples_per_s=ref, opts=opts, log=log)
    # Right after the quality problems and "step time is set by ...": who is slow, then why.
    at = next((i + 1 for i, line in enumerate(findings.lines) if line.startswith(("Step time", "All "))), 0)
    findings = replace(findings, lines=findings.lines[:at] + causes.lines + findings.lines[at:])
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
        quality=quality,
        causes=causes,
        what_if_basis=basis_text,
    )


def _solved_samples_per_s(profile: Profile, global_batch: int, opts: SolveOptions) -> float:
    """planner.solve's samples/s at ``global_batch`` (0 when the profile cannot hold it)."""
    try:
        return solve(profile, global_batch=global_batch, options=opts).predicted.samples_per_s
    except PlanError:
        return 0.0


def _rank_rows(profile: Profile, plan: Plan, opts: SolveOptions) -> list[RankRow]:
    models = build_models(profile, opts)
    eq_b = equal_split(plan.global_batch, plan.world_size)
    # Equal split with the workers a DataLoader user would set: the plan's own rule (planner.solve).
    eq_ws = equal_split_workers(profile, models, opts).tolist()
    spans = applied_span_factors(profile, opts.mode)
    rows = []
    for r, m, rp, eb, eq_w in zip(profile.by_rank, models, plan.ranks, eq_b, eq_ws, strict=True):
        _, tc, tl = m.busy_time(rp.batch_size, rp.num_workers, rp.accumulation_steps)
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
                micro_batch_size=rp.micro_batch_size,
                accumulation_steps=rp.accumulation_steps,
                share=rp.share,
                num_workers=rp.num_workers,
                predicted_step_time_s=rp.timer_busy_s,  # the plan's one per-rank prediction (planner.plan)
                predicted_compute_s=tc,
                predicted_loader_s=tl,
                bottleneck=rp.bottleneck,
                cap=m.cap,
                capacity_bytes=cap_bytes,
                predicted_peak_bytes=peak,
                memory_free_frac=None if peak is None or not cap_bytes else 1.0 - peak / cap_bytes,
                equal_split_step_time_s=rank_step_s(m, spans, eb, eq_w)[0],
                measured_points=tuple((p.batch_size, p.step_time_s) for p in r.compute),
                envelope_knots=env.knots,
                envelope_slopes=env.slopes,
                envelope_intercepts=env.intercepts,
            )
        )
    return rows


__all__ = ["BINDING_TOL", "DEFAULT_DATASET_SIZE", "Findings", "LoaderNeed", "RankRow", "Report", "Throughput", "analyze",
           "options_for"]
