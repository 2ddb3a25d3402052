"""Report figures (matplotlib, Agg) as PNG bytes, drawn from a reports.analysis.Report.

Figures are built on ``matplotlib.figure.Figure`` directly rather than pyplot: no global figure registry, no
backend selection, nothing left open between reports.  Colours are the Okabe-Ito palette (distinguishable with
the common colour-vision deficiencies); each rank also gets its own marker so print in grey still reads.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from reports.analysis import Report
from reports.findings import fmt_rate
from reports.whatif import FULL_DETAIL_RANKS

FULL_DETAIL_EPOCHS = 60
"""Up to this many epochs the run-log figure marks every point and places its legend where it hides least."""
MAX_EPOCH_TICKS = 20
"""Up to this many epochs every epoch gets a tick; past it, about a dozen integer ticks."""

# Okabe-Ito, reordered so the first colours have the most contrast on white (yellow last).
OKABE_ITO = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#000000", "#F0E442")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "h")
GREY = "#777777"
WIDTH_IN = 10.0
"""Figure width in inches; at DPI this is 1000 px, the report's content width."""
DPI = 100


def colour(i: int) -> str:
    return OKABE_ITO[i % len(OKABE_ITO)]


def marker(i: int) -> str:
    return MARKERS[i % len(MARKERS)]


def png_bytes(fig: Figure) -> bytes:
    buf = io.BytesIO()
    # No bbox_inches="tight": the constrained layout already fits the figure, and "tight" draws it twice.
    fig.savefig(buf, format="png", dpi=DPI, facecolor="white")
    return buf.getvalue()


def _plain_log_labels(axis: Any) -> None:
    """Label a log axis with plain numbers (``16``, ``1024``, ``0.1``).  matplotlib's log formatter writes mathtext
    (``$\\mathdefault{10^{1}}$``), and ``render_all`` turns mathtext off so that a "$" in a device or model name
    prints as itself: the labels would show as raw source."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    axis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:,.10g}"))
    axis.set_minor_formatter(NullFormatter())


def _new(height_in: float, ncols: int = 2) -> tuple[Figure, Any]:
    fig = Figure(figsize=(WIDTH_IN, height_in), layout="constrained")
    axes = fig.subplots(1, ncols)
    for ax in np.atleast_1d(axes):
        ax.grid(True, color="#dddddd", linewidth=0.8)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    return fig, axes


def curves(rep: Report) -> Figure:
    """Per-rank step time and throughput against local batch: measured points, fitted envelope, planned point.

    Ranks with identical measurements (same card, same model) share one line and one colour, so eight ranks of
    three kinds draw three lines, not eight on top of each other; every rank keeps its own planned star.
    """
    fig, (ax_t, ax_x) = _new(4.4)
    b_max = 1.1 * max(max(b for r in rep.ranks for b, _ in r.measured_points), max(r.batch_size for r in rep.ranks))
    grid = np.linspace(1.0, b_max, 300)
    groups: dict[object, list[int]] = {}
    for r in rep.ranks:
        groups.setdefault(r.measured_points, []).append(r.rank)
    if len(groups) > len(OKABE_ITO):
        # Many ranks measured apart (every real card differs a little): one line per device kind, drawn from its
        # first rank; every rank keeps its planned star in its kind's colour.
        groups = {}
        for r in rep.ranks:
            groups.setdefault(r.label, []).append(r.rank)
    handles: list[Any] = []
    for g, ranks in enumerate(groups.values()):
        r = rep.ranks[ranks[0]]
        c, mk = colour(g), marker(g)
        s, k = np.asarray(r.envelope_slopes)[:, None], np.asarray(r.envelope_intercepts)[:, None]
        t = np.max(s * grid[None, :] + k, axis=0)
        mb = np.array([b for b, _ in r.measured_points], dtype=float)
        mt = np.array([x for _, x in r.measured_points])
        who = f"rank {ranks[0]}" if len(ranks) == 1 else (
            "ranks " + ", ".join(map(str, ranks)) if len(ranks) <= 6 else f"{len(ranks)} ranks")
        handles += ax_t.plot(grid, 1000 * t, color=c, linewidth=1.6, label=f"{who} ({r.label})")
        ax_t.scatter(mb, 1000 * mt, color=c, marker=mk, s=28, zorder=3)
        ax_x.plot(grid, grid / t, color=c, linewidth=1.6)
        ax_x.scatter(mb, mb / mt, color=c, marker=mk, s=28, zorder=3)
    # The planned points: each rank's busy time at its planned batch (compute, or loader when that is slower); one
    # scatter per group and one line per distinct cap, so 200 ranks draw in the time of a few.
    for g, ranks in enumerate(groups.values()):
        c = colour(g)
        rows = [rep.ranks[i] for i in ranks]
        b = np.array([r.batch_size for r in rows], dtype=float)
        t = np.array([r.predicted_step_time_s for r in rows])
        ax_t.scatter(b, 1000 * t, s=130, facecolor=c, edgecolor="black", linewidth=1.5, marker="*", zorder=4)
        ax_x.scatter(b, b / t, s=130, facecolor=c, edgecolor="black", linewidth=1.5, marker="*", zorder=4)
        caps = sorted({r.cap for r in rows if r.cap is not None and r.cap <= b_max})
        for cap in caps if len(caps) <= 4 else ():  # dozens of lines are noise: the memory figure shows the caps
            for ax in (ax_t, ax_x):
                ax.axvline(cap, color=c, linestyle=":", linewidth=1.2)
    step = max(r.predicted_step_time_s for r in rep.ranks)
    handles.append(ax_t.axhline(1000 * step, color=GREY, linestyle="--", linewidth=1,
                                label="planned step (every rank done)"))
    ax_t.set(title="Step time vs local batch", xlabel="local batch (samples)", ylabel="step time (ms)")
    ax_x.set(title="Throughput vs local batch", xlabel="local batch (samples)", ylabel="samples/s (rank alone)")
    for ax in (ax_t, ax_x):
        ax.set_xlim(0, b_max)
        ax.set_ylim(bottom=0)
    # Below both panels: never covers a curve, however many kinds there are.
    # The curves and the step line only: cap lines are not legend entries (200 of them collapsed the layout).
    fig.legend(handles=handles, loc="outside lower center", ncols=min(4, len(groups) + 1), fontsize=8,
               frameon=False)
    return fig


def split(rep: Report) -> Figure:
    """Equal split vs plan vs ideal throughput, and each rank's busy time under both splits."""
    fig, (ax_b, ax_r) = _new(3.6)
    thr = rep.throughput
    names = ["equal split", "plan", "ideal"]
    vals = [thr.equal_split_samples_per_s, thr.plan_samples_per_s, thr.ideal_samples_per_s]
    bars = ax_b.bar(names, vals, color=[GREY, colour(0), colour(2)])
    for bar, v in zip(bars, vals, strict=True):
        text = fmt_rate(v) if v > 0 else "does not fit"
        ax_b.annotate(text, (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=9,
                      xytext=(0, 2), textcoords="offset points")
    ax_b.set(title=f"Throughput at global batch {thr.global_batch}", ylabel="samples/s")
    ax_b.set_ylim(0, max(vals) * 1.15)
    ranks = [r.rank for r in rep.ranks]
    y = np.arange(len(ranks))
    eq = [1000 * r.equal_split_step_time_s for r in rep.ranks]
    pl = [1000 * r.predicted_step_time_s for r in rep.ranks]
    if len(ranks) > FULL_DETAIL_RANKS:  # a bar and a label per rank are unreadable (and slow) past a few dozen
        ax_r.plot(ranks, eq, linestyle="none", marker=".", color=GREY, label="equal split")
        ax_r.plot(ranks, pl, linestyle="none", marker=".", color=colour(0), label="plan")
        ax_r.axhline(max(eq), color=GREY, linestyle="--", linewidth=1)
        ax_r.axhline(max(pl), color=colour(0), linestyle="--", linewidth=1)
        ax_r.set(title="Busy time per rank (dashed = synchronous step)", xlabel="rank", ylabel="ms per step")
        ax_r.set_ylim(bottom=0)
        ax_r.legend(fontsize=8, loc="lower right")
        return fig
    ax_r.barh(y + 0.2, eq, height=0.38, color=GREY, label="equal split")
    ax_r.barh(y - 0.2, pl, height=0.38, color=colour(0), label="plan")
    ax_r.axvline(max(eq), color=GREY, linestyle="--", linewidth=1)
    ax_r.axvline(max(pl), color=colour(0), linestyle="--", linewidth=1)
    ax_r.set_yticks(y, [f"rank {r.rank}\n{r.label}" for r in rep.ranks], fontsize=8)
    ax_r.invert_yaxis()
    ax_r.set(title="Busy time per rank (dashed = synchronous step)", xlabel="ms per step")
    ax_r.legend(fontsize=8, loc="lower right")
    return fig


def sweep(rep: Report) -> Figure:
    """Throughput and epoch time against the global batch, with the within-5%-of-best range shaded."""
    fig, (ax_x, ax_e) = _new(3.6)
    ok = [p for p in rep.sweep if p.feasible]
    bs = np.array([p.global_batch for p in ok], dtype=float)
    rng = rep.findings.best_batch_range
    for ax in (ax_x, ax_e):
        ax.set_xscale("log", base=2)
        _plain_log_labels(ax.xaxis)
        if rng is not None:
            ax.axvspan(rng[0], rng[1], color=colour(2), alpha=0.15, label="within 5% of best")
        ax.axvline(rep.throughput.global_batch, color=GREY, linestyle="--", linewidth=1, label="this plan")
        ax.set_xlabel("global batch (samples, log scale)")
    ax_x.plot(bs, [p.samples_per_s for p in ok], color=colour(0), marker="o", label="plan")
    eq = [(p.global_batch, p.equal_split_samples_per_s) for p in ok if p.equal_split_samples_per_s > 0]
    if eq:
        ax_x.plot([b for b, _ in eq], [v for _, v in eq], color=colour(1), marker="s", label="equal split")
    ax_x.set(title="Throughput vs global batch", ylabel="samples/s")
    ax_x.set_ylim(bottom=0)
    ax_x.legend(fontsize=8)
    ax_e.plot(bs, [p.epoch_time_s for p in ok], color=colour(0), marker="o")
    ax_e.set_yscale("log")
    _plain_log_labels(ax_e.yaxis)
    ax_e.set(title=f"Epoch time ({rep.throughput.dataset_size:,} samples)", ylabel="seconds per epoch (log)")
    return fig


def memory(rep: Report) -> Figure | None:
    """Planned batch against each rank's cap (None when no rank has a cap)."""
    capped = [r for r in rep.ranks if r.cap is not None]
    if not capped:
        return None
    if len(rep.ranks) > FULL_DETAIL_RANKS:
        return _memory_many(rep)
    fig, ax = _new(0.9 + 0.45 * len(rep.ranks), ncols=1)
    y = np.arange(len(rep.ranks))
    top = max(max(r.cap or 0 for r in rep.ranks), max(r.batch_size for r in rep.ranks)) * 1.1
    for i, r in enumerate(rep.ranks):
        if r.cap is not None:
            ax.barh(i, r.cap, color="white", edgecolor=colour(r.rank), hatch="//", height=0.6)
        ax.barh(i, r.batch_size, color=colour(r.rank), height=0.6)
        note = f"{r.batch_size} of {r.cap} ({100 * r.batch_size / r.cap:.0f}% of cap)" if r.cap else \
            f"{r.batch_size} (no cap)"
        ax.annotate(note, (min(max(r.cap or 0, r.batch_size), top), i), xytext=(4, 0), textcoords="offset points",
                    va="center", fontsize=8)
    ax.set_yticks(y, [f"rank {r.rank} ({r.label})" for r in rep.ranks], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, top * 1.25)
    ax.set(title="Memory headroom: planned batch (solid) vs cap (hatched)", xlabel="local batch (samples)")
    return fig


def _memory_many(rep: Report) -> Figure:
    """Past a few dozen ranks: each rank's planned batch as a share of its cap, one point per rank."""
    fig, ax = _new(3.6, ncols=1)
    pts = [(r.rank, 100 * r.batch_size / r.cap) for r in rep.ranks if r.cap]
    over = [(k, v) for k, v in pts if v > 100]
    ax.plot([k for k, _ in pts], [v for _, v in pts], linestyle="none", marker=".", color=colour(0),
            label="planned batch / cap")
    if over:
        ax.plot([k for k, _ in over], [v for _, v in over], linestyle="none", marker="x", color=colour(3),
                label="over the cap: out of memory")
    ax.axhline(100, color="black", linewidth=0.8)
    ax.set_ylim(0, max([110.0, *(v * 1.1 for _, v in pts)]))
    ax.set(title="Memory headroom: planned batch as % of each rank's cap", xlabel="rank", ylabel="% of cap")
    ax.legend(fontsize=8, loc="lower right")
    return fig


def what_ifs(rep: Report) -> Figure | None:
    if not rep.what_ifs:
        return None
    items = list(rep.what_ifs)
    fig, ax = _new(0.9 + 0.4 * len(items), ncols=1)
    y = np.arange(len(items))
    vals = [100 * w.delta_frac if w.feasible else 0.0 for w in items]
    cols = [colour(2) if v > 0 else colour(3) for v in vals]
    ax.barh(y, vals, color=cols, height=0.6)
    for i, (w, v) in enumerate(zip(items, vals, strict=True)):
        text = f"{v:+.1f}%  ({fmt_rate(w.samples_per_s)}/s)" if w.feasible else "infeasible"
        ax.annotate(text, (v, i), xytext=(4 if v >= 0 else -4, 0), textcoords="offset points", va="center",
                    ha="left" if v >= 0 else "right", fontsize=8)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_yticks(y, [w.label for w in items], fontsize=8)
    ax.invert_yaxis()
    lo, hi = min([*vals, 0.0]), max([*vals, 0.0])
    pad = 0.35 * (hi - lo or 1.0)
    ax.set_xlim(lo - (pad if lo < 0 else 0), hi + pad)
    ax.set(title=f"What-if: change in samples/s at global batch {rep.throughput.global_batch}",
           xlabel="change vs the current cluster (%)")
    return fig


def scaling(rep: Report) -> Figure | None:
    pts = [p for p in rep.scaling if p.feasible]
    if len(rep.scaling) < 2 or not pts:
        return None
    fig, ax = _new(3.4, ncols=1)
    k = [p.num_ranks for p in pts]
    ax.plot(k, [p.samples_per_s for p in pts], color=colour(0), marker="o", label="plan")
    ax.plot(k, [p.equal_split_samples_per_s for p in pts], color=colour(1), marker="s", label="equal split")
    for p in pts:
        ax.annotate(f"{p.speedup:.2f}x" + ("*" if p.note else ""), (p.num_ranks, p.samples_per_s), xytext=(0, 6),
                    textcoords="offset points", ha="center", fontsize=8)
    if len(k) <= FULL_DETAIL_RANKS:
        ax.set_xticks(k)
    ax.set_ylim(bottom=0)
    ax.set(title="Scaling over the first k ranks (speedup vs rank 0 alone; * = global batch lowered to fit)",
           xlabel="ranks used (0..k-1)", ylabel="samples/s")
    ax.legend(fontsize=8)
    return fig


def run_log(rep: Report) -> Figure | None:
    log = rep.log
    if log is None or not log.epochs:
        return None
    fig, (ax_r, ax_x) = _new(3.8)
    ep = [e.epoch for e in log.epochs]
    n = max(len(e.measured_compute_s) for e in log.epochs)
    # Past 8 ranks a line each is a tangle: the 8 slowest (by their last measured busy time) are drawn.
    last = log.epochs[-1].measured_busy_s
    shown = sorted(range(n), key=lambda i: -(last[i] if i < len(last) and np.isfinite(last[i]) else 0.0))[:8]
    # A long log (thousands of epochs) costs the same few artists as a short one: markers, a tick per epoch and
    # the legend's search for an empty corner all grow with the points, so past a few dozen epochs they go.
    few = len(ep) <= FULL_DETAIL_EPOCHS
    for i in sorted(shown):
        pred = [(e.epoch, 1000 * e.predicted_step_time_s[i]) for e in log.epochs if i < len(e.predicted_step_time_s)]
        meas = [(e.epoch, 1000 * e.measured_busy_s[i]) for e in log.epochs if i < len(e.measured_compute_s)]
        if meas:
            ax_r.plot(*zip(*meas, strict=True), color=colour(i), marker=marker(i) if few else None,
                      label=f"rank {i} measured")
        if pred:
            ax_r.plot(*zip(*pred, strict=True), color=colour(i), linestyle="--", label=f"rank {i} predicted")
    for adopted, style in ((True, "-"), (False, ":")):
        xs = [rp.epoch + 0.5 for rp in log.replans if rp.adopted == adopted]
        for ax in (ax_r, ax_x) if xs else ():  # one collection per kind, however many re-plans
            ax.vlines(xs, 0, 1, transform=ax.get_xaxis_transform(), colors=GREY, linestyles=style, linewidth=1.2)
    ax_r.set(title="Busy time per rank (solid measured, dashed predicted)", xlabel="epoch", ylabel="ms per step")
    ax_r.set_ylim(bottom=0)
    ax_r.legend(fontsize=7, ncols=2, loc="best" if few else "lower left")
    sx = [(e.epoch, e.samples_per_s) for e in log.epochs if e.samples_per_s is not None]
    if sx:
        ax_x.plot(*zip(*sx, strict=True), color=colour(0), marker="o" if few else None, label="measured")
    ax_x.axhline(rep.throughput.plan_samples_per_s, color=colour(2), linestyle="--", label="plan (predicted)")
    ax_x.set(title="Throughput per epoch (vertical: re-plan, solid = adopted)", xlabel="epoch", ylabel="samples/s")
    ax_x.set_ylim(bottom=0)
    for ax in (ax_x, ax_r):
        if len(ep) <= MAX_EPOCH_TICKS:
            ax.set_xticks(ep)
        else:
            ax.xaxis.set_major_locator(MaxNLocator(nbins=12, integer=True))
    ax_x.legend(fontsize=8, loc="best" if few else "lower left")
    return fig


FIGURES: tuple[tuple[str, str, Callable[[Report], Figure | None]], ...] = (
    ("curves", "Per-rank curves", curves),
    ("split", "Equal split vs plan vs ideal", split),
    ("sweep", "Throughput and epoch time vs global batch", sweep),
    ("memory", "Memory headroom", memory),
    ("whatif", "What-if", what_ifs),
    ("scaling", "Scaling over 1..W ranks", scaling),
    ("log", "Predicted vs measured", run_log),
)
"""(id, title, builder) in page order; a builder returns None when its data is absent."""


def render_all(rep: Report) -> dict[str, bytes]:
    """PNG bytes of every figure that has data, keyed by id."""
    import matplotlib

    out = {}
    # Device, host and model names come from files: "$" in one must print as "$", not start mathtext (which
    # raises on a malformed formula and would turn a report into a traceback).
    with matplotlib.rc_context({"text.parse_math": False}):
        for key, _, build in FIGURES:
            fig = build(rep)
            if fig is not None:
                out[key] = png_bytes(fig)
    return out
