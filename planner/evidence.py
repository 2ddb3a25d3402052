"""What one rank's DeviceState shows against a reference state: each fact that can slow a rank, with its numbers.

The reference is the slow rank's identical twin (the fastest rank with the same device name) or, for a slowdown
in the middle of a run, the same rank at an earlier epoch.  A fact the reference does not share ``explains`` the
gap; one it shares (both cards power-capped, both ranks on one loaded host) is context, not a cause.  A rank
whose facts explain nothing gets an honest "cause not visible to NVML/psutil" from reports.causes.

It lives in the core because two layers read the same rules: ``planner report`` (reports.causes, reports.measured,
through the ``reports.evidence`` name) and the live epoch-end diagnosis of a running job (runtime.diagnose).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from planner.devstate import DeviceState

CLOCK_LOW_FRAC = 0.90
"""An SM or memory clock below 90% of the reference's (or, without one, of the card's max) is low."""
POWER_AT_CAP_FRAC = 0.97
HOT_C = 85.0
"""Hopper and Ampere data-centre cards start thermal slowdown in the high 80s."""
HOTTER_C = 15.0
CPU_OTHER_MIN_CORES = 0.2
CPU_OTHER_MIN_FRAC = 0.15
"""Other processes count as load on a rank's cores from 0.2 cores or 15% of its cores, whichever is more: a
one-core hog beside a rank on 64 unpinned cores is no cause, the same hog on its one core halves it."""
STEAL_MIN_CORES = 0.2
"""Cores' worth of time taken by a VM's hypervisor (``DeviceState.cpu_steal_cores``) worth naming: slow
launches on a 32-vCPU host (2x H100) lost 0.30-0.36 cores to steal while their loaders built ~15% slower than
profiled; the quiet ones lost 0.01-0.09 (docs/PERFORMANCE.md)."""
LOW_MEMORY_FRAC = 0.05
NOT_VISIBLE = "cause not visible to NVML/psutil"
INSIDE_STEP = f"{NOT_VISIBLE}: inside the training step"
"""A rank's compute measured slow while nothing its device state records differs from the reference's: the cost
is in the work its training step does, which neither NVML nor psutil sees."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Evidence:
    kind: str
    """co-tenant, throttle, sm-clock, mem-clock, power-limit, thermal, pcie, mig, mps, numa, cpu-load,
    cpu-overlap, few-cores, host-load, host-memory, emulated."""
    text: str
    """Plain words with the measured numbers: "2 other processes on the GPU holding 12.1 GiB (pid 4242 ...)"."""
    explains: bool
    """The reference lacks it, so it can explain the gap; False: the reference shows it too (context)."""


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def cores_text(cores: Iterable[int]) -> str:
    """(0, 1, 2, 3, 8) -> '0-3,8'."""
    xs = sorted(set(cores))
    parts, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(parts)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}es" if word.endswith("s") else f"{n} {word}s"


def _gpu_procs(s: DeviceState) -> str:
    procs = s.other_processes or ()
    total = s.other_gpu_bytes
    held = f" holding {gib(total)}" if total is not None else ""
    named = []
    for p in sorted(procs, key=lambda p: -(p.used_bytes or 0))[:3]:
        bits = [f"pid {p.pid}"] + ([p.name] if p.name else []) + ([gib(p.used_bytes)] if p.used_bytes is not None else [])
        named.append(" ".join(bits))
    more = f", +{len(procs) - 3} more" if len(procs) > 3 else ""
    return f"{_plural(len(procs), 'other process')} on the GPU{held} ({'; '.join(named)}{more})"


def _cpu_procs(s: DeviceState) -> str:
    n_cores = len(s.cpu_affinity or ())
    named = [f"pid {p.pid}" + (f" {p.name}" if p.name else "") + f" {p.cpu_cores:.2f}"
             for p in (s.cpu_other_processes or ())[:3]]
    busy = f"; its cores were {100 * s.cpu_busy_frac:.0f}% busy" if s.cpu_busy_frac is not None else ""
    return (f"other processes used {s.cpu_other_cores or 0:.2f} of its {n_cores} core(s) "
            f"(cores {cores_text(s.cpu_affinity or ())}" + (f": {'; '.join(named)}" if named else "") + f"){busy}")


def compare(s: DeviceState, ref: DeviceState | None, *, ref_name: str, is_cpu: bool,
            emulated: float = 1.0, ref_emulated: float = 1.0,
            shared_cores: Sequence[tuple[int, tuple[int, ...]]] = (), ref_shared: int = 0) -> list[Evidence]:
    """Every fact in ``s`` that can slow a rank, flagged by whether ``ref`` shares it.

    ``shared_cores``: (other rank, cores in common) for ranks of this host whose affinity overlaps this rank's (CPU
    ranks); ``ref_shared`` how many the reference overlaps.  ``emulated``: --emulate-slowdown factors.
    """
    out: list[Evidence] = []
    r = ref or DeviceState()

    def add(kind: str, text: str, explains: bool) -> None:
        out.append(Evidence(kind=kind, text=text if explains else f"{text} ({ref_name} too)", explains=explains))

    if emulated > 1.0:
        add("emulated", f"an emulated slowdown of {emulated:g}x (--emulate-slowdown)", emulated > ref_emulated * 1.05)
    if s.other_processes:
        n_ref = len(r.other_processes or ())
        more_mem = (s.other_gpu_bytes or 0) > 1.25 * (r.other_gpu_bytes or 0)
        add("co-tenant", _gpu_procs(s), r.other_processes is None or len(s.other_processes) > n_ref or more_mem)
    slowing = s.slowing_throttle_reasons
    if slowing:
        add("throttle", f"clocks throttled: {', '.join(slowing)}",
            bool(set(slowing) - set(r.slowing_throttle_reasons or ())))
    for kind, cur, mx, ref_cur, what in (("sm-clock", s.sm_clock_mhz, s.sm_clock_max_mhz, r.sm_clock_mhz, "SM"),
                                         ("mem-clock", s.mem_clock_mhz, s.mem_clock_max_mhz, r.mem_clock_mhz,
                                          "memory")):
        if cur is None:
            continue
        base = ref_cur or mx
        if base and cur < CLOCK_LOW_FRAC * base:
            vs = f" vs {ref_cur} on {ref_name}" if ref_cur else ""
            add(kind, f"{what} clock {cur} MHz{vs} (max {mx or '?'})", True)
        elif mx and cur < CLOCK_LOW_FRAC * mx and ref_cur and ref_cur < CLOCK_LOW_FRAC * mx:
            add(kind, f"{what} clock {cur} of {mx} MHz", False)
    if s.power_limit_w and r.power_limit_w and s.power_limit_w < 0.95 * r.power_limit_w:
        add("power-limit", f"power limit {s.power_limit_w:.0f} W vs {r.power_limit_w:.0f} W on {ref_name}", True)
    if s.temperature_c is not None and (s.temperature_c >= HOT_C or (
            r.temperature_c is not None and s.temperature_c >= r.temperature_c + HOTTER_C)):
        ref_t = f" vs {r.temperature_c:.0f} C on {ref_name}" if r.temperature_c is not None else ""
        add("thermal", f"temperature {s.temperature_c:.0f} C{ref_t}",
            r.temperature_c is None or s.temperature_c >= r.temperature_c + HOTTER_C)
    if s.pcie_gen and s.pcie_width and s.pcie_gen_max and s.pcie_width_max and (
            s.pcie_gen < s.pcie_gen_max or s.pcie_width < s.pcie_width_max):
        ref_link = (r.pcie_gen or 0) * (r.pcie_width or 0)
        add("pcie", f"PCIe link gen{s.pcie_gen} x{s.pcie_width} of gen{s.pcie_gen_max} x{s.pcie_width_max}",
            ref_link == 0 or s.pcie_gen * s.pcie_width < ref_link)
    if s.mig_mode:
        add("mig", "MIG mode on: the rank runs on a slice of the GPU", not r.mig_mode)
    if s.mps:
        add("mps", "an MPS daemon shares the GPU between processes", not r.mps)
    if s.gpu_numa_node is not None and s.numa_nodes and s.gpu_numa_node not in s.numa_nodes:
        ref_far = r.gpu_numa_node is not None and bool(r.numa_nodes) and r.gpu_numa_node not in (r.numa_nodes or ())
        add("numa", f"its GPU is on NUMA node {s.gpu_numa_node}, the process on node(s) "
                    f"{cores_text(s.numa_nodes)}", not ref_far)
    load_min = max(CPU_OTHER_MIN_CORES, CPU_OTHER_MIN_FRAC * len(s.cpu_affinity or ()))
    if s.cpu_other_cores is not None and s.cpu_other_cores >= load_min:
        add("cpu-load", _cpu_procs(s),
            r.cpu_other_cores is None or s.cpu_other_cores >= (r.cpu_other_cores or 0) + load_min)
    if s.cpu_steal_cores is not None and s.cpu_steal_cores >= STEAL_MIN_CORES:
        ref_steal = f" vs {r.cpu_steal_cores:.2f} on {ref_name}" if r.cpu_steal_cores is not None else ""
        add("steal", f"the hypervisor took {s.cpu_steal_cores:.2f} core(s) from its cores (steal{ref_steal}): a "
                     "busy VM host, which slows the loader's workers first",
            r.cpu_steal_cores is None or s.cpu_steal_cores >= r.cpu_steal_cores + STEAL_MIN_CORES)
    if is_cpu and shared_cores:
        listed = ", ".join(f"rank {q} (cores {cores_text(c)})" for q, c in shared_cores)
        add("cpu-overlap", f"its cores overlap those of {listed}", len(shared_cores) > ref_shared)
    if is_cpu and s.cpu_affinity and r.cpu_affinity and len(s.cpu_affinity) < len(r.cpu_affinity):
        add("few-cores", f"{len(s.cpu_affinity)} core(s) vs {len(r.cpu_affinity)} on {ref_name}", True)
    if s.load_avg_1m is not None and s.host_cpus and s.load_avg_1m > s.host_cpus:
        ref_loaded = r.load_avg_1m is not None and bool(r.host_cpus) and r.load_avg_1m > (r.host_cpus or 0)
        add("host-load", f"host load average {s.load_avg_1m:.1f} on {s.host_cpus} CPUs", not ref_loaded)
    if s.mem_available_bytes is not None and s.mem_total_bytes and \
            s.mem_available_bytes < LOW_MEMORY_FRAC * s.mem_total_bytes:
        ref_low = r.mem_available_bytes is not None and bool(r.mem_total_bytes) and \
            r.mem_available_bytes < LOW_MEMORY_FRAC * (r.mem_total_bytes or 0)
        add("host-memory", f"host memory nearly full ({gib(s.mem_available_bytes)} of {gib(s.mem_total_bytes)} free)",
            not ref_low)
    return out


def checked(s: DeviceState, kinds: set[str]) -> list[str]:
    """The measured absences worth saying ("no throttling; SM clock at max"), for facts not already in ``kinds``."""
    out = []
    if s.other_processes is not None and not s.other_processes:
        out.append("no other process on the GPU")
    if s.throttle_reasons is not None and not s.slowing_throttle_reasons:
        out.append("no throttling")
    if "sm-clock" not in kinds and s.sm_clock_mhz is not None and s.sm_clock_max_mhz:
        at_max = s.sm_clock_mhz >= CLOCK_LOW_FRAC * s.sm_clock_max_mhz
        out.append(f"SM clock {'at max' if at_max else 'at'} {s.sm_clock_mhz} of {s.sm_clock_max_mhz} MHz")
    if "cpu-load" not in kinds and s.cpu_other_cores is not None:
        out.append(f"other processes used {s.cpu_other_cores:.2f} core(s) on its cores")
    if "steal" not in kinds and s.cpu_steal_cores is not None:
        out.append(f"steal {s.cpu_steal_cores:.2f} core(s)")
    return out
