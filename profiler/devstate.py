"""Sampling a rank's DeviceState (planner.devstate) over a window: the compute sweep, or one training epoch.

    sampler = DeviceStateSampler(device)              # opens NVML for a CUDA device (None on CPU / no driver)
    run_sweep(measure, opts, on_point=sampler.chain(on_point))   # one cheap GPU sample after each sweep point
    state = sampler.collect()                         # the window's DeviceState; the next window starts now
    sampler.close()

Cost: a GPU sample is a dozen NVML queries (well under a millisecond) and is taken only where the caller says --
after each sweep point, or once at an epoch end -- never per training step.  ``collect`` adds two passes over
/proc (profiler.hoststate) per window.  Nothing warns: a field NVML or psutil cannot give is left None.

Which GPU processes are "other": NVML lists every compute process on the card, this rank included.  Its own pid
is dropped; inside a container NVML's pids are the host's, so when ours is not among them and this rank holds a
CUDA context, each sample votes for the entry whose memory is closest to what this rank's allocator holds at that
moment, and the most-voted pid is dropped instead (``own_pid_by_memory``).  Voting per sample matters: after an
out-of-memory probe the allocator is emptied, and one late comparison would pick a co-tenant.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from planner.devstate import DeviceState, GpuProcess
from profiler import hoststate
from profiler.nvml import COMPUTE_MODES, NvmlDevice, open_torch_device, throttle_names

T = TypeVar("T")
MPS_NAMES = ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server")


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuSample:
    """One instantaneous reading (None: NVML did not answer that question)."""

    processes: tuple[tuple[int, int | None], ...] | None = None
    own_bytes: int | None = None
    """What this rank's allocator held on the card at this moment (None: no CUDA context)."""
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    throttle_mask: int | None = None
    power_w: float | None = None
    temperature_c: float | None = None


def _ask(fn: Callable[[], T]) -> T | None:
    try:
        return fn()
    except Exception:  # unsupported on this card/driver, or the GPU went away: absent, not an error
        return None


def read_sample(dev: NvmlDevice, own_bytes: Callable[[], int | None] = lambda: None) -> GpuSample:
    procs = _ask(dev.compute_processes)
    return GpuSample(processes=None if procs is None else tuple(procs), own_bytes=_ask(own_bytes),
                     sm_clock_mhz=_ask(lambda: dev.clock_mhz("sm")),
                     mem_clock_mhz=_ask(lambda: dev.clock_mhz("mem")), throttle_mask=_ask(dev.throttle_mask),
                     power_w=_ask(dev.power_w), temperature_c=_ask(dev.temperature_c))


def own_pid_by_memory(samples: Sequence[GpuSample]) -> int | None:
    """The listed pid that is this rank, by vote: in each sample with a CUDA context, the entry whose memory is
    closest to what the allocator held then (NVML adds the context's few hundred MiB to every process alike)."""
    votes: dict[int, int] = {}
    for s in samples:
        if s.processes and s.own_bytes is not None:
            own = s.own_bytes
            pid = min(s.processes, key=lambda p: abs((p[1] or 0) - own))[0]
            votes[pid] = votes.get(pid, 0) + 1
    return max(votes, key=lambda pid: votes[pid]) if votes else None


def other_gpu_processes(seen: dict[int, int | None], *, own_pid: int, own_guess: int | None,
                        job: set[int], names: Callable[[int], str | None]) -> tuple[tuple[GpuProcess, ...], bool]:
    """(the processes that are not this rank, whether ours was told apart by memory) -- see the module docstring.

    ``seen`` maps pid -> most bytes seen; ``own_guess`` is own_pid_by_memory's vote (None: no CUDA context, so
    every listed process is another); ``job`` are this job's pids, named as peers when one shows up here.
    """
    procs = dict(seen)
    by_memory = False
    if own_pid in procs:
        del procs[own_pid]
    elif own_guess is not None and own_guess in procs:
        del procs[own_guess]  # another PID namespace (a container): NVML's pids are the host's
        by_memory = True
    out = []
    for pid in sorted(procs):
        # Across a namespace a pid means another process here: never put a local name on it.
        name = None if by_memory else names(pid)
        if name is not None and pid in job:
            name = f"{name} (a peer rank of this job)"
        out.append(GpuProcess(pid=pid, used_bytes=procs[pid], name=name))
    return tuple(out), by_memory


def _median_int(xs: Sequence[int | None]) -> int | None:
    known = [x for x in xs if x is not None]
    return int(statistics.median_low(known)) if known else None


def _process_name(pid: int) -> str | None:
    try:
        import psutil

        return str(psutil.Process(pid).name()) or None
    except Exception:
        return None


def mps_running() -> bool | None:
    """Whether an MPS daemon or server runs on this host (psutil); None without psutil."""
    try:
        import psutil

        return any((p.info.get("name") or "") in MPS_NAMES for p in psutil.process_iter(["name"]))
    except Exception:
        return None


def _torch_own_bytes(device: Any) -> Callable[[], int | None]:
    """What this rank holds on its GPU: the caching allocator's reserve (None before CUDA is initialized)."""
    def own() -> int | None:
        import torch

        if not torch.cuda.is_initialized():
            return None
        return int(torch.cuda.memory_reserved(device))
    return own


class DeviceStateSampler:
    """Samples one rank's device and host state over windows; see the module docstring."""

    def __init__(self, device: Any = None, *, nvml: NvmlDevice | None = None,
                 own_gpu_bytes: Callable[[], int | None] | None = None, track_processes: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``device``: a torch device or None (host only).  ``nvml`` replaces NVML (tests pass a fake); by default
        it is opened for CUDA devices.  ``track_processes`` scans /proc for other processes' CPU use (two passes a
        window)."""
        is_cuda = device is not None and str(device).startswith("cuda")
        self._nvml = nvml if nvml is not None else (open_torch_device(device) if is_cuda else None)
        self._own_bytes = own_gpu_bytes or (_torch_own_bytes(device) if is_cuda else (lambda: None))
        self._track = track_processes
        self._clock = clock
        self._mps = mps_running() if self._nvml is not None else None
        self._samples: list[GpuSample] = []
        self._start_window()

    def _start_window(self, cores: list[tuple[float, float, float]] | None = None,
                      procs: dict[int, hoststate.ProcSample] | None = None, job: set[int] | None = None) -> None:
        """A new window; ``cores``/``procs``/``job``: what the last window ended with (saves passes over /proc)."""
        self._samples = []
        self._t0, self._wall0 = self._clock(), time.time()
        self._cores0 = cores if cores is not None else hoststate.per_core_times()
        self._job = job if job is not None else hoststate.job_pids() if self._track else set()
        self._procs0 = procs if procs is not None or not self._track else hoststate.process_table(self._job)

    def sample(self) -> None:
        """One GPU reading into this window (nothing without NVML)."""
        if self._nvml is not None:
            self._samples.append(read_sample(self._nvml, self._own_bytes))

    def chain(self, then: Callable[[T], None] | None = None) -> Callable[[T], None]:
        """An on_point hook that samples, then calls ``then`` (the sweep's own progress hook)."""
        def on_point(point: T) -> None:
            self.sample()
            if then is not None:
                then(point)
        return on_point

    def collect(self) -> DeviceState:
        """The state over the window since the last collect (or creation); a new window starts."""
        if self._nvml is not None and not self._samples:
            self.sample()  # at least one reading, even when nothing called sample()
        window_s = max(0.0, self._clock() - self._t0)
        cores = hoststate.per_core_times()
        # This job's processes as of now too: loader workers and peers started during the window are not "other"
        # (the next window starts from today's set, so a dead worker's pid reused by a stranger is not hidden).
        job = hoststate.job_pids() if self._track else set()
        procs = hoststate.process_table(self._job | job) if self._track else None
        state = DeviceState(window_s=round(window_s, 3), **self._gpu_fields(),
                            **self._host_fields(window_s, cores, procs))
        self._start_window(cores, procs, job)
        return state

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None

    # -- the two halves ------------------------------------------------------------------------------------------
    def _gpu_fields(self) -> dict[str, Any]:
        dev, samples = self._nvml, self._samples
        if dev is None:
            return {}
        out: dict[str, Any] = {"num_samples": len(samples)}
        listed = [s.processes for s in samples if s.processes is not None]
        if listed:
            seen: dict[int, int | None] = {}
            for procs in listed:
                for pid, used in procs:
                    prev = seen.get(pid)
                    seen[pid] = used if prev is None else max(prev, used or 0)
            out["other_processes"], by_memory = other_gpu_processes(
                seen, own_pid=os.getpid(), own_guess=own_pid_by_memory(samples), job=self._job, names=_process_name)
            out["own_pid_by_memory"] = by_memory or None
        out["sm_clock_mhz"] = _median_int([s.sm_clock_mhz for s in samples])
        out["mem_clock_mhz"] = _median_int([s.mem_clock_mhz for s in samples])
        masks = [s.throttle_mask for s in samples if s.throttle_mask is not None]
        if masks:
            union = 0
            for m in masks:
                union |= m
            out["throttle_reasons"] = throttle_names(union)
        powers = [s.power_w for s in samples if s.power_w is not None]
        out["power_w"] = round(statistics.median(powers), 1) if powers else None
        temps = [s.temperature_c for s in samples if s.temperature_c is not None]
        out["temperature_c"] = max(temps) if temps else None
        out["sm_clock_max_mhz"] = _ask(lambda: dev.max_clock_mhz("sm"))
        out["mem_clock_max_mhz"] = _ask(lambda: dev.max_clock_mhz("mem"))
        limit = _ask(dev.power_limit_w)
        out["power_limit_w"] = None if limit is None else round(limit, 1)
        link, link_max = _ask(dev.pcie_link), _ask(dev.pcie_link_max)
        if link is not None:
            out["pcie_gen"], out["pcie_width"] = link
        if link_max is not None:
            out["pcie_gen_max"], out["pcie_width_max"] = link_max
        out["mig_mode"] = _ask(dev.mig_enabled)
        mode = _ask(dev.compute_mode)
        out["compute_mode"] = None if mode is None else COMPUTE_MODES.get(mode, str(mode))
        out["mps"] = self._mps
        bus = _ask(dev.pci_bus_id)
        out["gpu_numa_node"] = None if bus is None else hoststate.pci_numa_node(bus)
        return out

    def _host_fields(self, window_s: float, cores_now: list[tuple[float, float, float]] | None,
                     procs_now: dict[int, hoststate.ProcSample] | None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        cores = hoststate.own_affinity()
        out["cpu_affinity"] = cores
        out["numa_nodes"] = None if cores is None else hoststate.numa_nodes_of(cores)
        out["host_cpus"] = os.cpu_count()
        load = hoststate.load_avg_1m()
        out["load_avg_1m"] = None if load is None else round(load, 2)
        out["mem_available_bytes"], out["mem_total_bytes"] = hoststate.memory()
        if cores is not None and window_s >= hoststate.MIN_WINDOW_S:
            busy = hoststate.busy_fraction(self._cores0, cores_now, cores)
            out["cpu_busy_frac"] = None if busy is None else round(busy, 3)
            stolen = hoststate.steal_cores(self._cores0, cores_now, cores)
            out["cpu_steal_cores"] = None if stolen is None else round(stolen, 3)
            if self._procs0 is not None and procs_now is not None:
                out["cpu_other_cores"], out["cpu_other_processes"] = hoststate.other_cpu_use(
                    self._procs0, procs_now, cores, window_s=window_s, window_start=self._wall0,
                    host_cpus=os.cpu_count() or len(cores))
        return out
