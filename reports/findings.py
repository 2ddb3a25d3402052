"""The report's findings: a few plain-language lines, most important first, that stay short at any cluster size.

Every line names numbers, and at scale it counts and summarises instead of listing: on 200 ranks, listing
every binding rank would take 2,565 characters; instead the first finding says "set by 157 of 200 ranks (T4 x66,
...): ranks 0..39, 42, 45 and 114 more".  ``MAX_LISTED`` items at most per line; the full per-rank numbers are in the
tables and ``--json``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.loader import handover_costs_s
from planner.plan import Plan
from planner.profile import Profile
from planner.quality import ProfileQuality, kept_within_noise, noise_line
from planner.runlog import RunLog
from planner.solve import SolveOptions, kept_equal_split, worker_budgets
from reports.measured import log_findings
from reports.whatif import SweepPoint, WhatIf, best_range

if TYPE_CHECKING:  # analysis imports this module; the row types are only annotations here
    from reports.analysis import RankRow, Throughput

BINDING_TOL = 0.01
"""A rank whose busy time is within 1% of the slowest one is counted as setting the step time."""
MIN_DROP_GAIN = 0.001
"""Dropping a rank must gain at least 0.1% samples/s to be a finding."""
MAX_LISTED = 6
"""Items one finding lists before it says "and N more"."""


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
    over_cap_ranks: tuple[int, ...] = ()
    """Ranks whose planned batch is over their cap (a plan forced with --from-batches --force): they will OOM."""


# -- formatting ----------------------------------------------------------------------------------------------
def fmt_rate(x: float) -> str:
    """samples/s with enough digits at any scale: 12,345 / 43.2 / 0.00173 (a 10^6-skewed cluster printed "0")."""
    if not math.isfinite(x):
        return "-"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def fmt_s(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g} s" if seconds < 1 else f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:,.1f} days"


def fmt_step(seconds: float) -> str:
    """A step time: milliseconds while they read well, then seconds, minutes... ("3000000.0 ms" did not)."""
    return f"{1000 * seconds:.1f} ms" if seconds < 10 else fmt_s(seconds)


def rank_list(ids: Sequence[int], limit: int = MAX_LISTED) -> str:
    """'rank 3', 'ranks 0..39, 42, 45 and 114 more': consecutive runs as ranges, at most `limit` items."""
    ids = sorted(ids)
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    items = [str(a) if a == b else (f"{a}, {b}" if b == a + 1 else f"{a}..{b}") for a, b in runs]
    shown = items[:limit]
    rest = sum(b - a + 1 for a, b in runs[limit:])
    text = ", ".join(shown) + (f" and {rest} more" if rest else "")
    return ("rank " if len(ids) == 1 else "ranks ") + text


def kinds_text(labels: Sequence[str], limit: int = 3) -> str:
    """'T4 x66, A100 x53, V100 x38': the device kinds of a set of ranks, most common first."""
    counts = Counter(labels).most_common()
    parts = [f"{k} x{n}" for k, n in counts[:limit]]
    if len(counts) > limit:
        parts.append(f"{len(counts) - limit} more kind(s)")
    return ", ".join(parts)


def _who(rows: Sequence[RankRow], ids: Sequence[int]) -> str:
    if len(ids) <= 3:
        return ", ".join(f"rank {i} ({rows[i].label})" for i in ids)
    return f"{len(ids)} of {len(rows)} ranks ({kinds_text([rows[i].label for i in ids])}): {rank_list(ids)}"


def _listed(items: Sequence[str], limit: int = MAX_LISTED) -> str:
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


# -- the findings --------------------------------------------------------------------------------------------
def loader_needs(profile: Profile, rows: Sequence[RankRow], opts: SolveOptions) -> list[LoaderNeed]:
    """Ranks whose loader is slower than their compute at the planned batch, and the workers that would fix it."""
    budgets = worker_budgets(profile, opts)
    out = []
    for r in rows:
        if r.predicted_loader_s <= r.predicted_compute_s or r.predicted_compute_s <= 0:
            continue
        sec = profile.rank(r.rank).loader
        # Worker-seconds one step's batch costs: with workers, at the host's training load as the plan modelled
        # it (planner.loader: b * p_eff = loader time * workers); loaded in the training process, the plain cost.
        cpu_s = (r.predicted_loader_s * r.num_workers if r.num_workers > 0
                 else (sec.sec_per_sample if sec else 0.0) * r.batch_size)
        out.append(LoaderNeed(rank=r.rank, num_workers=r.num_workers,
                              workers_needed=max(1, math.ceil(cpu_s / r.predicted_compute_s - 1e-9)), host=r.host,
                              host_worker_budget=budgets[r.host]))
    return out


def _over_cap_line(rows: Sequence[RankRow]) -> tuple[list[str], tuple[int, ...]]:
    # With accumulation a rank's step is several micro-batches: each of them must fit, not their sum.
    over = [r for r in rows if r.cap is not None and (r.micro_batch_size or r.batch_size) > r.cap]
    if not over:
        return [], ()
    listed = _listed([f"rank {r.rank} gets {r.micro_batch_size or r.batch_size} (cap {r.cap})" for r in over])
    return [f"Out of memory ahead: {listed}. The plan puts {'a rank' if len(over) == 1 else f'{len(over)} ranks'} "
            "over the largest batch that fits (a split given with --from-batches --force); re-plan without it."], \
        tuple(r.rank for r in over)


MEASURED_BINDING_TOL = 0.05
"""In a run log's epoch, a rank busy within 5% of the busiest one sets the step with it (the epoch-to-epoch noise
of a measured busy time is a few percent; the prediction's 1% would split ties the run cannot tell apart)."""


def _step_line(rows: Sequence[RankRow], thr: Throughput, binding: tuple[int, ...]) -> str:
    t_max = max(r.predicted_step_time_s for r in rows)
    what = " / ".join(sorted({rows[i].bottleneck for i in binding}))
    comm = f", plus {1000 * thr.comm_s:.1f} ms of exposed communication" if thr.comm_s > 0 else ""
    if len(binding) == len(rows) and len(rows) > 1:
        return (f"All {len(rows)} ranks finish their step together at {fmt_step(t_max)} ({what}-bound){comm}: "
                "the split is balanced and nobody waits.")
    return f"Step time {fmt_step(thr.step_time_s)} is set by {_who(rows, binding)} ({what}-bound){comm}."


def _measured_step_line(rows: Sequence[RankRow], binding: tuple[int, ...], log: RunLog) -> str | None:
    """The step as the run log's steady epoch (``RunLog.steady_epoch``) measured it, when the ranks that set it
    are not the ones the profile predicted (the profile said "balanced, nobody waits" of a run whose rank 1 was
    busy 5x rank 0); None when the epoch agrees, is drained, or lacks per-rank times."""
    e = log.steady_epoch()
    if e is None or e.drained or not e.step_time_s or not math.isfinite(e.step_time_s) or len(e.ranks) != len(rows):
        return None
    busy = [b if math.isfinite(b) else 0.0 for b in e.measured_busy_s]
    top = max(busy)
    if top <= 0:
        return None
    measured = tuple(i for i, b in enumerate(busy) if b >= (1 - MEASURED_BINDING_TOL) * top)
    if set(measured) <= set(binding) and (len(measured) > 1 or len(binding) == 1):
        return None  # the ranks the profile named set it (or some of them, within noise)
    others = [i for i in range(len(rows)) if i not in measured]
    waiting = (f"; {_listed([f'rank {i} is busy {fmt_step(busy[i])}' for i in others])} and "
               f"wait{'s' if len(others) == 1 else ''} for {'it' if len(measured) == 1 else 'them'}" if others else "")
    split = "" if tuple(e.batch_sizes) == tuple(r.batch_size for r in rows) else f", split {list(e.batch_sizes)}"
    said = (f"all {len(rows)} ranks together at {fmt_step(max(r.predicted_step_time_s for r in rows))}"
            if len(binding) == len(rows) else f"{rank_list(binding)} at {fmt_step(rows[binding[0]].predicted_step_time_s)}")
    if split:
        said += f" for the plan's split {[r.batch_size for r in rows]}"
    return (f"Step time {fmt_step(e.step_time_s)} measured in the run log (epoch {e.epoch}{split}) is set by "
            f"{_who(rows, measured)}, busy {fmt_step(top)} a step{waiting}; the profile predicted {said}.")


def _throughput_line(thr: Throughput) -> str:
    from reports.analysis import DEFAULT_DATASET_SIZE

    eq = thr.equal_split_samples_per_s
    gain = (f" = {thr.plan_samples_per_s / eq:.2f}x the equal split ({fmt_rate(eq)})" if eq > 0
            else " (the equal split does not fit in memory)")
    size_note = (f" (the --dataset-size default of {DEFAULT_DATASET_SIZE:,}; pass your dataset's size)"
                 if thr.dataset_size_source == "default" else "")
    return (f"The plan gives {fmt_rate(thr.plan_samples_per_s)} samples/s at global batch {thr.global_batch}{gain}; "
            f"ideal {fmt_rate(thr.ideal_samples_per_s)}; an epoch of {thr.dataset_size:,} samples{size_note} takes "
            f"{fmt_s(thr.epoch_time_s)}.")


def _best_range_line(points: tuple[SweepPoint, ...], rng: tuple[int, int], global_batch: int) -> str:
    """The sweep's best global batch sizes; a single one is named as such, never as a range "256..256"."""
    feasible = [p for p in points if p.feasible]
    best = max(p.samples_per_s for p in feasible)
    top = max(p.global_batch for p in feasible)
    if rng[0] == rng[1]:
        text = (f"Best global batch in the sweep: {rng[0]} ({fmt_rate(best)} samples/s; every other size tried is "
                "more than 5% slower)")
    else:
        text = f"Best global batch range: {rng[0]}..{rng[1]} (within 5% of the sweep's best {fmt_rate(best)} samples/s)"
    if rng[1] == top:
        text += f"; {top} is the sweep's upper end (the memory caps, or twice the largest measured batches)"
    outside = not rng[0] <= global_batch <= rng[1]
    return (text + (f"; {global_batch} is outside it" if outside else "")
            + ". The global batch is your convergence choice; the planner never changes it.")


def _what_if_lines(profile: Profile, rows: Sequence[RankRow], what_ifs: Sequence[WhatIf], *,
                   drop_floor_samples_per_s: float = 0.0,
                   what_if_basis: str = "") -> tuple[list[str], tuple[int, ...], tuple[int, ...]]:
    lines = []
    # A gain under 0.1% is noise-level (and printed as "+0.0%"): not a finding.  Nor is a drop that beats only the
    # split kept (the equal split within the min gain): the plan needs a rank whose best split with it is faster
    # than the best without it (``drop_floor_samples_per_s``).
    floor = (1 + MIN_DROP_GAIN) * drop_floor_samples_per_s
    drops = sorted((w for w in what_ifs if w.kind == "drop" and w.feasible and w.delta_frac >= MIN_DROP_GAIN
                    and w.samples_per_s > floor), key=lambda w: -w.delta_samples_per_s)
    if drops:
        listed = _listed([f"rank {w.subject_rank} ({rows[w.subject_rank].label}) +{100 * w.delta_frac:.1f}%"
                          for w in drops])
        basis = f"; {what_if_basis}" if what_if_basis else ""
        lines.append(f"Dropping one of these ranks raises throughput: {listed}. They cost more than they add "
                     f"(each what-if drops one rank at the same global batch{basis}).")
    elif profile.world_size > 1:
        basis = f" ({what_if_basis})" if what_if_basis else ""
        lines.append(f"Every rank adds throughput: dropping any of them lowers samples/s{basis}.")
    ups = sorted((w for w in what_ifs if w.kind == "upgrade" and w.feasible and w.delta_frac >= 0.05),
                 key=lambda w: -w.delta_samples_per_s)
    if ups:
        w = ups[0]
        lines.append(f"Best upgrade: {w.label} (+{100 * w.delta_frac:.0f}%, {fmt_rate(w.samples_per_s)} samples/s).")
    adds = sorted((w for w in what_ifs if w.kind == "add" and w.feasible), key=lambda w: -w.delta_samples_per_s)
    if adds and adds[0].delta_samples_per_s > 0:
        w = adds[0]
        lines.append(f"Best addition: {w.label} (+{100 * w.delta_frac:.0f}%, {fmt_rate(w.samples_per_s)} samples/s).")
    return lines, tuple(w.subject_rank for w in drops), tuple(w.subject_rank for w in ups)


def _loader_lines(profile: Profile, starved: Sequence[LoaderNeed], opts: SolveOptions) -> list[str]:
    """One line per host with starved ranks -- or, past three hosts, one line for all of them."""
    hosts = sorted({n.host for n in starved})
    if len(hosts) > 3:
        need = [n.workers_needed for n in starved]
        have = [n.num_workers for n in starved]
        worst = max(starved, key=lambda n: n.workers_needed - n.num_workers)

        def span(xs: list[int]) -> str:
            return f"{min(xs)}" if min(xs) == max(xs) else f"{min(xs)}-{max(xs)}"

        return [f"{len(starved)} ranks on {len(hosts)} hosts are loader-starved (data takes longer than compute): "
                f"they need {span(need)} workers each and have {span(have)}; worst: rank {worst.rank} on {worst.host} "
                f"needs {worst.workers_needed} (has {worst.num_workers}). Give those hosts more cores (each keeps "
                f"{opts.cpu_reserve_per_rank} per rank for training) or run fewer ranks on them."]
    lines = []
    for host in hosts:
        needs = [n for n in starved if n.host == host]
        n_ranks = sum(1 for r in profile.ranks if r.host == host)
        h = profile.host(host)
        if all(n.num_workers == 0 for n in needs):
            # worker_budgets gave fewer spare cores than ranks: loading runs inside the training process.
            lines.append(
                f"Loader-starved on {host}: {rank_list([n.rank for n in needs])} load data in the training process "
                f"because {h.cpu_cores} cores for {n_ranks} ranks leave {needs[0].host_worker_budget} for workers "
                f"(fewer than one per rank); they need "
                + _listed([f"{n.workers_needed}" for n in needs])
                + " worker(s) respectively: give the host more cores or run fewer ranks on it.")
            continue
        listed = _listed([f"rank {n.rank} needs {n.workers_needed} (has {n.num_workers})" for n in needs])
        # --max-workers-per-rank is a remedy only where it binds: uncapped (the default), the host's cores do.
        capped = opts.max_workers_per_rank is not None and any(
            n.num_workers >= opts.max_workers_per_rank for n in needs)
        more = ("more workers (raise --max-workers-per-rank, or lift the rank's worker cap), " if capped
                else "more workers (lift the rank's worker cap, if it has one; else give the host more cores), ")
        lines.append(
            f"Loader-starved on {host}: data takes longer than compute; {listed} worker(s); the host can give "
            f"{needs[0].host_worker_budget} in all ({h.cpu_cores} cores minus {opts.cpu_reserve_per_rank} per rank). "
            f"Relieve it with {more}fewer ranks on the host (their workers share its cores), or lighter CPU "
            "transforms (e.g. decode smaller, move augmentation to the GPU).")
    return lines


def _handover_lines(profile: Profile, plan: Plan) -> list[str]:
    """Ranks whose step the batches' hand-over sets (planner.loader.handover_costs_s: the training process pins
    every batch on one thread): more workers do not relieve them."""
    out = []
    for r, q in zip(plan.ranks, handover_costs_s(profile), strict=False):
        t = q * r.batch_size
        if q > 0 and t >= (1 - BINDING_TOL) * r.predicted_step_time_s:
            lp = profile.rank(r.rank).loader
            assert lp is not None and lp.sample_bytes and lp.handover_bytes_per_s
            out.append(f"Hand-over-bound: rank {r.rank}'s batch of {r.batch_size} ({lp.sample_bytes * r.batch_size / 1e6:,.0f} "
                       f"MB) takes {1000 * t:.1f} ms to pin at {lp.handover_bytes_per_s / 1e9:.1f} GB/s, its whole "
                       f"step: more workers do not relieve it; fewer bytes a sample (e.g. uint8 images normalized on "
                       "the GPU) or a smaller share on this rank do.")
    return out


def make_findings(profile: Profile, plan: Plan, rows: Sequence[RankRow], thr: Throughput,
                  points: tuple[SweepPoint, ...], what_ifs: Sequence[WhatIf], opts: SolveOptions, *,
                  quality: ProfileQuality | None = None, log: RunLog | None = None,
                  drop_floor_samples_per_s: float = 0.0, what_if_basis: str = "") -> Findings:
    """The findings (module docstring).  ``drop_floor_samples_per_s``: the best split of the whole cluster on the
    what-ifs' basis (min gain 0): a drop must beat it to be suggested.  ``what_if_basis``: what the what-ifs read
    beside the profile, said in their line ("" when the profile alone)."""
    t_max = max(r.predicted_step_time_s for r in rows)
    binding = tuple(r.rank for r in rows if r.predicted_step_time_s >= (1 - BINDING_TOL) * t_max)
    lines: list[str] = []
    # A profile that fails the quality gate undermines every number below: say so first.
    if quality is not None:
        lines.extend(f"Profile quality: {i.message}." for i in quality.issues)
        noisy = noise_line(plan, quality)
        if noisy is not None:
            lines.append(noisy[0].upper() + noisy[1:] + ".")
    over_lines, over = _over_cap_line(rows)
    lines += over_lines
    measured_step = _measured_step_line(rows, binding, log) if log is not None else None
    lines += [measured_step or _step_line(rows, thr, binding), _throughput_line(thr)]
    if log is not None:
        lines.extend(log_findings(log, plan, profile, quality))
    kept = None if kept_within_noise(plan) is not None else kept_equal_split(plan)  # noise: said above
    if kept is not None:
        optimum, opt_gain, min_gain = kept
        shown = str(optimum) if len(optimum) <= 8 else f"[{', '.join(map(str, optimum[:6]))}, ...]"
        lines.append(
            f"The equal split was kept: the optimum {shown} is predicted only {opt_gain:.1%} faster, under the min "
            f"gain of {min_gain:.0%} -- within the planner's prediction error, and on flat (launch-bound) curves such "
            "lopsided splits measured slower; `planner plan --min-gain 0` plans it anyway.")
    resolve_gain = thr.resolved_samples_per_s / thr.plan_samples_per_s - 1.0
    noise = quality.noise_for(plan) if quality is not None else 0.0
    if resolve_gain > 0.001 and resolve_gain > noise:  # a "gain" inside the noise is no reason to re-plan
        lines.append(
            f"Re-solving this profile gives {fmt_rate(thr.resolved_samples_per_s)} samples/s "
            f"({thr.resolved_samples_per_s / thr.plan_samples_per_s:.2f}x the given plan): run `planner plan` again.")
    rng = best_range(points)
    if rng is not None:
        lines.append(_best_range_line(points, rng, thr.global_batch))
    more, drops, ups = _what_if_lines(profile, rows, what_ifs, drop_floor_samples_per_s=drop_floor_samples_per_s,
                                      what_if_basis=what_if_basis)
    lines += more
    starved = loader_needs(profile, rows, opts)
    lines += _loader_lines(profile, starved, opts) or ["No rank is loader-starved at the planned batch."]
    lines += _handover_lines(profile, plan)
    return Findings(lines=tuple(lines), binding_ranks=binding, best_batch_range=rng, drop_ranks=drops,
                    upgrade_ranks=ups, loader_starved=tuple(starved), over_cap_ranks=over)


__all__ = ["BINDING_TOL", "Findings", "LoaderNeed", "fmt_rate", "fmt_s", "fmt_step", "kinds_text", "loader_needs",
           "make_findings", "rank_list"]
