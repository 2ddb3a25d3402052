"""DeviceState: what a rank's device and host looked like while it was measured, and its JSON form.

The profiler samples it over the compute sweep (``ranks[i].device_state`` of a profile) and the trainer at every
epoch end (``device_state`` of a run-log epoch record); ``reports.causes`` reads it to say *why* a rank is slow.
Every field is optional: None means "NVML / psutil could not tell here" (no GPU, no driver, a field the card does
not support, a container that hides it), never "zero".  An empty ``other_processes`` tuple, by contrast, is a
measured "nobody else is on this GPU".

Units are in the names; clocks in MHz, power in W, temperature in degrees C, memory in bytes, CPU use in cores
(1.0 = one core busy for the whole window).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from planner.errors import ValidationError
from planner.jsonio import JSONDict, as_int, as_list, as_num, as_obj, as_str, opt

BENIGN_THROTTLE_REASONS = frozenset({"gpu_idle", "applications_clocks_setting", "display_clock_setting"})
"""Clock-event reasons that do not slow a busy GPU (idle between steps, a clock the admin set, the display)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuProcess:
    """Another compute process on this rank's GPU (NVML)."""

    pid: int
    used_bytes: int | None = None
    """GPU memory it holds; None where the driver does not say (some containers, MIG)."""
    name: str | None = None
    """Its process name where this host can see it (psutil); None across a PID namespace."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CpuProcess:
    """Another process that ran on this rank's CPU cores during the window (psutil)."""

    pid: int
    cpu_cores: float
    """CPU it used on this rank's cores, in cores (its CPU seconds times its share of these cores / window)."""
    name: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceState:
    # -- the window ---------------------------------------------------------------------------------------------
    window_s: float | None = None
    """Wall seconds the host-side numbers cover (the compute sweep, or one epoch)."""
    num_samples: int | None = None
    """Instantaneous GPU samples aggregated: clocks and power are their median, temperature their max,
    throttle reasons and other processes their union."""
    # -- GPU (NVML) ---------------------------------------------------------------------------------------------
    other_processes: tuple[GpuProcess, ...] | None = None
    """Compute processes on this GPU other than this rank; () = measured none."""
    own_pid_by_memory: bool | None = None
    """NVML listed PIDs of another namespace (a container): this rank's own entry was told apart by its memory."""
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    mem_clock_mhz: int | None = None
    mem_clock_max_mhz: int | None = None
    throttle_reasons: tuple[str, ...] | None = None
    """NVML clock-event reasons seen in any sample (e.g. sw_power_cap, hw_slowdown, sw_thermal); () = none."""
    power_w: float | None = None
    power_limit_w: float | None = None
    temperature_c: float | None = None
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    mig_mode: bool | None = None
    mps: bool | None = None
    """An MPS control daemon or server runs on the host (the GPU is shared through MPS)."""
    compute_mode: str | None = None
    """NVML compute mode: default, exclusive_process, prohibited."""
    gpu_numa_node: int | None = None
    # -- host (os / psutil) -------------------------------------------------------------------------------------
    cpu_affinity: tuple[int, ...] | None = None
    """CPU cores this rank may run on (sched_getaffinity)."""
    numa_nodes: tuple[int, ...] | None = None
    """NUMA nodes of those cores."""
    host_cpus: int | None = None
    load_avg_1m: float | None = None
    mem_available_bytes: int | None = None
    mem_total_bytes: int | None = None
    cpu_busy_frac: float | None = None
    """Mean busy fraction of this rank's cores over the window, every process counted (this rank too)."""
    cpu_other_cores: float | None = None
    """CPU used on this rank's cores by processes outside this job (not this rank, its workers, or its peer
    ranks), in cores."""
    cpu_steal_cores: float | None = None
    """Time the hypervisor took from this rank's cores (a virtual machine's "steal"), in cores: invisible to the
    processes inside, it slows every CPU-bound part of the job, the loader's workers first."""
    cpu_other_processes: tuple[CpuProcess, ...] | None = None
    """The largest of those, most first."""

    @property
    def is_empty(self) -> bool:
        return all(getattr(self, f.name) is None for f in fields(self))

    @property
    def other_gpu_bytes(self) -> int | None:
        """Memory the other processes hold (None when no process said)."""
        if not self.other_processes:
            return None
        known = [p.used_bytes for p in self.other_processes if p.used_bytes is not None]
        return sum(known) if known else None

    @property
    def slowing_throttle_reasons(self) -> tuple[str, ...] | None:
        if self.throttle_reasons is None:
            return None
        return tuple(r for r in self.throttle_reasons if r not in BENIGN_THROTTLE_REASONS)

    def to_dict(self) -> JSONDict:
        out: JSONDict = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            if f.name in ("other_processes", "cpu_other_processes"):
                v = [{k: getattr(p, k) for k in p.__slots__ if getattr(p, k) is not None} for p in v]
            elif isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        return out

    @classmethod
    def from_dict(cls, data: Any, path: str = "device_state", *, strict: bool = True) -> DeviceState:
        """Read the JSON form; ``strict`` refuses unknown keys (profiles), otherwise they are ignored (run logs,
        which a newer writer may extend)."""
        return _state_from(data, path, strict=strict)


_INTS = ("num_samples", "sm_clock_mhz", "sm_clock_max_mhz", "mem_clock_mhz", "mem_clock_max_mhz", "pcie_gen",
         "pcie_gen_max", "pcie_width", "pcie_width_max", "gpu_numa_node", "host_cpus", "mem_available_bytes",
         "mem_total_bytes")
_NUMS = ("window_s", "power_w", "power_limit_w", "load_avg_1m", "cpu_busy_frac", "cpu_other_cores",
         "cpu_steal_cores")
_BOOLS = ("own_pid_by_memory", "mig_mode", "mps")
_KEYS = tuple(f.name for f in fields(DeviceState))


def _bool(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        raise ValidationError(f"{path}: expected true or false, got {v!r}")
    return v


def _obj(v: Any, path: str, *, required: tuple[str, ...] = (), allowed: tuple[str, ...], strict: bool) -> JSONDict:
    """as_obj, or (not strict) the known keys of any object: a newer writer's extra keys are dropped."""
    if strict:
        return as_obj(v, path, required=required, allowed=allowed)
    d = as_obj(v, path, required=required, allowed=tuple(v) if isinstance(v, Mapping) else ())
    return {k: x for k, x in d.items() if k in required + allowed}


def _state_from(v: Any, path: str, *, strict: bool) -> DeviceState:
    d = _obj(v, path, allowed=_KEYS, strict=strict)
    kw: dict[str, Any] = {}
    for key in _INTS:
        if opt(d, key) is not None:
            kw[key] = as_int(d[key], f"{path}.{key}", min_value=0)
    for key in _NUMS:
        if opt(d, key) is not None:
            kw[key] = as_num(d[key], f"{path}.{key}", non_negative=True)
    if opt(d, "temperature_c") is not None:
        kw["temperature_c"] = as_num(d["temperature_c"], f"{path}.temperature_c")
    for key in _BOOLS:
        if opt(d, key) is not None:
            kw[key] = _bool(d[key], f"{path}.{key}")
    if opt(d, "compute_mode") is not None:
        kw["compute_mode"] = as_str(d["compute_mode"], f"{path}.compute_mode")
    if opt(d, "throttle_reasons") is not None:
        kw["throttle_reasons"] = tuple(as_str(x, f"{path}.throttle_reasons[{i}]")
                                       for i, x in enumerate(as_list(d["throttle_reasons"], f"{path}.throttle_reasons")))
    for key in ("cpu_affinity", "numa_nodes"):
        if opt(d, key) is not None:
            kw[key] = tuple(as_int(x, f"{path}.{key}[{i}]", min_value=0)
                            for i, x in enumerate(as_list(d[key], f"{path}.{key}")))
    if opt(d, "other_processes") is not None:
        kw["other_processes"] = tuple(_gpu_proc(p, f"{path}.other_processes[{i}]", strict=strict)
                                      for i, p in enumerate(as_list(d["other_processes"], f"{path}.other_processes")))
    if opt(d, "cpu_other_processes") is not None:
        items = as_list(d["cpu_other_processes"], f"{path}.cpu_other_processes")
        kw["cpu_other_processes"] = tuple(_cpu_proc(p, f"{path}.cpu_other_processes[{i}]", strict=strict)
                                          for i, p in enumerate(items))
    return DeviceState(**kw)


def _gpu_proc(v: Any, path: str, *, strict: bool) -> GpuProcess:
    d = _obj(v, path, required=("pid",), allowed=("used_bytes", "name"), strict=strict)
    used, name = opt(d, "used_bytes"), opt(d, "name")
    return GpuProcess(pid=as_int(d["pid"], f"{path}.pid", min_value=0),
                      used_bytes=None if used is None else as_int(used, f"{path}.used_bytes", min_value=0),
                      name=None if name is None else as_str(name, f"{path}.name"))


def _cpu_proc(v: Any, path: str, *, strict: bool) -> CpuProcess:
    d = _obj(v, path, required=("pid", "cpu_cores"), allowed=("name",), strict=strict)
    name = opt(d, "name")
    return CpuProcess(pid=as_int(d["pid"], f"{path}.pid", min_value=0),
                      cpu_cores=as_num(d["cpu_cores"], f"{path}.cpu_cores", non_negative=True),
                      name=None if name is None else as_str(name, f"{path}.name"))
