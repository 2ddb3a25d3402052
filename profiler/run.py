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
"""

from __future__ import annotations

import dataclasses
import datetime
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from collectives import all_gather_json
from planner import __version__
from planner.profile import CommProfile, HostProfile, ModelInfo, Profile, RankProfile
from profiler import inventory
from profiler.compute import StepRunner
from profiler.devstate import DeviceStateSampler
from profiler.loader import LoaderOptions, profile_loader
from profiler.memory import find_max_batch, memory_profile
from profiler.sweep import SweepOptions, SweepPoint, run_sweep
from workloads.specs import Workload

T = TypeVar("T")


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
) -> RankProfile:
    """Measure this rank: compute curve, memory, loader cost, device facts.

    Collective when torch.distributed is initialized with several ranks (the loader is measured in turns), so
    every rank must call it.  ``slowdown`` emulates a slower device (workloads.emulate.Slowdown) exactly as the
    trainer applies it; ``loader_workers_cap`` is recorded and bounds the loader scaling run.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    sopts = sweep or (SweepOptions.quick() if quick else SweepOptions())
    if batch_sizes is not None:
        sopts = _with_batches(sopts, batch_sizes)
    if workload.has_batchnorm and sopts.min_batch < 2:
        sopts = _with_batches(sopts, sopts.batch_sizes, min_batch=2)
    layout = host_layout()

    t0 = time.perf_counter()
    runner = StepRunner(workload, dev, amp=amp, channels_last=channels_last, slowdown=slowdown)
    # The device's state while it is measured (#17): a GPU sample after each point, host deltas over the sweep.
    states = DeviceStateSampler(dev)
    try:
        result = run_sweep(runner.measure, sopts, clock=time.perf_counter, on_point=states.chain(on_point))
        device_state = states.collect()
        if not result.points:
            raise RuntimeError(f"rank {rank}: no batch size ran on {dev} (smallest tried: {result.oom_batch})")
        max_batch = find_max_batch(result, runner.fits) if dev.type == "cuda" else None
        num_params, grad_bytes = runner.num_params, runner.grad_bytes
        channels = runner.channels_last
    finally:
        states.close()
        runner.close()
    compute_s = time.perf_counter() - t0

    loader_meta: dict[str, Any] = {}
    loader_profile = None
    if measure_loader:
        lopts = loader or (LoaderOptions.quick() if quick else LoaderOptions())
        if loader_workers_cap is not None:
            lopts = LoaderOptions(num_samples=lopts.num_samples, chunk=lopts.chunk, budget_s=lopts.budget_s,
                                  scaling_s=lopts.scaling_s, max_workers=max(1, loader_workers_cap))
        loader_profile, loader_meta = in_turn(lambda: profile_loader(workload.dataset, lopts), layout)
        if loader_workers_cap is not None:
            loader_profile = dataclasses.replace(loader_profile, max_workers=max(1, loader_workers_cap))

    name, facts = inventory.device_facts(dev)
    meta: dict[str, Any] = {
        **facts,
        **loader_meta,
        "num_params": num_params,
        "grad_bytes": grad_bytes,
        "amp": "bf16" if amp else None,
        "channels_last": channels,
        "emulate_slowdown": slowdown if slowdown != 1.0 else None,
        "emulate_loader_workers": loader_workers_cap,
        "sweep_stop": result.stop_reason,
        "sweep_oom_batch": result.oom_batch,
        "sweep_spread_max": round(max(p.spread for p in result.points), 4),
        "fit_max_rel_residual": round(result.fit_residual() or 0.0, 4),
        "compute_profile_s": round(compute_s, 3),
        "ranks_on_host": layout[1],
    }
    return RankProfile(
        rank=rank,
        host=inventory.host_name(),
        device=str(dev),
        device_name=name,
        compute=result.compute_points(),
        memory=memory_profile(dev, result, max_batch),
        loader=loader_profile,
        meta={k: v for k, v in meta.items() if v is not None},
        device_state=None if device_state.is_empty else device_state,
    )


def gather_profile(rank_profile: RankProfile, *, workload: Workload, comm_repeats: int = 10,
                   meta: Mapping[str, Any] | None = None) -> Profile | None:
    """Collective: gather every rank's profile, time the all-reduce; rank 0 gets the Profile, others None.

    Without an initialized process group (or with one rank) it returns the single-rank Profile, no comm.
    """
    host = inventory.host_profile()
    if not _dist_on():
        return _assemble([rank_profile], [host], workload, None, meta)
    # JSON, not pickle: a peer's profile is data (docs/SECURITY.md).
    gathered = all_gather_json({"rank": rank_profile.to_dict(), "host": host.to_dict()})
    grad_bytes = int(rank_profile.meta.get("grad_bytes") or inventory.model_info("m", workload.model_fn()).grad_bytes or 0)
    ranks = [RankProfile.from_dict(g["rank"], path=f"rank {i}'s profile") for i, g in enumerate(gathered)]
    hosts = [HostProfile.from_dict(g["host"], path=f"rank {i}'s host") for i, g in enumerate(gathered)]
    comm = _measure_comm(grad_bytes, ranks, rank_profile, workload, comm_repeats)
    if dist.get_rank() != 0:
        return None
    return _assemble(ranks, hosts, workload, comm, meta)


def _measure_comm(grad_bytes: int, ranks: list[RankProfile], mine: RankProfile, workload: Workload,
                  repeats: int) -> CommProfile:
    """All-reduce time and the measured DDP overhead (profiler.ddp), on the backend training will use."""
    from profiler.comm import measure_allreduce
    from profiler.ddp import measure_exposed_s

    # All-CUDA jobs train over NCCL: time NCCL even when the default group is gloo (mixed jobs stay on gloo).
    group: dist.ProcessGroup | None = None
    if all(r.device.startswith("cuda") for r in ranks) and dist.get_backend() != "nccl" and dist.is_nccl_available():
        new = dist.new_group(backend="nccl")
        assert isinstance(new, dist.ProcessGroup)  # every rank is a member, so never the non-member sentinel
        group = new
    try:
        comm = measure_allreduce(grad_bytes, repeats=repeats, group=group)
        try:
            exposed: float | None = measure_exposed_s(workload, mine, ranks, group=group)
        except Exception as e:
            warnings.warn(f"could not time DDP steps ({type(e).__name__}: {e}); the plan will estimate the "
                          "exposed communication from the all-reduce time instead", stacklevel=2)
            exposed = None
        # Every rank keeps the measurement only if every rank got one (a failure is usually the same everywhere).
        ok = torch.tensor([0.0 if exposed is None else 1.0],
                          device=torch.device("cuda", torch.cuda.current_device())
                          if str(dist.get_backend(group)) == "nccl" else torch.device("cpu"))
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        return dataclasses.replace(comm, exposed_s=exposed if ok.item() > 0 else None)
    finally:
        if group is not None:
            dist.destroy_process_group(group)


def profile_devices(workload: Workload, devices: Sequence[str], *, quick: bool,
                    slowdowns: Mapping[int, float] | None = None, loader_caps: Mapping[int, int] | None = None,
                    meta: Mapping[str, Any] | None = None, **kw: Any) -> Profile:
    """Profile several local devices in turn in this process (one RankProfile each, same host, no comm)."""
    slowdowns, loader_caps = slowdowns or {}, loader_caps or {}
    ranks = [
        profile_this_rank(workload, d, quick=quick, rank=i, slowdown=slowdowns.get(i, 1.0),
                          loader_workers_cap=loader_caps.get(i), **kw)
        for i, d in enumerate(devices)
    ]
    return _assemble(ranks, [inventory.host_profile()], workload, None, meta)


def _assemble(ranks: Sequence[RankProfile], hosts: Sequence[HostProfile], workload: Workload,
              comm: CommProfile | None, meta: Mapping[str, Any] | None) -> Profile:
    by_name: dict[str, HostProfile] = {}
    for h in hosts:
        # Ranks of one host may see different affinities; the host has at least the widest one.
        if h.name not in by_name or h.cpu_cores > by_name[h.name].cpu_cores:
            by_name[h.name] = h
    first = ranks[0].meta
    model = ModelInfo(name=workload.name.split("@")[0], num_params=first.get("num_params"),
                                grad_bytes=first.get("grad_bytes"))
    info = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "profiler": f"ddp-planner {__version__}",
        "workload": workload.name,
        "sample_shape": list(workload.sample_shape),
        "num_classes": workload.num_classes,
        "has_batchnorm": workload.has_batchnorm,
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
