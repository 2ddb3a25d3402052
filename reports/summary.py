"""The terminal summary of a report: findings, then aligned tables (people read tables; machines read --json)."""

from __future__ import annotations

from planner.table import table
from reports.analysis import Report
from reports.causes import state_table


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
        [("equal split", f"{eq:.1f}" if eq > 0 else "does not fit", "1.00x" if eq > 0 else "-"),
         ("plan", f"{thr.plan_samples_per_s:.1f}", f"{thr.plan_samples_per_s / eq:.2f}x" if eq > 0 else "-"),
         ("ideal", f"{thr.ideal_samples_per_s:.1f}", f"{thr.ideal_samples_per_s / eq:.2f}x" if eq > 0 else "-")],
    ))
    headers, states = state_table(rep.causes.states) if rep.causes is not None else ([], [])
    if states:
        out.append("Device and host state while profiled (evidence for the findings above):\n" + table(headers, states))
    if rep.what_ifs:
        out.append(table(
            ["what-if", "samples/s", "change"],
            [(w.label, f"{w.samples_per_s:.1f}" if w.feasible else "infeasible",
              f"{100 * w.delta_frac:+.1f}%" if w.feasible else "-") for w in rep.what_ifs],
        ))
    if rep.log is not None and rep.log.epochs:
        last = rep.log.epochs[-1]
        rows = [(i, f"{1000 * p:.2f}", f"{1000 * m:.2f}", f"{100 * (m - p) / p:+.1f}%")
                for i, (p, m) in enumerate(zip(last.predicted_step_time_s, last.measured_busy_s, strict=False))
                if p > 0]
        if rows:
            out.append(f"Run log, epoch {last.epoch} (busy = compute + data wait):\n"
                       + table(["rank", "predicted ms", "measured ms", "error"], rows))
    return "\n\n".join(out)
