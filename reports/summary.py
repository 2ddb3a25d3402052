"""The terminal summary of a report: findings, then aligned tables (people read tables; machines read --json)."""

from __future__ import annotations

import math

from planner.table import table
from reports.analysis import Report
from reports.causes import state_table
from reports.findings import fmt_rate


def _ms(s: float) -> str:
    """Milliseconds, or "-" for a time the run could not measure (logged as null, read back as NaN)."""
    return f"{1000 * s:.2f}" if math.isfinite(s) else "-"


def format_summary(rep: Report) -> str:
    thr = rep.throughput
    out = ["Findings:\n" + "\n".join(f"  - {line}" for line in rep.findings.lines)]
    out.append(table(
        ["rank", "device", "batch", "share", "workers", "step ms", "bottleneck", "cap"],
        [(r.rank, r.label, r.batch_size, f"{100 * r.share:.1f}%", r.num_workers,
          f"{1000 * r.predicted_step_time_s:.2f}", r.bottleneck, r.cap if r.cap is not None else "-")
         for r in rep.ranks],
    ))
    eq = thr.equal_split_samples_per_s
    out.append(table(
        ["split", "samples/s", "vs equal"],
        [("equal split", fmt_rate(eq) if eq > 0 else "does not fit", "1.00x" if eq > 0 else "-"),
         ("plan", fmt_rate(thr.plan_samples_per_s), f"{thr.plan_samples_per_s / eq:.2f}x" if eq > 0 else "-"),
         ("ideal", fmt_rate(thr.ideal_samples_per_s), f"{thr.ideal_samples_per_s / eq:.2f}x" if eq > 0 else "-")],
    ))
    headers, states = state_table(rep.causes.states) if rep.causes is not None else ([], [])
    if states:
        out.append("Device and host state while profiled (evidence for the findings above):\n" + table(headers, states))
    if rep.what_ifs:
        out.append(table(
            ["what-if", "samples/s", "change"],
            [(w.label, fmt_rate(w.samples_per_s) if w.feasible else "infeasible",
              f"{100 * w.delta_frac:+.1f}%" if w.feasible else "-") for w in rep.what_ifs],
        ))
    last = rep.log.steady_epoch() if rep.log is not None else None
    if rep.log is not None and last is not None:
        measured = last.measured_busy_s
        periods = [float("nan") if s.loader_period_s is None else s.loader_period_s for s in last.ranks]
        rows = [(i, _ms(p), _ms(measured[i]) if i < len(measured) else "-",
                 f"{100 * (measured[i] - p) / p:+.1f}%" if i < len(measured) and math.isfinite(measured[i])
                 and math.isfinite(p) and p > 0 else "-",
                 _ms(periods[i]) if i < len(periods) else "-")
                for i, p in enumerate(last.predicted_step_time_s)]
        if rows:
            final, why = rep.log.epochs[-1], ""
            if last is not final:
                drained = f": epoch {final.epoch} has {final.drain_steps} steps in the loaders' final drain"
                why = f"the last steady one{drained if final.drain_steps else ''}; "
            out.append(f"Run log, epoch {last.epoch} ({why}busy = compute + data wait, predicted as the compute span "
                       "under DDP where the profile measured it; the whole step where "
                       "the loader paced the rank; never below the loader's own time, its workers' build time "
                       "per step over the workers, up to the step):\n"
                       + table(["rank", "predicted ms", "measured ms", "error", "loader ms"], rows))
    return "\n\n".join(out)
