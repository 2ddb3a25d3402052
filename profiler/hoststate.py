"""The host side of a rank's state: its cores, their NUMA nodes, load, free memory, and who else ran on its cores.

Two snapshots (window start and end) of every process's CPU seconds and affinity give each other process's CPU
use over the window; a process counts on this rank's cores in proportion to the share of its allowed cores that
are this rank's (a process pinned to the rank's one core counts fully, an unpinned one on a 2-core host half):

    cores_used(p) = (cpu_s_end(p) - cpu_s_start(p)) * |aff(p) & ours| / |aff(p)| / window_s

This rank, its descendants (loader workers) and, under torchrun, its peer ranks and theirs (the elastic agent's
descendants) are this job, not "other".  Everything goes through psutil where present and is guarded: without it,
or without /proc and /sys, the fields are simply absent.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from planner.devstate import CpuProcess

TOP_PROCESSES = 5
"""How many of the other processes a state names (the largest CPU users on the rank's cores)."""
MIN_REPORTED_CORES = 0.02
"""Below this (2% of one core over the window) a process is noise, not a cause."""
MIN_WINDOW_S = 1.0
"""Shorter windows give no CPU-use numbers: the kernel counts CPU time in 10 ms ticks, so over a window of w
seconds each process's figure is off by up to 0.01 / w cores (a 16 ms epoch made one process use "1.2 cores")."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ProcSample:
    pid: int
    cpu_s: float
    """user + system CPU seconds since the process started."""
    affinity: frozenset[int] | None
    """Cores it may run on; None when unreadable (counted as every core of the host)."""
    create_time: float
    name: str | None = None


def _psutil() -> Any:
    try:
        import psutil
    except ImportError:
        return None
    return psutil


def parse_cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11} (the kernel's cpulist format)."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def numa_nodes_of(cores: Iterable[int], sys_root: str = "/sys/devices/system/node") -> tuple[int, ...] | None:
    """NUMA nodes holding any of these cores; None where the kernel does not expose nodes."""
    wanted = set(cores)
    nodes = []
    for path in sorted(glob.glob(os.path.join(sys_root, "node[0-9]*", "cpulist"))):
        try:
            with open(path, encoding="ascii") as f:
                node_cores = parse_cpulist(f.read())
        except (OSError, ValueError):
            continue
        if node_cores & wanted:
            nodes.append(int(os.path.basename(os.path.dirname(path))[4:]))
    return tuple(sorted(nodes)) or None


def pci_numa_node(bus_id: str, sys_root: str = "/sys/bus/pci/devices") -> int | None:
    """NUMA node of a PCI device from NVML's bus id ('00000000:17:00.0'); None when unknown (-1 in sysfs)."""
    domain, _, rest = bus_id.strip().lower().partition(":")
    name = f"{domain[-4:]}:{rest}" if rest else bus_id.lower()
    try:
        with open(os.path.join(sys_root, name, "numa_node"), encoding="ascii") as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def own_affinity() -> tuple[int, ...] | None:
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return None


def load_avg_1m() -> float | None:
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


def memory() -> tuple[int | None, int | None]:
    """(available, total) host memory in bytes."""
    ps = _psutil()
    if ps is None:
        return None, None
    try:
        vm = ps.virtual_memory()
        return int(vm.available), int(vm.total)
    except Exception:
        return None, None


def per_core_times() -> list[tuple[float, float, float]] | None:
    """(busy seconds, total seconds, steal seconds) per logical core since boot (idle and iowait count as not busy;
    steal, the time a virtual machine's hypervisor ran something else on the core, counts as busy and is given
    apart; 0 where the OS does not report it)."""
    ps = _psutil()
    if ps is None:
        return None
    try:
        out = []
        for t in ps.cpu_times(percpu=True):
            total = sum(t)
            idle = t.idle + getattr(t, "iowait", 0.0)
            out.append((total - idle, total, float(getattr(t, "steal", 0.0))))
        return out
    except Exception:
        return None


def steal_cores(before: list[tuple[float, float, float]] | None, after: list[tuple[float, float, float]] | None,
                cores: Iterable[int]) -> float | None:
    """Cores' worth of time the hypervisor took from these cores between two per_core_times snapshots (each core's
    stolen share of its elapsed time, summed).  On a shared VM host it is what slows every CPU-bound part of the
    job -- the loader's workers first -- while nothing inside the VM looks busier (2x H100: 0.30-0.36
    cores stolen in the launches whose workers built 15% slower than profiled, docs/PERFORMANCE.md)."""
    if before is None or after is None or len(before) != len(after):
        return None
    stolen = 0.0
    for c in cores:
        if 0 <= c < len(after):
            total = after[c][1] - before[c][1]
            if total > 0:
                stolen += max(0.0, after[c][2] - before[c][2]) / total
    return stolen


def busy_fraction(before: Sequence[tuple[float, ...]] | None, after: Sequence[tuple[float, ...]] | None,
                  cores: Iterable[int]) -> float | None:
    """Mean busy fraction of these cores between two per_core_times snapshots."""
    if before is None or after is None or len(before) != len(after):
        return None
    busy = total = 0.0
    for c in cores:
        if 0 <= c < len(after):
            busy += after[c][0] - before[c][0]
            total += after[c][1] - before[c][1]
    return min(1.0, max(0.0, busy / total)) if total > 0 else None


def job_pids(environ: Mapping[str, str] | None = None) -> set[int]:
    """This rank, its descendants and -- when torchrun's agent started it -- the agent and all it started."""
    ps = _psutil()
    pids = {os.getpid()}
    if ps is None:
        return pids
    env = os.environ if environ is None else environ
    try:
        me = ps.Process()
        roots = [me]
        if "TORCHELASTIC_RUN_ID" in env:  # our parent is the elastic agent: its other children are peer ranks
            parent = me.parent()
            if parent is not None:
                roots.append(parent)
                pids.add(parent.pid)
        for root in roots:
            pids.update(c.pid for c in root.children(recursive=True))
    except Exception:
        pass
    return pids


def process_table(exclude: set[int]) -> dict[int, ProcSample] | None:
    """CPU seconds and affinity of every readable process outside ``exclude`` (one pass over /proc)."""
    ps = _psutil()
    if ps is None:
        return None
    out: dict[int, ProcSample] = {}
    try:
        for p in ps.process_iter(["pid", "name", "cpu_times", "cpu_affinity", "create_time"]):
            info = p.info
            times = info.get("cpu_times")
            if info["pid"] in exclude or times is None or info.get("create_time") is None:
                continue
            aff = info.get("cpu_affinity")
            out[info["pid"]] = ProcSample(pid=info["pid"], cpu_s=float(times.user + times.system),
                                          affinity=frozenset(aff) if aff else None,
                                          create_time=float(info["create_time"]), name=info.get("name") or None)
    except Exception:
        return None
    return out


def other_cpu_use(before: Mapping[int, ProcSample], after: Mapping[int, ProcSample], cores: Iterable[int], *,
                  window_s: float, window_start: float, host_cpus: int,
                  top: int = TOP_PROCESSES) -> tuple[float, tuple[CpuProcess, ...]]:
    """(cores' worth of CPU other processes used on these cores, the largest of them) -- see the module docstring.

    A process present only at the end and created inside the window counts from zero; one whose pid was reused
    (another create time) likewise; one gone by the end is not counted (its last seconds are unknown).
    """
    ours = set(cores)
    if window_s <= 0 or not ours:
        return 0.0, ()
    used: list[CpuProcess] = []
    total = 0.0
    for pid, b in after.items():
        a = before.get(pid)
        if a is not None and a.create_time == b.create_time:
            delta = b.cpu_s - a.cpu_s
        elif b.create_time >= window_start:
            delta = b.cpu_s
        else:
            continue  # existed before the window but was not seen then (unreadable): unknown share
        aff = b.affinity if b.affinity else frozenset(range(host_cpus))
        mine = len(aff & ours)
        # Tick rounding can push a short window's figure past what the process could use on these cores.
        cores_used = min(float(mine), max(0.0, delta) * mine / len(aff) / window_s) if aff else 0.0
        if cores_used <= 0:
            continue
        total += cores_used
        used.append(CpuProcess(pid=pid, cpu_cores=round(cores_used, 3), name=b.name))
    used.sort(key=lambda p: -p.cpu_cores)
    return round(total, 3), tuple(p for p in used[:top] if p.cpu_cores >= MIN_REPORTED_CORES)
