"""The self-contained HTML page: findings, tables and figures (PNG as base64 data URIs), inline CSS, no scripts
and no network.  Every dynamic string is escaped; the page is deterministic for the same inputs (no timestamp),
so a committed example report only changes when its numbers do.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Sequence

from reports.analysis import Report
from reports.causes import state_table
from reports.findings import fmt_rate

CSS = """
body{font-family:-apple-system,"Segoe UI",Roboto,"DejaVu Sans",Arial,sans-serif;color:#1a1a1a;background:#fff;
 margin:0;line-height:1.45}
main{max-width:1040px;margin:0 auto;padding:24px 20px 48px}
h1{font-size:1.6em;margin:0 0 4px}h2{font-size:1.2em;margin:32px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
.meta{color:#555;font-size:.9em;margin:0 0 16px}
.findings{background:#f3f7fb;border-left:4px solid #0072B2;padding:10px 16px 10px 32px;margin:12px 0 8px}
.findings li{margin:4px 0}
.kpis{display:flex;flex-wrap:wrap;gap:12px;margin:12px 0}
.kpi{border:1px solid #ddd;border-radius:6px;padding:8px 14px;min-width:150px}
.kpi b{display:block;font-size:1.35em}.kpi span{color:#555;font-size:.85em}
table{border-collapse:collapse;font-size:.88em;margin:8px 0;font-variant-numeric:tabular-nums}
th,td{padding:4px 10px;border-bottom:1px solid #e4e4e4;text-align:left}
td.n,th.n{text-align:right}th{background:#fafafa}
figure{margin:12px 0}figure img{max-width:100%;height:auto;display:block}
figcaption{color:#555;font-size:.85em;margin-top:4px}
.note{color:#555;font-size:.85em}
"""


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]], numeric: Sequence[bool]) -> str:
    head = "".join(f'<th class="n">{_e(h)}</th>' if n else f"<th>{_e(h)}</th>"
                   for h, n in zip(headers, numeric, strict=True))
    body = "".join(
        "<tr>" + "".join(f'<td class="n">{_e(c)}</td>' if n else f"<td>{_e(c)}</td>"
                         for c, n in zip(r, numeric, strict=True)) + "</tr>"
        for r in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _figure(pngs: dict[str, bytes], key: str, alt: str, caption: str) -> str:
    if key not in pngs:
        return ""
    data = base64.b64encode(pngs[key]).decode("ascii")
    return (f'<figure id="fig-{key}"><img src="data:image/png;base64,{data}" alt="{_e(alt)}">'
            f"<figcaption>{_e(caption)}</figcaption></figure>")


def _ms(s: float) -> str:
    """Milliseconds, or "-" for a time the run could not measure (logged as null, read back as NaN)."""
    return f"{1000 * s:.2f}" if math.isfinite(s) else "-"


def render_html(rep: Report, pngs: dict[str, bytes], *, title: str = "ddp-planner capacity report") -> str:
    """The whole page as a string (figures from reports.figures.render_all)."""
    thr = rep.throughput
    parts: list[str] = []
    model = f" &middot; model {_e(rep.model_name)}" if rep.model_name else ""
    parts.append(f"<h1>{_e(title)}</h1>")
    parts.append(
        f'<p class="meta">{rep.world_size} rank(s) &middot; global batch {thr.global_batch}{model} &middot; '
        f"plan {_e(rep.plan_fingerprint)} ({_e(rep.plan_method)}) &middot; min batch {rep.min_batch}</p>"
    )
    eq = thr.equal_split_samples_per_s
    kpis = [
        (fmt_rate(thr.plan_samples_per_s), "samples/s with the plan"),
        (f"{thr.plan_samples_per_s / eq:.2f}x" if eq > 0 else "n/a", "vs equal split (DistributedSampler)"),
        (f"{100 * thr.plan_samples_per_s / thr.ideal_samples_per_s:.1f}%", "of ideal (nobody waits)"),
        (f"{_ms(thr.step_time_s)} ms", "predicted step"),
    ]
    parts.append('<div class="kpis">' + "".join(f'<div class="kpi"><b>{_e(v)}</b><span>{_e(k)}</span></div>'
                                                 for v, k in kpis) + "</div>")
    parts.append('<h2 id="findings">Findings</h2><ul class="findings">'
                 + "".join(f"<li>{_e(line)}</li>" for line in rep.findings.lines) + "</ul>")

    parts.append(_causes_section(rep))
    parts.append('<h2 id="plan">Plan</h2>')
    parts.append(_table(
        ["rank", "device", "host", "batch", "share", "workers", "step ms", "compute ms", "loader ms", "bottleneck",
         "equal-split ms"],
        [(r.rank, r.label, r.host, r.batch_size, f"{100 * r.share:.1f}%", r.num_workers, _ms(r.predicted_step_time_s),
          _ms(r.predicted_compute_s), _ms(r.predicted_loader_s), r.bottleneck, _ms(r.equal_split_step_time_s))
         for r in rep.ranks],
        [False, False, False, True, True, True, True, True, True, False, True],
    ))
    parts.append(_figure(pngs, "curves", "Per-rank step time and throughput curves",
                         "Measured points, the fitted convex envelope the solver uses, and each rank's planned "
                         "point (star); a star above its curve means the loader, not compute, sets that rank's time. "
                         "Ranks with identical measurements share a line. Dotted verticals are batch caps."))
    parts.append('<h2 id="split">Equal split vs plan vs ideal</h2>')
    parts.append(_table(
        ["split", "samples/s", "step ms", f"epoch ({thr.dataset_size:,} samples)"],
        [("equal split", fmt_rate(eq) if eq > 0 else "does not fit",
          _ms(thr.global_batch / eq) if eq > 0 else "-",
          f"{thr.equal_split_epoch_time_s:.1f} s" if thr.equal_split_epoch_time_s is not None else "-"),
         ("plan", fmt_rate(thr.plan_samples_per_s), _ms(thr.step_time_s), f"{thr.epoch_time_s:.1f} s"),
         ("ideal", fmt_rate(thr.ideal_samples_per_s), "-", "-")],
        [False, True, True, True],
    ))
    parts.append(f'<p class="note">Exposed communication per step: {_ms(thr.comm_s)} ms. Ideal = sum over ranks '
                 "of batch / busy time at the planned batches: every rank flat out, nobody waiting.</p>")
    parts.append(_figure(pngs, "split", "Throughput of equal split, plan and ideal; busy time per rank",
                         "Left: predicted samples/s. Right: each rank's busy time; the synchronous step is the "
                         "longest bar (dashed), so short bars are time spent waiting."))

    parts.append('<h2 id="sweep">Global batch</h2>')
    parts.append(_figure(pngs, "sweep", "Throughput and epoch time against global batch",
                         "planner.solve at each global batch. Shaded: within 5% of the best throughput."))
    parts.append(_table(
        ["global batch", "samples/s", "equal split /s", "step ms", "epoch s", "batch sizes"],
        [(p.global_batch, fmt_rate(p.samples_per_s), fmt_rate(p.equal_split_samples_per_s), _ms(p.step_time_s),
          f"{p.epoch_time_s:.1f}", " ".join(map(str, p.batch_sizes))) if p.feasible
         else (p.global_batch, "infeasible", "-", "-", "-", p.note) for p in rep.sweep],
        [True, True, True, True, True, False],
    ))

    parts.append('<h2 id="memory">Memory headroom</h2>')
    parts.append(_table(
        ["rank", "device", "batch", "cap", "predicted peak GB", "capacity GB", "free at plan"],
        [(r.rank, r.label, r.batch_size, r.cap if r.cap is not None else "none",
          f"{r.predicted_peak_bytes / 1e9:.2f}" if r.predicted_peak_bytes is not None else "-",
          f"{r.capacity_bytes / 1e9:.1f}" if r.capacity_bytes else "-",
          f"{100 * r.memory_free_frac:.0f}%" if r.memory_free_frac is not None else "-") for r in rep.ranks],
        [True, False, True, True, True, True, True],
    ))
    parts.append(_figure(pngs, "memory", "Planned batch against each rank's memory cap",
                         "The cap keeps the memory-fit peak below capacity minus headroom."))

    parts.append('<h2 id="whatif">What-if</h2>')
    parts.append(_table(
        ["scenario", "ranks", "samples/s", "change", "batch sizes"],
        [(w.label, w.world_size, fmt_rate(w.samples_per_s), f"{100 * w.delta_frac:+.1f}%",
          " ".join(map(str, w.batch_sizes))) if w.feasible else (w.label, w.world_size, "infeasible", "-", w.note)
         for w in rep.what_ifs],
        [False, True, True, True, False],
    ))
    # The base every change is against: the what-ifs' own (on a run log's measured speeds, when one is given).
    base = next((w.samples_per_s - w.delta_samples_per_s for w in rep.what_ifs if w.feasible),
                thr.resolved_samples_per_s)
    basis = f" The scenarios are solved {_e(rep.what_if_basis)}." if rep.what_if_basis else ""
    parts.append(f'<p class="note">Each scenario is re-solved at global batch {thr.global_batch}; the change is '
                 f"against the re-solved current cluster ({fmt_rate(base)} samples/s). Added ranks "
                 f"share their host's CPU cores with the ranks already there.{basis}</p>")
    parts.append(_figure(pngs, "whatif", "Change in throughput for each what-if scenario", ""))

    parts.append('<h2 id="scaling">Scaling over 1..W ranks</h2>')
    parts.append(_figure(pngs, "scaling", "Throughput when using the first k ranks",
                         "Solved on ranks 0..k-1 at the same global batch (or the largest that fits)."))
    parts.append(_table(
        ["ranks", "global batch", "samples/s", "equal split /s", "speedup", "note"],
        [(p.num_ranks, p.global_batch, fmt_rate(p.samples_per_s) if p.feasible else "infeasible",
          fmt_rate(p.equal_split_samples_per_s) if p.feasible else "-", f"{p.speedup:.2f}x" if p.feasible else "-",
          p.note) for p in rep.scaling],
        [True, True, True, True, True, False],
    ))
    if rep.log is not None:
        parts.append(_log_section(rep, pngs))
    parts.append('<p class="note">Generated by ddp-planner (<code>planner report</code>). All predictions come from '
                 "the profile's fitted curves and planner.solve; measured numbers come only from the run log.</p>")
    body = "\n".join(p for p in parts if p)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<title>{_e(title)}</title><style>{CSS}</style></head>\n<body><main>\n{body}\n</main></body></html>\n"
    )


def _causes_section(rep: Report) -> str:
    """Why slow ranks are slow: each finding's evidence, then every rank's measured device and host state."""
    causes = rep.causes
    headers, rows = state_table(causes.states) if causes is not None else ([], [])
    if causes is None or (not causes.slow_ranks and not rows):
        return ""
    parts = ['<h2 id="causes">Why ranks are slow</h2>']
    if causes.slow_ranks:
        items = []
        for s in causes.slow_ranks:
            facts = "".join(f"<li>{_e(e.text)}</li>" for e in s.evidence if e.explains) or \
                f"<li>{_e(s.unexplained)}</li>"
            facts += "".join(f'<li class="note">{_e(e.text)}</li>' for e in s.evidence if not e.explains)
            facts += "".join(f'<li class="note">{_e(c)}</li>' for c in s.checked)
            if s.what_if is not None:
                facts += (f"<li>what-if {_e(s.what_if.label)}: {s.what_if.samples_per_s:,.0f} samples/s "
                          f"({100 * s.what_if.delta_frac:+.0f}%)</li>")
            # Against its own earlier epoch a rank slowed from an epoch on; against a peer it was slow in one.
            when = "from" if s.reference.startswith("epoch") else "in"
            head = (f"rank {s.rank} ({_e(s.label)}), {100 * s.slower_frac:.0f}% slower than {_e(s.reference)}"
                    + (f" {when} epoch {s.epoch} (run log)" if s.epoch is not None else ""))
            items.append(f"<li><b>{head}</b><ul>{facts}</ul></li>")
        parts.append("<ul>" + "".join(items) + "</ul>")
    else:
        parts.append('<p class="note">No rank is more than 15% slower than another of the same device name'
                     + (", nor, in the run log, than another against its profiled curve" if rep.log is not None
                        else "") + ".</p>")
    if rows:
        parts.append(_table(headers, rows, [h not in ("throttle", "PCIe", "cores") for h in headers]))
        parts.append('<p class="note">Sampled over each rank\'s compute sweep: other compute processes on its GPU '
                     "(NVML), SM clock / max, slowing throttle reasons, power / limit, temperature, PCIe link / max, "
                     "NUMA node of the GPU / of the process, CPU cores it may run on, CPU other processes used on "
                     "those cores (in cores), and the host's load average / CPUs. A dash: not measurable there.</p>")
    return "\n".join(parts)


def _log_section(rep: Report, pngs: dict[str, bytes]) -> str:
    log = rep.log
    assert log is not None
    parts = ['<h2 id="log">Predicted vs measured (run log)</h2>']
    parts.append(_figure(pngs, "log", "Predicted and measured busy time per rank over epochs",
                         "Measured busy = compute + data wait (what a rank spends before it waits for its peers); "
                         "predicted: the rank's compute span under DDP where the profile measured it (comm.span_factors), "
                         "else its standalone step or its loader's time; where "
                         "the data wait is over 10% of the step the loader paced the rank and busy is the whole step "
                         "(its workers keep loading through the all-reduce tail); where the workers timed their "
                         "batches, busy is never below the loader's own time per step (a loader that kept up only "
                         "because a peer paced the step still costs it), up to the step itself."))
    rows = []
    for e in log.epochs:
        for i, busy in enumerate(e.measured_busy_s):
            pred = e.predicted_step_time_s[i] if i < len(e.predicted_step_time_s) else None
            ok = pred is not None and math.isfinite(pred) and pred > 0 and math.isfinite(busy)
            err = f"{100 * (busy - pred) / pred:+.1f}%" if ok and pred else "-"
            period = e.ranks[i].loader_period_s if i < len(e.ranks) else None
            rows.append((e.epoch, i, e.batch_sizes[i] if i < len(e.batch_sizes) else "-",
                         _ms(pred) if pred is not None else "-", _ms(busy), _ms(e.measured_compute_s[i]),
                         _ms(e.measured_data_wait_s[i]), _ms(period) if period is not None else "-",
                         _ms(e.measured_step_time_s[i]), err))
    parts.append(_table(["epoch", "rank", "batch", "predicted ms", "measured busy ms", "compute ms", "data wait ms",
                         "loader ms", "step ms", "error"], rows, [True] * 10))
    if log.replans:
        parts.append("<p>Re-plan decisions at epoch boundaries:</p>")
        parts.append(_table(
            ["after epoch", "adopted", "predicted gain", "old batch sizes", "new batch sizes", "reason"],
            [(r.epoch, "yes" if r.adopted else "no",
              f"{100 * r.predicted_gain:.1f}%" if r.predicted_gain is not None else "-",
              " ".join(map(str, r.old_batch_sizes)), " ".join(map(str, r.new_batch_sizes)), r.reason)
             for r in log.replans],
            [True, False, True, False, False, False],
        ))
    if log.num_skipped_lines:
        parts.append(f'<p class="note">{log.num_skipped_lines} truncated trailing line(s) skipped.</p>')
    return "\n".join(p for p in parts if p)
