"""Communication under heterogeneity: what a rank's step costs under DDP when its peers run late.

A synchronous DDP step is predicted as

    T(split) = max_i  f_i * t_i(b_i)  +  e

with t_i the rank's standalone curve, f_i >= 1 the rank's *wait factor* and e = comm.exposed_s, what DDP adds
to every step (the all-reduce tail after the last bucket, DDP's own per-step work), measured at an equal split
with the factors applied: e = T_DDP(equal) - max_i f_i t_i(b).  Why f_i: DDP launches a bucket's all-reduce as soon as
backward produces it.  When a peer produces its buckets later in the step (a slower device whose extra work comes
before its backward -- the emulated skew -- or a co-tenant), the early rank's NCCL kernels sit on its SMs, waiting,
while its own backward still runs; that backward slows down by the share of SMs they hold (~ channels / SMs:
32 CTAs of 132 SMs on an H100/H200: a +7-14% prediction error at F = 3 without the factor).  The effect is
proportional to the overlapped backward, which at a balanced split is a fixed share of the step, so a factor on
the rank's curve models it, and the program stays linear: f_i * t_i(b_i) <= T - e for every affine piece.

The profiler measures f_i directly (profiler.ddp): a few DDP steps at the split the plan will be near -- the
balanced split of ``balanced_split`` -- timing each rank from its step start to its last gradient bucket, over
its standalone compute at that batch.  ``wait_factors`` turns those times into factors; a rank whose factor is
within the measurement's noise of the least-waiting rank's gets that rank's, so a homogeneous job's split is
unchanged.  Recorded at F = 3 on 2 H200s (tests/data/h200x2_resnet50_bench_slowdown_3x_after_layout.json, plan row): rank 0
computed 88.2 ms under DDP against 81.7 ms alone (f = 1.08), the emulated rank 81.2 against 81.3 (f = 1).

Status: the factors the profiler measures at its small balanced split were wrong on 2 H100s (f = 1.14 on the
*slow* rank of an F = 3 pair; the plan then trailed the proportional split, docs/PERFORMANCE.md), so
profiler.comm_cost records them in the profile's meta and leaves ``comm.wait_factors`` empty: this model applies
to profiles that carry factors (measured at the plan's own split, or written by hand) and is the tested basis
for measuring them there.

Launch settings (``choose_launch_env``): the profile may time the same steps with another NCCL setting (fewer
CTAs); a setting is recorded only when it beats the default by more than the rounds' spread at the balanced split
and costs no more than that spread at the equal split.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from planner.curves import Envelope, fit_envelope
from planner.profile import Profile

MAX_WAIT_FACTOR = 2.0
"""A factor above this is a measurement gone wrong (a stall, a co-tenant burst), never a model: clipped."""


def balanced_split(curves: Sequence[Envelope], total: int, *, min_batch: int = 1,
                   caps: Sequence[int | None] | None = None) -> list[int]:
    """Integer batches summing to `total` that make the ranks' standalone times as equal as the curves allow.

    Bisection on the common time T: rank i takes the largest b with t_i(b) <= T (clamped to [min_batch, cap]);
    then the remainder goes, one sample at a time, to the rank whose time after taking it is the smallest.
    ``caps`` bound each rank (the largest batch the profile saw run, so the measurement cannot run out of memory).
    """
    n = len(curves)
    caps = list(caps) if caps is not None else [None] * n
    assert n >= 1 and total >= n * min_batch, (n, total, min_batch)

    def take(t: float) -> list[int]:
        out = []
        for c, cap in zip(curves, caps, strict=True):
            b = c.max_batch_within(t)
            b = min(b, float(cap if cap is not None else total))
            out.append(max(min_batch, int(min(b, total))))
        return out

    lo, hi = 0.0, max(c(total) for c in curves)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if sum(take(mid)) > total:
            hi = mid
        else:
            lo = mid
    b = take(lo)
    while sum(b) > total:  # min_batch clamps can overshoot: take back from the slowest rank that can give
        i = max((j for j in range(n) if b[j] > min_batch), key=lambda j: curves[j](b[j]))
        b[i] -= 1
    while sum(b) < total:
        room = [j for j in range(n) if (cap := caps[j]) is None or b[j] < cap] or list(range(n))
        i = min(room, key=lambda j: curves[j](b[j] + 1))
        b[i] += 1
    return b


def wait_factors(ddp_compute_s: Sequence[float], alone_compute_s: Sequence[float], *, noise: float) -> tuple[float, ...]:
    """f_i = rank i's compute under DDP (step start to last bucket) over its compute alone, both at the same batch,
    divided by the least such ratio.

    Every rank pays DDP's own work (hooks, bucket copies, its all-reduce kernels overlapping its backward): on a
    small or launch-bound model that is a constant of milliseconds per step, not a share of the compute, and the
    exposed term counts it (measured at the equal split with these factors applied).  What is left after the
    division is the waiting: a rank whose kernels wait for a later peer reads higher.  A factor within ``noise``
    (relative) of 1 is 1, so noise never moves a split; none is above MAX_WAIT_FACTOR.
    """
    assert len(ddp_compute_s) == len(alone_compute_s) and ddp_compute_s
    ratios = [d / a if a > 0 else 1.0 for d, a in zip(ddp_compute_s, alone_compute_s, strict=True)]
    base = min(ratios)
    factors = [r / base if base > 0 else 1.0 for r in ratios]
    return tuple(1.0 if f - 1.0 <= noise else round(min(f, MAX_WAIT_FACTOR), 4) for f in factors)


def span_factors(ddp_compute_s: Sequence[float], alone_compute_s: Sequence[float]) -> tuple[float, ...]:
    """By rank: the compute span under DDP over the standalone step less its optimizer step, both at the same batch,
    floored at 1 and not snapped (``CommProfile.span_factors``: what each rank's step timer will read)."""
    assert len(ddp_compute_s) == len(alone_compute_s) and ddp_compute_s
    return tuple(round(max(1.0, d / a), 4) if a > 0 else 1.0
                 for d, a in zip(ddp_compute_s, alone_compute_s, strict=True))


def applied_span_factors(profile: Profile, mode: str) -> tuple[float, ...] | None:
    """The span factors a plan predicts its ranks' step timers with (``CommProfile.span_factors``, floored at 1), by
    rank; None where the profile has none for its ranks, or outside DDP (they were measured under DDP)."""
    factors = profile.comm.span_factors if profile.comm is not None else None
    if mode != "ddp" or factors is None or len(factors) != profile.world_size:
        return None
    return tuple(max(1.0, float(f)) for f in factors)


def span_under_ddp_s(step_s: float, optimizer_s: float, factor: float) -> float:
    """The compute span a step timer reads under DDP (forward start to the last gradient bucket) for a standalone
    step of ``step_s``: the step less its optimizer step, times the rank's span factor."""
    return max(0.0, step_s - optimizer_s) * factor


def standalone_step_s(span_s: float, optimizer_s: float, factor: float) -> float:
    """The standalone step a span measured under DDP stands for (``span_under_ddp_s`` inverted)."""
    return span_s / factor + optimizer_s


def recorded_span_factors(profile: Profile) -> tuple[float, ...] | None:
    """The span factors of a profile written before ``CommProfile.span_factors`` existed, from the DDP rounds its
    meta keeps (``meta["ddp_cost[default]"]``, profiler.comm_cost); None where the meta has none.  For replaying
    recorded launches."""
    ddp = profile.meta.get("ddp_cost[default]") if isinstance(profile.meta, Mapping) else None
    if not isinstance(ddp, Mapping) or "balanced_compute_s" not in ddp or "balanced_batches" not in ddp:
        return None
    alone = [fit_envelope(r.compute)(ddp["balanced_batches"][r.rank]) - (r.optimizer_step_s or 0.0)
             for r in profile.by_rank]
    return span_factors(ddp["balanced_compute_s"], alone)


def recorded_span_tail_s(profile: Profile) -> float | None:
    """The span tail (``CommProfile.span_tail_s``) of a profile written before the field existed, from the balanced
    split's DDP rounds its meta keeps, as ``profiler.ddp.measure_ddp_cost`` computes it; None where the meta has
    none.  For replaying recorded launches."""
    ddp = profile.meta.get("ddp_cost[default]") if isinstance(profile.meta, Mapping) else None
    if not isinstance(ddp, Mapping) or "balanced_step_s" not in ddp or "balanced_compute_s" not in ddp:
        return None
    return span_tail_s(ddp["balanced_step_s"], ddp["balanced_compute_s"],
                       [r.optimizer_step_s or 0.0 for r in profile.by_rank])


def span_tail_s(step_rounds_s: Sequence[float], spans_s: Sequence[float], optimizer_s: Sequence[float]) -> float:
    """``CommProfile.span_tail_s`` from one split's DDP rounds: the median step less max_i (span_i + o_i), >= 0."""
    slowest = max(c + o for c, o in zip(spans_s, optimizer_s, strict=True))
    return max(0.0, statistics.median(step_rounds_s) - slowest)


def rank_factors(factors: Sequence[float] | None, world_size: int) -> tuple[float, ...]:
    """The factors the solver applies (1 per rank where the profile has none or they do not fit its ranks)."""
    if factors is None or len(factors) != world_size:
        return (1.0,) * world_size
    return tuple(max(1.0, float(f)) for f in factors)


def relative_spread(values: Sequence[float]) -> float:
    """(max - min) / median of a few rounds: the noise a difference must beat."""
    if len(values) < 2:
        return 0.0
    med = statistics.median(values)
    return (max(values) - min(values)) / med if med > 0 else 0.0


def choose_launch_env(default: tuple[Sequence[float], Sequence[float]],
                      variants: Mapping[str, tuple[Mapping[str, str], Sequence[float], Sequence[float]]]
                      ) -> tuple[str, Mapping[str, str]] | None:
    """The variant to record, or None (keep the default).

    ``default`` = (balanced-split step times, equal-split step times) of the rounds under the default setting;
    ``variants[name]`` = (env, balanced rounds, equal rounds).  A variant wins when its median balanced step is
    below the default's by more than both spreads together, and its median equal step is no more than that
    margin above the default's (it must not cost the homogeneous case).  Of the winners the fastest is taken.
    """
    d_bal, d_eq = default
    best: tuple[float, str, Mapping[str, str]] | None = None
    for name, (env, v_bal, v_eq) in variants.items():
        if not v_bal or not v_eq or not d_bal or not d_eq:
            continue
        margin = relative_spread(d_bal) + relative_spread(v_bal)
        gain = 1.0 - statistics.median(v_bal) / statistics.median(d_bal)
        eq_cost = statistics.median(v_eq) / statistics.median(d_eq) - 1.0
        eq_margin = max(margin, relative_spread(d_eq) + relative_spread(v_eq))
        if gain > margin and eq_cost <= eq_margin and (best is None or statistics.median(v_bal) < best[0]):
            best = (statistics.median(v_bal), name, env)
    return None if best is None else (best[1], best[2])




# -- hosts: which ranks share a machine's links ----------------------------------------------------------------
# A gradient all-reduce among the ranks of one host runs over its intra-host links (NVLink, PCIe, shared memory);
# one spanning hosts also crosses the network, every byte of it: a ring of W ranks laid out host by host sends
# 2 (W - 1) / W of the gradient over every link, the host-crossing ones included, so the slowest link -- the
# network, as a rule -- sets its pace.  The profiler times the all-reduce over the whole job and, when the job spans
# hosts, within each host alone (profile ``meta["allreduce_by_host_s"]``); the difference is what spanning hosts
# costs.  The plan records both (``plan.meta["allreduce"]``) beside the host groups its ranks form.


def host_groups(hosts_by_rank: Sequence[str]) -> list[tuple[str, list[int]]]:
    """(host, its ranks) in the order of each host's first rank: the groups whose all-reduce stays on one host."""
    groups: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts_by_rank):
        groups.setdefault(host, []).append(rank)
    return list(groups.items())


def ring_allreduce_s(grad_bytes: float, ranks_per_host: Sequence[int], intra_bytes_per_s: float,
                     inter_bytes_per_s: float) -> float:
    """Bandwidth time of a ring all-reduce of ``grad_bytes`` over ranks laid out host by host: each of the W links
    carries 2 (W - 1) / W of the gradient, so the slowest link in the ring sets the time -- an inter-host one as
    soon as the ring spans two hosts, an intra-host one otherwise (0 on one rank)."""
    world = sum(ranks_per_host)
    if world <= 1:
        return 0.0
    spans = sum(1 for n in ranks_per_host if n > 0) > 1
    slowest = min(intra_bytes_per_s, inter_bytes_per_s) if spans else intra_bytes_per_s
    return 2.0 * (world - 1) / world * grad_bytes / slowest


def allreduce_links(profile: Profile) -> dict[str, object] | None:
    """What the plan shows of its all-reduce's links (``plan.meta["allreduce"]``): the host groups, whether the
    all-reduce spans hosts and, where the profile timed them, the all-reduce over the whole job, within each host
    alone, and the difference (what crossing hosts adds: the slowest host's own all-reduce is paid anyway).
    None for a job on one host (nothing to tell apart)."""
    groups = host_groups([r.host for r in profile.by_rank])
    if len(groups) < 2:
        return None
    out: dict[str, object] = {"host_groups": [{"host": h, "ranks": ranks} for h, ranks in groups],
                              "spans_hosts": True}
    world_s = profile.comm.allreduce_s if profile.comm is not None else None
    if world_s is not None:
        out["allreduce_s"] = world_s
    by_host = profile.meta.get("allreduce_by_host_s") if isinstance(profile.meta, Mapping) else None
    if isinstance(by_host, Mapping) and by_host:
        intra = {str(h): float(t) for h, t in by_host.items() if isinstance(t, (int, float))}
        out["intra_host_allreduce_s"] = intra
        if world_s is not None and intra:
            out["inter_host_s"] = max(0.0, world_s - max(intra.values()))
    return out


def links_line(links: Mapping[str, object] | None) -> str | None:
    """One line for the plan table: the host groups and what the all-reduce pays for spanning them."""
    if not links:
        return None
    groups = links.get("host_groups")
    if not isinstance(groups, list):
        return None
    shown = ", ".join(f"{g['host']} [{_ranks(g['ranks'])}]" for g in groups if isinstance(g, Mapping))
    line = f"all-reduce spans {len(groups)} hosts: {shown}"
    world_s, inter_s = links.get("allreduce_s"), links.get("inter_host_s")
    if isinstance(world_s, (int, float)) and isinstance(inter_s, (int, float)):
        line += (f"; {1000 * world_s:.2f} ms over the job, {1000 * inter_s:.2f} ms of it for crossing hosts "
                 "(the rest within the slowest host)")
    return line


def _ranks(ranks: object) -> str:
    if not isinstance(ranks, list) or not ranks:
        return ""
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def links_meta(profile: Profile) -> dict[str, object]:
    """``{"allreduce": allreduce_links(profile)}`` for a plan's meta when its ranks span hosts, else {}."""
    links = allreduce_links(profile)
    return {} if links is None else {"allreduce": links}
