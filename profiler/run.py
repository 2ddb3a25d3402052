"""Profiling one rank, several local devices, or every rank of a torchrun job into one Profile.

In-process API (also what ``planner train --auto`` calls on every rank):

    rank_profile = profile_this_rank(workload, device, quick=True, slowdown=3.0)
    profile = gather_profile(rank_profile, workload=workload)   # collective; rank 0 gets the Profile, others None

Ranks that share a host must not disturb each other's numbers:
  * compute sweeps run in parallel -- on separate GPUs they do not interact; CPU ranks on one host get
    ``cores // ranks_on_host`` torch threads each (set by the CLI), i.e. the share they will have in training;
  * loader measurements, which are CPU-bound and would otherwise compete for the host's cores, run one local
    rank at a time behind barriers (every rank takes part in every barrier, so the count always matches);
  * the all-reduce is timed last, with all ranks idle otherwise.

``progress`` (optional, a callable taking one line of text) hears each phase and each measured point, so a
program can show that a profile taking a minute is moving (planner.cli.progress prints them).
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from planner import __version__
from planner.profile import CommProfile, ComputePoint, HostProfile, LoaderProfile, ModelInfo, Profile, RankProfile
from profiler import inventory
from profiler.comm_cost import measure_comm
from profiler.compiled import CompileOptions, compile_runner
from profiler.compute import StepRunner, TimedSteps
from profiler.devstate import DeviceStateSampler
from profiler.hostlinks import measure_host_allreduce
from profiler.loader import LoaderOptions, host_consensus, loader_to_json, profile_loader
from profiler.memory import find_max_batch, memory_profile
from profiler.parts import Background, Parts
from profiler.sweep import SweepOptions, SweepPoint, run_sweep
from profiler.workloads.specs import Workload
from runtime.collectives import all_gather_json

T = TypeVar("T")
OVERLAP_FROM_STEP_S = 0.05
"""A sweep step this long is GPU-bound: from here on the loader measurement may run beside it (profiler.parts)."""
Progress = Callable[[str], None]
"""Receives one line per phase or measured point ("rank 0 (cpu): compute sweep, batch 16: 12.3 ms")."""


def _say(progress: Progress | None, text: str) -> None:
    if progress is not None:
        progress(text)


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def host_layout() -> tuple[int, int, int]:
    """(index of this rank among its host's ranks, ranks on this host, most ranks on any host); collective."""
    if not _dist_on():
        return 0, 1, 1
    names = all_gather_json(inventory.host_name())
    mine = names[dist.get_rank()]
    local_index = sum(1 for n in names[: dist.get_rank()] if n == mine)
    counts = {n: names.count(n) for n in names}
    return local_index, counts[mine], max(counts.values())


def in_turn(fn: Callable[[], T], layout: tuple[int, int, int]) -> T:
    """Run fn on one local rank of each host at a time (barriers between turns); collective."""
    if not _dist_on():
        return fn()
    local_index, _, turns = layout
    result: T | None = None
    for turn in range(turns):
        dist.barrier()
        if turn == local_index:
            result = fn()
    dist.barrier()
    assert result is not None
    return result


def _nothing() -> None:
    return None


def _share_loader(mine: tuple[LoaderProfile, dict[str, Any]] | None) -> tuple[LoaderProfile, dict[str, Any]]:
    """Collective: the loader numbers of this host's measuring rank (the lowest rank of the host that has some)."""
    # A LoaderProfile travels inside a minimal RankProfile: its JSON form and its checks, no second codec.
    carrier = None if mine is None else RankProfile(rank=0, host="-", device="-", loader=mine[0],
                                                     compute=(ComputePoint(batch_size=1, step_time_s=1.0),))
    entry = None if mine is None or carrier is None else {"rank": carrier.to_dict(), "meta": mine[1]}
    host = inventory.host_name()
    gathered = all_gather_json({"host": host, "measured": entry})
    for r, g in enumerate(gathered):
        if g["host"] == host and g["measured"] is not None:
            lp = RankProfile.from_dict(g["measured"]["rank"], path=f"rank {r}'s loader").loader
            assert lp is not None
            return lp, {**g["measured"]["meta"], "loader_measured_by_rank": r}
    raise RuntimeError(f"no rank on host {host} measured the dataloader")


def profile_this_rank(
    workload: Workload,
    device: torch.device | str,
    *,
    quick: bool,
    batch_sizes: Sequence[int] | None = None,
    slowdown: float = 1.0,
    loader_workers_cap: int | None = None,
    amp: bool = False,
    channels_last: bool | None = None,
    rank: int | None = None,
    measure_loader: bool = True,
    sweep: SweepOptions | None = None,
    loader: LoaderOptions | None = None,
    on_point: Callable[[SweepPoint], None] | None = None,
    progress: Progress | None = None,
    overlap_loader: bool | None = None,
    loader_per_host: bool = False,
    loader_pin: Callable[[Any], Any] | None = None,
    max_batch: int | None = None,
    compile: CompileOptions | None = None,
) -> RankProfile:
    """Measure this rank: compute curve, memory, loader cost, device facts.

    Collective when torch.distributed is initialized with several ranks (the loader is measured in turns, or
    with ``loader_per_host`` once per host: one measurement serves every rank of the host, which loads the same
    dataset), so every rank must call it with the same ``loader_per_host``.  ``slowdown`` emulates a slower device
    (profiler.workloads.emulate.Slowdown) exactly as the trainer applies it; ``loader_workers_cap`` is this rank's worker
    cap: recorded as its loader's ``max_workers``, and the bound of its scaling run when it measures its own
    (in turns).  Once per host the measuring rank scans up to the host's cores whatever its own cap, since every
    rank needs the host's curve (the contention model reads it at the training load).  ``loader_pin``: how the
    training process will pin a batch (``runtime.pinning.pin_tree`` under ``PinAhead``; None: the DataLoader's
    ``Tensor.pin_memory``), timed for the loader's hand-over reading.  ``max_batch``: the largest batch a plan can
    give this rank, where the sweep stops (``sweep_options``).  ``compile``: the sweep's steps run through
    torch.compile (profiler.compiled; the rank's ``meta.compile`` records the compile).
    """
    sopts = sweep_options(quick, batch_sizes, sweep, min_batch=workload.min_batch, max_batch=max_batch)
    lopts = loader or (LoaderOptions.quick() if quick else LoaderOptions())
    if loader_workers_cap is not None and not loader_per_host:
        lopts = dataclasses.replace(lopts, max_workers=max(1, loader_workers_cap))
    if loader_pin is not None:
        lopts = dataclasses.replace(lopts, pin=loader_pin)

    def measure_loader_fn() -> tuple[LoaderProfile, dict[str, Any]]:
        return profile_loader(workload.dataset, lopts)

    rp = measure_rank(
        lambda dev: compile_runner(StepRunner(workload, dev, amp=amp, channels_last=channels_last, slowdown=slowdown),
                                   compile), device,
        sweep=sopts, rank=rank, measure_loader=measure_loader_fn if measure_loader else None, on_point=on_point,
        meta={"emulate_loader_workers": loader_workers_cap}, progress=progress, loader_key=workload.name,
        overlap_loader=overlap_loader, loader_per_host=loader_per_host)
    if loader_workers_cap is not None and rp.loader is not None:  # this rank's own cap, however it was measured
        rp = dataclasses.replace(rp, loader=dataclasses.replace(rp.loader, max_workers=max(1, loader_workers_cap)))
    return rp


def sweep_options(quick: bool, batch_sizes: Sequence[int] | None, sweep: SweepOptions | None, *,
                  min_batch: int = 1, max_batch: int | None = None) -> SweepOptions:
    """The sweep `planner profile` runs: quick or full, explicit batches, min batch 2 for BatchNorm models.

    ``max_batch``: the largest local batch any plan of this run can give a rank -- the global batch, when the run
    plans for one (`planner train --auto`, `planner bench`, the adapters' auto mode).  The geometric series stops
    there: points past it would only extend a curve no plan reads, and the DDP measurement (profiler.ddp), which
    runs at the largest measured batches, then runs where the plans will.  Below the series' own start the cap
    moves the start down, so that ``min_points`` points still fit under it, and the series ends at the cap itself
    (global batch 20: 5, 10, 20; 100: 8, 16, 32, 64, 100).  Explicit ``batch_sizes`` are kept."""
    sopts = sweep or (SweepOptions.quick() if quick else SweepOptions())
    if batch_sizes is not None:
        sopts = _with_batches(sopts, batch_sizes)
    if sopts.min_batch < min_batch:
        sopts = _with_batches(sopts, sopts.batch_sizes, min_batch=min_batch)
    if max_batch is not None and sopts.batch_sizes is None and max_batch < sopts.max_batch:
        top = max(max_batch, sopts.min_batch)
        start = min(sopts.start_batch, max(sopts.min_batch, top // sopts.growth ** (sopts.min_points - 1)))
        sopts = _with_batches(sopts, None, max_batch=top, start_batch=start, end_at_max=True)
    return sopts


def measure_rank(
    make_runner: Callable[[torch.device], TimedSteps],
    device: torch.device | str,
    *,
    sweep: SweepOptions,
    rank: int | None = None,
    measure_loader: Callable[[], tuple[LoaderProfile, dict[str, Any]]] | None = None,
    on_point: Callable[[SweepPoint], None] | None = None,
    meta: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
    loader_key: str | None = None,
    overlap_loader: bool | None = None,
    loader_per_host: bool = False,
) -> RankProfile:
    """Sweep ``make_runner(device)``'s training step, find its memory cap, measure the loader: one RankProfile.

    The one measuring path of `planner profile` (a workload's step) and profiler.api (a user's own step).
    ``overlap_loader``: measure the loader beside the sweep (profiler.parts); None = on CUDA ranks only.
    ``loader_per_host``: one rank per host measures the loader and shares it (every rank must pass the same: it
    changes the collectives); else every rank measures in its turn, then the ranks of a host that name the same
    ``loader_key`` (the dataset; None: this rank's own) agree on one loader profile.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    layout = host_layout()

    who = f"rank {rank} ({dev})"
    parts = Parts(lambda line: _say(progress, f"{who}: {line}"))
    # The loader is CPU work: on a CUDA rank it runs beside the sweep once the steps are GPU-bound
    # (profiler.parts), in its turns with the host's other ranks; elsewhere after the sweep.
    # One local rank per host may measure the host's pipeline for all of them (loader_per_host): the others take
    # its numbers after the join (_share_loader), with no turns and no barriers in the thread.
    per_host = measure_loader is not None and loader_per_host and _dist_on()
    loader_job: Background[tuple[LoaderProfile, dict[str, Any]] | None] | None = None
    if measure_loader is not None:
        measure = measure_loader
        job_fn: Callable[[], tuple[LoaderProfile, dict[str, Any]] | None]
        if per_host:
            job_fn = measure if layout[0] == 0 else _nothing
        else:
            job_fn = lambda: in_turn(measure, layout)  # noqa: E731 -- one line, the thread's whole job
        loader_job = Background(job_fn, name=f"loader-rank{rank}")
    overlap = (dev.type == "cuda" if overlap_loader is None else overlap_loader) and loader_job is not None

    def point_done(p: SweepPoint) -> None:
        _say(progress, f"{who}: compute sweep, batch {p.batch_size}: {1000 * p.median_s:.1f} ms "
                       f"({len(p.times_s)} steps)")
        if overlap and loader_job is not None and not loader_job.started and p.median_s >= OVERLAP_FROM_STEP_S:
            _say(progress, f"{who}: dataloader cost per sample (beside the sweep)")
            loader_job.start()
        if on_point is not None:
            on_point(p)

    t0 = time.perf_counter()
    _say(progress, f"{who}: compute sweep (budget {sweep.total_budget_s:g} s)")
    runner = make_runner(dev)
    # The device's state while it is measured: a GPU sample after each point, host deltas over the sweep.
    states = DeviceStateSampler(dev)
    try:
        with parts.part("compute sweep"):
            result = run_sweep(runner.measure, sweep, clock=time.perf_counter, on_point=states.chain(point_done))
        device_state = states.collect()
        if not result.points:
            raise RuntimeError(f"rank {rank}: no batch size ran on {dev} (smallest tried: {result.oom_batch})")
        if overlap and loader_job is not None:
            loader_job.start()  # the sweep ended before its steps grew long: the memory search still overlaps
        if dev.type == "cuda" and result.oom_batch is not None:
            _say(progress, f"{who}: searching the largest batch that fits")
        with parts.part("memory search"):
            max_batch = find_max_batch(result, runner.fits) if dev.type == "cuda" else None
        num_params, grad_bytes, step_meta = runner.num_params, runner.grad_bytes, runner.meta()
        structure = runner.structure
        # Charged once per optimizer step when a rank accumulates (planner/_accumulation.py); batch-independent.
        # Timed alone it can read above a whole small step (clock noise on microsecond steps): never more than
        # half of the smallest measured step, which it is part of.
        with parts.part("optimizer step"):
            optimizer_s = min(runner.optimizer_step_s(result.points[0].batch_size),
                              0.5 * min(p.median_s for p in result.points))
    finally:
        states.close()
        runner.close()
    compute_s = time.perf_counter() - t0

    loader_meta: dict[str, Any] = {}
    loader_profile = None
    if loader_job is not None:
        if not loader_job.started:
            _say(progress, f"{who}: dataloader cost per sample")
        waited = time.perf_counter()
        got = loader_job.result()  # joined before any other collective
        if per_host:
            got = _share_loader(got)
        assert got is not None
        loader_profile, loader_meta = got
        if not per_host:  # measured by every rank in turn: identical ranks of a host agree on one answer
            loader_profile, shared_meta = share_on_host(loader_profile, loader_key)
            loader_meta = {**loader_meta, **shared_meta}
        # Its own seconds; the wait after the sweep is what it added to the profile's wall time.
        parts.add("loader" + (" (beside the sweep)" if overlap else ""), loader_job.elapsed_s)
        if overlap:
            parts.seconds["loader wait after sweep"] = round(time.perf_counter() - waited, 3)

    name, facts = inventory.device_facts(dev)
    info: dict[str, Any] = {
        **facts,
        **loader_meta,
        "num_params": num_params,
        "model_structure": structure,
        "grad_bytes": grad_bytes,
        **step_meta,
        **(meta or {}),
        "sweep_stop": result.stop_reason,
        "sweep_oom_batch": result.oom_batch,
        "sweep_spread_max": round(max(p.spread for p in result.points), 4),
        # Per point, in compute order: the quality gate (planner.quality) names the batch whose repeats disagree.
        "sweep_spread": [round(p.spread, 4) for p in result.points],
        "sweep_repeats": [len(p.times_s) for p in result.points],
        "fit_max_rel_residual": round(result.fit_residual() or 0.0, 4),
        "compute_profile_s": round(compute_s, 3),
        "profile_parts_s": dict(parts.seconds),
        "ranks_on_host": layout[1],
        "hostname": inventory.machine_name(),
        "node": inventory.node_facts(),  # torchrun's node and local rank (None outside torchrun)
    }
    return RankProfile(
        rank=rank,
        host=inventory.host_name(),
        device=str(dev),
        device_name=name,
        compute=result.compute_points(),
        memory=memory_profile(dev, result, max_batch),
        loader=loader_profile,
        meta={k: v for k, v in info.items() if v is not None},
        device_state=None if device_state.is_empty else device_state,
        optimizer_step_s=optimizer_s,
    )


def share_on_host(lp: LoaderProfile, key: str | None) -> tuple[LoaderProfile, dict[str, Any]]:
    """Collective: the ranks of this host with the same dataset ``key`` agree on one loader profile
    (profiler.loader.host_consensus); every rank takes part, a rank with key None keeps its own."""
    if not _dist_on():
        return lp, {}
    mine = {"host": inventory.host_name(), "key": key, "loader": loader_to_json(lp)}
    peers = [g["loader"] for g in all_gather_json(mine)
             if key is not None and g["host"] == mine["host"] and g["key"] == key]
    if len(peers) < 2:
        return lp, {}
    return host_consensus(lp, peers)


def gather_profile(rank_profile: RankProfile, *, workload: Workload, comm_repeats: int = 10,
                   meta: Mapping[str, Any] | None = None, progress: Progress | None = None,
                   grad_compress: str = "none") -> Profile | None:
    """Collective: gather every rank's profile, time the all-reduce (the DDP steps' gradients on the wire as
    ``grad_compress`` says); rank 0 gets the Profile, others None.

    Without an initialized process group (or with one rank) it returns the single-rank Profile, no comm.
    """
    m = rank_profile.meta

    def make_runner() -> TimedSteps:
        # The step as this rank profiled it (profiler.ddp runs it under DDP).
        return StepRunner(workload, rank_profile.device, amp=m.get("amp") == "bf16",
                          channels_last=m.get("channels_last"), slowdown=float(m.get("emulate_slowdown") or 1.0))

    return gather_ranks(rank_profile, model_name=workload.name.split("@")[0], make_runner=make_runner,
                        comm_repeats=comm_repeats, meta={**_workload_info(workload), **(meta or {})},
                        progress=progress, grad_compress=grad_compress)


def gather_ranks(rank_profile: RankProfile, *, model_name: str, make_runner: Callable[[], TimedSteps] | None,
                 comm_repeats: int = 10, meta: Mapping[str, Any] | None = None,
                 progress: Progress | None = None, grad_compress: str = "none") -> Profile | None:
    """Collective: every rank's RankProfile and host into one Profile on rank 0 (None elsewhere), with the
    all-reduce and -- when ``make_runner`` rebuilds this rank's step -- the measured DDP overhead."""
    host = inventory.host_profile()
    if not _dist_on():
        return assemble_profile([rank_profile], [host], model_name, None, meta)
    # JSON, not pickle: a peer's profile is data (docs/SECURITY.md).
    gathered = all_gather_json({"rank": rank_profile.to_dict(), "host": host.to_dict()})
    grad_bytes = int(rank_profile.meta.get("grad_bytes") or 0)
    ranks = [RankProfile.from_dict(g["rank"], path=f"rank {i}'s profile") for i, g in enumerate(gathered)]
    hosts = [HostProfile.from_dict(g["host"], path=f"rank {i}'s host") for i, g in enumerate(gathered)]
    t0 = time.perf_counter()
    comm, comm_meta = measure_comm(grad_bytes, ranks, make_runner, comm_repeats,
                                   lambda line: _say(progress, line), grad_compress=grad_compress)
    if len({r.host for r in ranks}) > 1:  # spanning hosts: each host's own all-reduce too (planner.comm_model)
        nccl = all(r.device.startswith("cuda") for r in ranks) and dist.is_nccl_available()
        comm_meta["allreduce_by_host_s"] = measure_host_allreduce(
            grad_bytes, [r.host for r in ranks], repeats=comm_repeats, backend="nccl" if nccl else None)
    comm_s = time.perf_counter() - t0
    if dist.get_rank() != 0:
        return None
    # The budget per part: rank 0's parts, the slowest rank's sweep, and the communication.
    mine = dict(rank_profile.meta.get("profile_parts_s") or {})
    _say(progress, "profile parts (rank 0): " + ", ".join(f"{k} {v:.1f} s" for k, v in mine.items())
         + f"; all-reduce and DDP cost {comm_s:.1f} s")
    comm_meta = {**comm_meta, "comm_profile_s": round(comm_s, 3)}
    return assemble_profile(ranks, hosts, model_name, comm, {**(meta or {}), **comm_meta})


def profile_devices(workload: Workload, devices: Sequence[str], *, quick: bool,
                    slowdowns: Mapping[int, float] | None = None, loader_caps: Mapping[int, int] | None = None,
                    meta: Mapping[str, Any] | None = None, **kw: Any) -> Profile:
    """Profile several local devices in turn in this process (one RankProfile each, same host, no comm).

    ``kw``: profile_this_rank's keywords (batch_sizes, amp, sweep, loader, on_point, progress...).
    """
    slowdowns, loader_caps = slowdowns or {}, loader_caps or {}
    ranks = [
        profile_this_rank(workload, d, quick=quick, rank=i, slowdown=slowdowns.get(i, 1.0),
                          loader_workers_cap=loader_caps.get(i), **kw)
        for i, d in enumerate(devices)
    ]
    return assemble_profile(ranks, [inventory.host_profile()], workload.name.split("@")[0], None,
                     {**_workload_info(workload), **(meta or {})})


def _workload_info(workload: Workload) -> dict[str, Any]:
    info = {"workload": workload.name, "sample_shape": list(workload.sample_shape),
            "num_classes": workload.num_classes, "has_batchnorm": workload.has_batchnorm}
    if workload.normalize is not None:  # the loader was measured handing over uint8 images (--gpu-normalize)
        info["gpu_normalize"] = True
    return info


def assemble_profile(ranks: Sequence[RankProfile], hosts: Sequence[HostProfile], model_name: str,
                     comm: CommProfile | None, meta: Mapping[str, Any] | None) -> Profile:
    """One Profile from ranks and the hosts they reported (a host's widest core count wins)."""
    by_name: dict[str, HostProfile] = {}
    for h in hosts:
        # Ranks of one host may see different affinities; the host has at least the widest one.
        if h.name not in by_name or h.cpu_cores > by_name[h.name].cpu_cores:
            by_name[h.name] = h
    first = ranks[0].meta
    model = ModelInfo(name=model_name, num_params=first.get("num_params"), grad_bytes=first.get("grad_bytes"),
                      structure=first.get("model_structure"))
    info = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "profiler": f"ddp-planner {__version__}",
        **inventory.software_facts(),
        **(meta or {}),
    }
    return Profile(hosts=tuple(by_name.values()), ranks=tuple(sorted(ranks, key=lambda r: r.rank)), model=model,
                   comm=comm, meta=info)


def _with_batches(opts: SweepOptions, batch_sizes: Sequence[int] | None, **changes: Any) -> SweepOptions:
    fields = {name: getattr(opts, name) for name in opts.__slots__}
    fields["batch_sizes"] = None if batch_sizes is None else tuple(sorted(set(int(b) for b in batch_sizes)))
    fields.update(changes)
    return SweepOptions(**fields)
