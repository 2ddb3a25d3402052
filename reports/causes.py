"""Why a rank is slow: one finding per slow rank, naming the measured cause with its numbers.

From the profile: ranks with the same device name are meant to be identical, so a rank whose best measured
throughput is more than ``SLOW_TOL`` (15%) below the fastest of its kind -- its twin -- gets a finding.  Its
``device_state`` is compared with the twin's (planner.evidence); facts the twin lacks are the cause, e.g.

    rank 3 (NVIDIA H100 80GB HBM3) measured 548 samples/s, 71% below its twin rank 0 (1,891): 2 other processes
    on the GPU holding 12.1 GiB (pid 4242 python 8.0 GiB; ...); no throttling; SM clock at max 1980 of 1980 MHz.
    Without its co-tenant (rank 0's curve): 6,950 samples/s (+18%).

and when nothing differs, "cause not visible to NVML/psutil" -- never a guess.  The what-if re-solves the plan's
global batch with the slow rank given its twin's curve (and memory).

From the run log: a rank whose measured compute, relative to its profiled curve at the batch it ran, rose more
than SLOW_TOL above its best earlier epoch slowed down mid-run; its epoch-end device state is compared with the
state of that earlier epoch, and the re-plan that absorbed it (if one was adopted) is named.  A rank whose
compute over its curve, in the log's steady epoch, is more than SLOW_TOL above the rank nearest its curve is slow
against its peers, whatever the profile measured; when its epoch-end state shows nothing the other's lacks, the
cause is named as what it is, "cause not visible to NVML/psutil: inside the training step".
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

from planner.curves import fit_envelope
from planner.devstate import DeviceState
from planner.errors import PlanError
from planner.evidence import INSIDE_STEP, NOT_VISIBLE, Evidence, checked, compare, cores_text
from planner.profile import Profile, RankProfile
from planner.runlog import RunLog
from planner.solve import SolveOptions, solve
from reports.as_measured import curve_ratios, reference_rank
from reports.whatif import peak_samples_per_s, rank_label

SLOW_TOL = 0.15
"""A rank more than 15% below its twin (or its own earlier epochs) is slow: above the sweep's noise on a busy
host, below the 2x gaps co-tenants and throttling make."""

_WHAT_IF_NAMES = {"co-tenant": "its co-tenant", "cpu-load": "the other CPU load", "throttle": "throttling",
                  "emulated": "the emulated slowdown", "cpu-overlap": "the shared cores"}


@dataclass(frozen=True, kw_only=True, slots=True)
class TwinWhatIf:
    label: str
    """"rank 3 without its co-tenant (rank 0's curve)"."""
    samples_per_s: float
    delta_frac: float
    """Against the re-solved current cluster at the same global batch."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SlowRank:
    rank: int
    source: Literal["profile", "run log"]
    label: str
    reference: str
    """What it is compared with: "rank 0" (its twin) or "epoch 1" (itself, earlier)."""
    slower_frac: float
    """1 - its speed / the reference's (0.56 = 56% slower)."""
    samples_per_s: float | None = None
    reference_samples_per_s: float | None = None
    epoch: int | None = None
    """Run log: the first epoch that measured slow."""
    evidence: tuple[Evidence, ...] = ()
    checked: tuple[str, ...] = ()
    visible: bool = False
    """Some evidence explains the gap."""
    unexplained: str = NOT_VISIBLE
    """What is said when no evidence explains the gap: ``NOT_VISIBLE``, or ``INSIDE_STEP`` for a rank whose own
    compute the run log measured slow against its peers."""
    what_if: TwinWhatIf | None = None
    text: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class Causes:
    slow_ranks: tuple[SlowRank, ...]
    states: tuple[DeviceState | None, ...]
    """Every rank's profiled device state, in rank order (the report's evidence table)."""

    @property
    def lines(self) -> tuple[str, ...]:
        """One line per slow rank; past ``MAX_PEER_LINES`` ranks slow against their peers in the run log, the rest in
        one line (the findings stay short at any cluster size; the HTML lists every one)."""
        from reports.findings import rank_list

        peers = [s for s in self.slow_ranks if _against_peer(s)]
        rest = peers[MAX_PEER_LINES:]
        summed = {id(s) for s in rest}
        out = [s.text for s in self.slow_ranks if id(s) not in summed]
        if rest:
            worst = max(rest, key=lambda s: s.slower_frac)
            out.append(f"{len(rest)} more ranks ran slow against their profiled curves in the run log ("
                       f"{rank_list([s.rank for s in rest])}; the worst, rank {worst.rank}, "
                       f"{1 / (1 - worst.slower_frac):.2f}x): the HTML report lists each with its state.")
        return tuple(out)


MAX_PEER_LINES = 3
"""Ranks slow against their peers in the run log (``log_slow_ranks``) that get a finding line each, the slowest
first; the others share one."""


def _against_peer(s: SlowRank) -> bool:
    return s.source == "run log" and s.reference.startswith("rank")


def _state_text(ev: list[Evidence], chk: list[str], state: DeviceState | None, where: str) -> tuple[str, bool]:
    causes = [e.text for e in ev if e.explains]
    context = [e.text for e in ev if not e.explains]
    if state is None or state.is_empty:
        return f"{NOT_VISIBLE} (no device state was recorded {where})", False
    if causes:
        return "; ".join(causes + context + chk), True
    return f"{NOT_VISIBLE} (" + "; ".join(context + chk or ["nothing measured differs"]) + ")", False


def _emulated(r: RankProfile) -> float:
    f = r.meta.get("emulate_slowdown", 1.0)
    return float(f) if isinstance(f, (int, float)) else 1.0


def _overlaps(profile: Profile, r: RankProfile) -> list[tuple[int, tuple[int, ...]]]:
    """(other rank, shared cores) for ranks on r's host whose CPU affinity overlaps r's."""
    mine = set(r.device_state.cpu_affinity or ()) if r.device_state else set()
    out = []
    for q in profile.by_rank:
        if q.rank == r.rank or q.host != r.host or q.device_state is None or not mine:
            continue
        common = mine & set(q.device_state.cpu_affinity or ())
        if common:
            out.append((q.rank, tuple(sorted(common))))
    return out


def _what_if(profile: Profile, r: RankProfile, twin: RankProfile, ev: list[Evidence], *, global_batch: int,
             base_samples_per_s: float, opts: SolveOptions) -> TwinWhatIf | None:
    """The plan's global batch re-solved with r on its twin's curve and memory."""
    # Its host and loader stay: a co-tenant or a throttled clock changes the device's curve, not the data path.
    swapped = tuple(replace(q, compute=twin.compute, memory=twin.memory) if q.rank == r.rank else q
                    for q in profile.ranks)
    try:
        x = solve(replace(profile, ranks=swapped), global_batch=global_batch, options=opts).predicted.samples_per_s
    except PlanError:
        return None
    kinds = [e.kind for e in ev if e.explains]
    what = next((_WHAT_IF_NAMES[k] for k in kinds if k in _WHAT_IF_NAMES), None)
    label = f"rank {r.rank} without {what}" if what else f"rank {r.rank} at its twin's speed"
    delta = (x - base_samples_per_s) / base_samples_per_s if base_samples_per_s > 0 else 0.0
    return TwinWhatIf(label=f"{label} (rank {twin.rank}'s curve)", samples_per_s=x, delta_frac=delta)


def profile_slow_ranks(profile: Profile, *, global_batch: int, base_samples_per_s: float,
                       opts: SolveOptions) -> list[SlowRank]:
    """One finding per rank > SLOW_TOL below the fastest rank of the same device name (see the module docstring)."""
    groups: dict[str, list[RankProfile]] = {}
    for r in profile.by_rank:
        if r.device_name:  # without a name nothing says two ranks are meant to be the same
            groups.setdefault(r.device_name, []).append(r)
    out = []
    for ranks in groups.values():
        twin = max(ranks, key=peak_samples_per_s)
        top = peak_samples_per_s(twin)
        for r in ranks:
            x = peak_samples_per_s(r)
            if x >= (1 - SLOW_TOL) * top:
                continue
            s, t = r.device_state, twin.device_state
            ev = compare(s, t, ref_name=f"rank {twin.rank}", is_cpu=r.device.startswith("cpu"),
                         emulated=_emulated(r), ref_emulated=_emulated(twin), shared_cores=_overlaps(profile, r),
                         ref_shared=len(_overlaps(profile, twin))) if s is not None else []
            chk = checked(s, {e.kind for e in ev}) if s is not None else []
            body, visible = _state_text(ev, chk, s, "for it in the profile")
            if s is None and _emulated(r) > _emulated(twin) * 1.05:  # the profile's meta still says why
                body, visible = f"an emulated slowdown of {_emulated(r):g}x (--emulate-slowdown)", True
            wi = _what_if(profile, r, twin, ev, global_batch=global_batch, base_samples_per_s=base_samples_per_s,
                          opts=opts)
            tail = f" What-if {wi.label}: {wi.samples_per_s:,.0f} samples/s ({100 * wi.delta_frac:+.0f}%)." if wi else ""
            text = (f"Rank {r.rank} ({rank_label(r)}) measured {x:,.0f} samples/s, {100 * (1 - x / top):.0f}% below "
                    f"its twin rank {twin.rank} ({top:,.0f}): {body}.{tail}")
            out.append(SlowRank(rank=r.rank, source="profile", label=rank_label(r), reference=f"rank {twin.rank}",
                                slower_frac=1 - x / top, samples_per_s=x, reference_samples_per_s=top,
                                evidence=tuple(ev), checked=tuple(chk), visible=visible, what_if=wi, text=text))
    return out


class _EpochPoint(NamedTuple):
    epoch: int
    ratio: float
    """Measured compute per step over the profiled curve at the batch it ran (re-plans change the batch, not
    this ratio; a slowdown raises it)."""
    batch_size: int
    compute_s: float
    record: int
    """Position of the epoch record in the log."""


def log_slowdowns(profile: Profile, log: RunLog) -> list[SlowRank]:
    """Ranks whose compute rose > SLOW_TOL above their best earlier epoch, relative to the profiled curve."""
    curves = {r.rank: fit_envelope(r.compute) for r in profile.by_rank}
    series: dict[int, list[_EpochPoint]] = {}
    for k, e in enumerate(log.epochs):
        for st in e.ranks:
            if st.rank in curves and st.num_steps > 0 and st.compute_s > 0 and st.batch_size > 0:
                series.setdefault(st.rank, []).append(_EpochPoint(
                    epoch=e.epoch, ratio=st.compute_s / curves[st.rank](st.batch_size), batch_size=st.batch_size,
                    compute_s=st.compute_s, record=k))
    out = []
    for rank, points in sorted(series.items()):
        best = points[0]  # the best earlier epoch so far (a running minimum: linear in the log's length)
        for point in points[1:]:
            # The best earlier epoch, not the first: epoch 0 often carries warm-up (allocator, autotuning).
            if point.ratio > (1 + SLOW_TOL) * best.ratio:
                out.append(_log_finding(profile, log, rank, best, point))
                break  # the first slow epoch of each rank
            if point.ratio < best.ratio:
                best = point
    return out


def _state_at(log: RunLog, k: int, rank: int) -> DeviceState | None:
    states = log.epochs[k].device_state
    return states[rank] if rank < len(states) else None


def _log_finding(profile: Profile, log: RunLog, rank: int, best: _EpochPoint, slow: _EpochPoint) -> SlowRank:
    epoch, ratio, batch, comp = slow.epoch, slow.ratio, slow.batch_size, slow.compute_s
    factor = ratio / best.ratio
    s, ref = _state_at(log, slow.record, rank), _state_at(log, best.record, rank)
    r = profile.rank(rank)
    ev = compare(s, ref, ref_name=f"epoch {best.epoch}", is_cpu=r.device.startswith("cpu")) if s is not None else []
    chk = checked(s, {e.kind for e in ev}) if s is not None else []
    body, visible = _state_text(ev, chk, s, "in the run log")
    absorbed = next((p for p in log.replans if p.epoch >= epoch and p.adopted and not p.reverted
                     and rank < len(p.old_batch_sizes) and rank < len(p.new_batch_sizes)), None)
    moved = (f"; the re-planner moved its batch {absorbed.old_batch_sizes[rank]} -> "
             f"{absorbed.new_batch_sizes[rank]} after epoch {absorbed.epoch}") if absorbed else \
        "; no re-plan absorbed it"
    text = (f"Rank {rank} ({rank_label(r)}) slowed {factor:.2f}x in epoch {epoch} against epoch {best.epoch} "
            f"(compute {1000 * comp:.2f} ms at batch {batch}, {ratio:.2f}x its profiled curve vs {best.ratio:.2f}x)"
            f"{moved}: {body}.")
    return SlowRank(rank=rank, source="run log", label=rank_label(r), reference=f"epoch {best.epoch}",
                    slower_frac=1 - 1 / factor, epoch=epoch, evidence=tuple(ev), checked=tuple(chk), visible=visible,
                    text=text)


def log_slow_ranks(profile: Profile, log: RunLog, *, skip: Collection[int] = ()) -> list[SlowRank]:
    """Ranks whose compute in the run log's steady epoch (``RunLog.steady_epoch``), over their profiled curve at
    the batch they ran (reports.as_measured.curve_ratios), is more than ``SLOW_TOL`` above the rank nearest its
    curve: slow in the run whatever the profile measured (a per-sample cost inside the user's loop that the
    profiler's step does not run), with the epoch's device states compared; ``skip``: ranks already named."""
    e = log.steady_epoch()
    if e is None or e.drained:
        return []
    ratios = curve_ratios(profile, e)
    ref = reference_rank(ratios)
    if ref is None or len(ratios) < 2:
        return []
    stats = {st.rank: st for st in e.ranks}
    k = log.epochs.index(e)
    out = []
    for rank, ratio in sorted(ratios.items()):
        factor = ratio / ratios[ref]
        if rank == ref or rank in skip or factor <= 1 + SLOW_TOL:
            continue
        r, q = profile.rank(rank), profile.rank(ref)
        st, st_ref = stats[rank], stats[ref]
        twin = bool(r.device_name) and r.device_name == q.device_name
        s, s_ref = _state_at(log, k, rank), _state_at(log, k, ref)
        ev = compare(s, s_ref, ref_name=f"rank {ref}", is_cpu=r.device.startswith("cpu")) if s is not None else []
        chk = checked(s, {x.kind for x in ev}) if s is not None else []
        causes = [x.text for x in ev if x.explains]
        context = [x.text for x in ev if not x.explains] + chk
        if causes:
            body, visible = "; ".join(causes + context), True
        else:
            seen = "; ".join(context) if context else "no device state was recorded in the run log"
            body, visible = (f"{INSIDE_STEP} ({seen}) -- the work its step does on this rank that the profile's "
                             "did not: a per-sample cost in the loop, another model or input size"), False
        mine, theirs = st.batch_size / st.compute_s, st_ref.batch_size / st_ref.compute_s
        speed = (f" ({mine:,.0f} samples/s against {theirs:,.0f} on rank {ref}, the same {r.device_name})"
                 if twin else "")
        absorbed = next((p for p in log.replans if p.adopted and not p.reverted and p.epoch < e.epoch
                         and rank < len(p.new_batch_sizes)), None)
        remedy = (f"; the re-planner moved its batch {absorbed.old_batch_sizes[rank]} -> "
                  f"{absorbed.new_batch_sizes[rank]} after epoch {absorbed.epoch}" if absorbed else
                  f"; `planner train --replan` (or replan=True) measures it and moves work off rank {rank}")
        text = (f"Rank {rank} ({rank_label(r)}) is slow in the run log: its compute in epoch {e.epoch}, "
                f"{1000 * st.compute_s:.1f} ms a step at batch {st.batch_size}, is {ratio:.2f}x its profiled curve "
                f"where rank {ref}'s is {ratios[ref]:.2f}x ({1000 * st_ref.compute_s:.1f} ms at batch "
                f"{st_ref.batch_size}): {factor:.2f}x slower than the profile says{speed}: {body}{remedy}.")
        out.append(SlowRank(rank=rank, source="run log", label=rank_label(r), reference=f"rank {ref}",
                            slower_frac=1 - 1 / factor, samples_per_s=mine, reference_samples_per_s=theirs,
                            epoch=e.epoch, evidence=tuple(ev), checked=tuple(chk), visible=visible,
                            unexplained=INSIDE_STEP, text=text))
    return sorted(out, key=lambda s: -s.slower_frac)


def find_causes(profile: Profile, *, global_batch: int, base_samples_per_s: float, opts: SolveOptions,
                log: RunLog | None = None) -> Causes:
    """Every slow-rank finding of the profile and, when given, of the run log: ranks that slowed against their own
    earlier epochs, then ranks slow against their peers (``log_slow_ranks``) not already named."""
    found = profile_slow_ranks(profile, global_batch=global_batch, base_samples_per_s=base_samples_per_s, opts=opts)
    if log is not None:
        slowed = log_slowdowns(profile, log)
        found += slowed + log_slow_ranks(profile, log, skip={s.rank for s in slowed})
    return Causes(slow_ranks=tuple(found), states=tuple(r.device_state for r in profile.by_rank))


def _cell(s: DeviceState, column: str) -> str | None:
    """One evidence-table cell; None when the state lacks the field."""
    if column == "other GPU procs":
        if s.other_processes is None:
            return None
        mem = s.other_gpu_bytes
        return str(len(s.other_processes)) + (f" ({mem / 2**30:.1f} GiB)" if mem is not None else "")
    if column == "SM MHz":
        return None if s.sm_clock_mhz is None else f"{s.sm_clock_mhz}/{s.sm_clock_max_mhz or '?'}"
    if column == "throttle":
        reasons = s.slowing_throttle_reasons
        return None if reasons is None else (", ".join(reasons) or "none")
    if column == "power W":
        return None if s.power_w is None else f"{s.power_w:.0f}/{s.power_limit_w or 0:.0f}"
    if column == "temp C":
        return None if s.temperature_c is None else f"{s.temperature_c:.0f}"
    if column == "PCIe":
        return None if s.pcie_gen is None else f"gen{s.pcie_gen} x{s.pcie_width}/gen{s.pcie_gen_max} x{s.pcie_width_max}"
    if column == "NUMA gpu/cpu":
        if s.gpu_numa_node is None or s.numa_nodes is None:
            return None
        return f"{s.gpu_numa_node}/{','.join(map(str, s.numa_nodes))}"
    if column == "cores":
        return None if s.cpu_affinity is None else cores_text(s.cpu_affinity)
    if column == "others' CPU":
        return None if s.cpu_other_cores is None else f"{s.cpu_other_cores:.2f}"
    if column == "steal":
        return None if s.cpu_steal_cores is None else f"{s.cpu_steal_cores:.2f}"
    if column == "load":
        return None if s.load_avg_1m is None else f"{s.load_avg_1m:.1f}/{s.host_cpus or '?'}"
    raise KeyError(column)


STATE_COLUMNS = ("other GPU procs", "SM MHz", "throttle", "power W", "temp C", "PCIe", "NUMA gpu/cpu", "cores",
                 "others' CPU", "steal", "load")


def state_table(states: tuple[DeviceState | None, ...]) -> tuple[list[str], list[list[str]]]:
    """(headers, one row per rank) of the profiled device states, keeping only columns some rank has; no rows when
    no rank recorded a state (an older profile, or one made where NVML and psutil could not tell)."""
    if not any(s is not None and not s.is_empty for s in states):
        return [], []
    empty = DeviceState()
    cells = [[_cell(s or empty, c) for c in STATE_COLUMNS] for s in states]
    keep = [j for j in range(len(STATE_COLUMNS)) if any(row[j] is not None for row in cells)]
    return ["rank", *(STATE_COLUMNS[j] for j in keep)], [[str(i), *(row[j] or "-" for j in keep)]
                                                          for i, row in enumerate(cells)]
