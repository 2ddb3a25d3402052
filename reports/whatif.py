"""What-if numbers, all by re-running ``planner.solve``: global batch sweeps, dropping, adding or upgrading a rank,
and scaling over the first k ranks.

Every number here is a ``Plan.predicted`` from the same solver the user plans with, so the report never
disagrees with ``planner plan``.  A scenario the program cannot satisfy (memory caps below the global batch...)
is reported as infeasible with the solver's one-line reason rather than dropped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from planner.errors import PlanError
from planner.profile import HostProfile, Profile, RankProfile
from planner.solve import SolveOptions, build_models, solve

WhatIfKind = Literal["drop", "add", "upgrade"]

FULL_DETAIL_RANKS = 32
"""Up to this many ranks every rank gets its own drop/upgrade what-if and every k its scaling point; above it one
representative rank per (device kind, bottleneck), at most MAX_ADD_KINDS of each kind of what-if, about 12
cluster sizes and the powers of two of the global batch sweep: a
200-rank report re-solved 200-rank programs ~600 times (87 s) for tables nobody reads row by row."""
MAX_ADD_KINDS = 6
"""Past FULL_DETAIL_RANKS: at most this many additions, and drop/upgrade representatives."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SweepPoint:
    global_batch: int
    feasible: bool
    samples_per_s: float = 0.0
    step_time_s: float = 0.0
    equal_split_samples_per_s: float = 0.0
    epoch_time_s: float = 0.0
    """ceil(dataset_size / global_batch) steps of step_time_s (the last, partial step is counted as full)."""
    batch_sizes: tuple[int, ...] = ()
    note: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class WhatIf:
    kind: WhatIfKind
    label: str
    """Plain words: "drop rank 1 (cuda:1)", "add a cuda like rank 0 on node0", "upgrade rank 1 to rank 0's device"."""
    subject_rank: int
    world_size: int
    global_batch: int
    feasible: bool
    samples_per_s: float = 0.0
    delta_samples_per_s: float = 0.0
    """Change against the re-solved plan for the current cluster at the same global batch."""
    delta_frac: float = 0.0
    batch_sizes: tuple[int, ...] = ()
    note: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class ScalePoint:
    num_ranks: int
    """The first num_ranks ranks (0..num_ranks-1) of the profile."""
    global_batch: int
    """The report's global batch, or the largest feasible one when the first ranks' caps cannot hold it."""
    feasible: bool
    samples_per_s: float = 0.0
    equal_split_samples_per_s: float = 0.0
    speedup: float = 0.0
    """samples_per_s over the one-rank value."""
    note: str = ""


def epoch_time_s(step_time_s: float, global_batch: int, dataset_size: int) -> float:
    return math.ceil(dataset_size / global_batch) * step_time_s


def with_ranks(profile: Profile, ranks: Sequence[RankProfile]) -> Profile:
    """A profile of these ranks renumbered 0..k-1 in the given order (hosts, model and comm kept)."""
    renumbered = tuple(replace(r, rank=i) for i, r in enumerate(ranks))
    return Profile(hosts=profile.hosts, ranks=renumbered, model=profile.model, comm=profile.comm, meta=profile.meta)


def rank_label(r: RankProfile) -> str:
    return r.device_name or r.device


def device_kinds(profile: Profile) -> list[tuple[str, RankProfile]]:
    """One representative rank per device kind, in rank order.

    The kind is the device name when the profiler recorded one (identical cards measure slightly differently and
    still are one kind); without a name, ranks with identical compute measurements form one kind and the label
    says which rank it copies (a bare "cuda" would lump an A100 with a T4).
    """
    seen: dict[object, tuple[str, RankProfile]] = {}
    for r in profile.by_rank:
        dtype = r.device.split(":")[0]
        key: object = ("name", r.device_name) if r.device_name else ("curve", dtype, r.compute)
        if key not in seen:
            seen[key] = (r.device_name or f"{dtype} like rank {r.rank}", r)
    return list(seen.values())


# -- global batch sweep --------------------------------------------------------------------------------------
def sweep_batches(profile: Profile, opts: SolveOptions, *, include: Sequence[int] = ()) -> list[int]:
    """Powers of two and (up to FULL_DETAIL_RANKS ranks) W * powers of two from W * min_batch up to the sum of the
    caps.

    A rank without a memory cap counts 2x its largest measured batch: beyond that the curve is extrapolation.
    """
    W = profile.world_size
    models = build_models(profile, opts)
    limit = 0
    for m, r in zip(models, profile.by_rank, strict=True):
        reach = 2 * max(p.batch_size for p in r.compute)
        limit += reach if m.cap is None else min(m.cap, reach)
    lo = W * opts.min_batch
    out = {lo, limit}
    k = 1
    while k <= limit:
        # Past FULL_DETAIL_RANKS the W * 2^k points are left out: they double the solves of large programs and
        # the powers of two already trace the curve.
        for b in (k, W * k) if W <= FULL_DETAIL_RANKS else (k,):
            if lo <= b <= limit:
                out.add(b)
        k *= 2
    out.update(b for b in include if b >= lo)
    return sorted(out)


def sweep(
    profile: Profile, batches: Sequence[int], opts: SolveOptions, *, dataset_size: int
) -> tuple[SweepPoint, ...]:
    out = []
    for B in batches:
        try:
            plan = solve(profile, global_batch=B, options=opts)
        except PlanError as e:
            out.append(SweepPoint(global_batch=B, feasible=False, note=str(e)))
            continue
        p = plan.predicted
        out.append(
            SweepPoint(
                global_batch=B,
                feasible=True,
                samples_per_s=p.samples_per_s,
                step_time_s=p.step_time_s,
                equal_split_samples_per_s=p.equal_split_samples_per_s,
                epoch_time_s=epoch_time_s(p.step_time_s, B, dataset_size),
                batch_sizes=plan.batch_sizes,
            )
        )
    return tuple(out)


def best_range(points: Sequence[SweepPoint], *, within: float = 0.05) -> tuple[int, int] | None:
    """Smallest and largest global batch whose throughput is within `within` of the sweep's best."""
    ok = [p for p in points if p.feasible]
    if not ok:
        return None
    best = max(p.samples_per_s for p in ok)
    near = [p.global_batch for p in ok if p.samples_per_s >= (1 - within) * best]
    return min(near), max(near)


# -- what-if -------------------------------------------------------------------------------------------------
def _scenario(
    kind: WhatIfKind, label: str, subject: int, profile: Profile, B: int, base: float, opts: SolveOptions
) -> WhatIf:
    common = dict(kind=kind, label=label, subject_rank=subject, world_size=profile.world_size, global_batch=B)
    try:
        plan = solve(profile, global_batch=B, options=opts)
    except PlanError as e:
        return WhatIf(**common, feasible=False, note=str(e))  # type: ignore[arg-type]
    x = plan.predicted.samples_per_s
    return WhatIf(
        **common,  # type: ignore[arg-type]
        feasible=True,
        samples_per_s=x,
        delta_samples_per_s=x - base,
        delta_frac=(x - base) / base if base > 0 else 0.0,
        batch_sizes=plan.batch_sizes,
    )


def what_if_drop(profile: Profile, global_batch: int, base_samples_per_s: float, opts: SolveOptions,
                 subjects: Sequence[int] | None = None, like: dict[int, int] | None = None) -> list[WhatIf]:
    """Re-solve without each rank in turn (or each of `subjects`), same global batch (nothing when only one rank is
    left to drop).  ``like[r]``: how many ranks rank r stands for (said in the label)."""
    ranks = profile.by_rank
    if len(ranks) < 2:
        return []
    out = []
    for r in ranks if subjects is None else [profile.rank(i) for i in subjects]:
        rest = [q for q in ranks if q.rank != r.rank]
        out.append(
            _scenario("drop", f"drop rank {r.rank} ({rank_label(r)}{_like(r.rank, like)})", r.rank,
                      with_ranks(profile, rest), global_batch, base_samples_per_s, opts)
        )
    return out


def _like(rank: int, like: dict[int, int] | None) -> str:
    n = (like or {}).get(rank, 1)
    return f"; the slowest of {n} such" if n > 1 else ""


def representatives(profile: Profile, bottlenecks: Sequence[str], limit: int = MAX_ADD_KINDS) -> dict[int, int]:
    """One rank per (device kind, bottleneck at the plan): the one with the lowest peak throughput (dropping or
    upgrading the weakest of a kind is the what-if that matters) -> how many ranks its group holds; at most
    `limit` groups, the weakest first."""
    groups: dict[tuple[str, str], list[RankProfile]] = {}
    for r, b in zip(profile.by_rank, bottlenecks, strict=True):
        groups.setdefault((rank_label(r), b), []).append(r)
    weakest = sorted(((min(g, key=peak_samples_per_s), len(g)) for g in groups.values()),
                     key=lambda rn: peak_samples_per_s(rn[0]))
    return {r.rank: n for r, n in weakest[:limit]}


def scaling_sizes(world_size: int) -> list[int]:
    """Cluster sizes for the scaling table: every k up to FULL_DETAIL_RANKS, else about 12 sizes spread
    geometrically from 1 to W (W always included)."""
    if world_size <= FULL_DETAIL_RANKS:
        return list(range(1, world_size + 1))
    ratio = world_size ** (1 / 11)
    sizes = {1, world_size}
    x = 1.0
    while x < world_size:
        x *= ratio
        sizes.add(min(world_size, max(1, round(x))))
    return sorted(sizes)


def what_if_add(profile: Profile, global_batch: int, base_samples_per_s: float, opts: SolveOptions,
                max_kinds: int | None = None) -> list[WhatIf]:
    """Add one more rank of each device kind: a copy of its first rank, on the same host (sharing its cores).

    ``max_kinds``: past that many kinds (unnamed ranks whose curves all differ are a kind each), only that many,
    spread evenly over peak throughput from the fastest down.

    A CPU rank computes on its host's cores: where they are already all in use by the host's CPU ranks (a
    2-core host running two), a third one on the same host would only split the same cores three ways, so the
    copy goes on a new host like it instead, and the label says so.
    """
    ranks = list(profile.by_rank)
    kinds = device_kinds(profile)
    if max_kinds is not None and len(kinds) > max_kinds:
        by_speed = sorted(kinds, key=lambda kr: -peak_samples_per_s(kr[1]))
        step = (len(by_speed) - 1) / max(1, max_kinds - 1)
        kinds = [by_speed[round(i * step)] for i in range(max_kinds)]
    out = []
    for kind, r in kinds:
        hosts = profile.hosts
        label = f"add a {kind} on {r.host}"
        if r.device.split(":")[0] == "cpu":
            host = profile.host(r.host)
            on_host = sum(1 for q in ranks if q.host == r.host and q.device.split(":")[0] == "cpu")
            threads = r.meta.get("torch_threads")
            need = int(threads) if isinstance(threads, int) and threads > 0 else max(1, host.cpu_cores // on_host)
            if host.cpu_cores < (on_host + 1) * need:
                new = HostProfile(name=f"another {r.host}", cpu_cores=host.cpu_cores, memory_bytes=host.memory_bytes)
                hosts = (*hosts, new)
                label = (f"add a {kind} on another host like {r.host} ({r.host}'s {host.cpu_cores} cores already run "
                         f"{on_host} CPU rank(s))")
                r = replace(r, host=new.name)
        grown = with_ranks(replace(profile, hosts=hosts), [*ranks, r])
        out.append(_scenario("add", label, r.rank, grown, global_batch, base_samples_per_s, opts))
    return out


def peak_samples_per_s(r: RankProfile) -> float:
    """Best measured standalone throughput of a rank: max over its measured points of batch / step time."""
    return max(p.batch_size / p.step_time_s for p in r.compute)


def what_if_upgrade(profile: Profile, global_batch: int, base_samples_per_s: float, opts: SolveOptions,
                    subjects: Sequence[int] | None = None, like: dict[int, int] | None = None) -> list[WhatIf]:
    """Give each rank (or each of `subjects`) slower than the fastest kind that kind's device (its compute and
    memory), keeping its host and loader (data loading runs on the host's CPUs, not on the device)."""
    kinds = device_kinds(profile)
    if len(kinds) < 2:
        return []
    fast_kind, fast = max(kinds, key=lambda kr: peak_samples_per_s(kr[1]))
    out = []
    for r in profile.by_rank if subjects is None else [profile.rank(i) for i in subjects]:
        if peak_samples_per_s(r) >= peak_samples_per_s(fast) or r.compute == fast.compute:
            continue
        swapped = replace(r, compute=fast.compute, memory=fast.memory, device_name=fast.device_name, device=r.device)
        ranks = [swapped if q.rank == r.rank else q for q in profile.by_rank]
        out.append(
            _scenario("upgrade", f"upgrade rank {r.rank} ({rank_label(r)}{_like(r.rank, like)}) to a {fast_kind}",
                      r.rank, with_ranks(profile, ranks), global_batch, base_samples_per_s, opts)
        )
    return out


# -- scaling -------------------------------------------------------------------------------------------------
def scaling(profile: Profile, global_batch: int, opts: SolveOptions) -> tuple[ScalePoint, ...]:
    """Solve on the first k ranks for k in ``scaling_sizes(W)`` at the same global batch, or the largest feasible
    one."""
    out: list[ScalePoint] = []
    one = 0.0
    ranks = profile.by_rank
    for k in scaling_sizes(len(ranks)):
        sub = with_ranks(profile, ranks[:k])
        caps = [m.cap for m in build_models(sub, opts)]
        B, note = global_batch, ""
        if all(c is not None for c in caps):
            room = sum(c for c in caps if c is not None)
            if room < B:
                B, note = room, f"caps hold at most {room} samples; global batch lowered from {global_batch}"
        try:
            plan = solve(sub, global_batch=B, options=opts)
        except PlanError as e:
            out.append(ScalePoint(num_ranks=k, global_batch=B, feasible=False, note=str(e)))
            continue
        x = plan.predicted.samples_per_s
        if k == 1:
            one = x
        out.append(
            ScalePoint(
                num_ranks=k,
                global_batch=B,
                feasible=True,
                samples_per_s=x,
                equal_split_samples_per_s=plan.predicted.equal_split_samples_per_s,
                speedup=x / one if one > 0 else 0.0,
                note=note,
            )
        )
    return tuple(out)
