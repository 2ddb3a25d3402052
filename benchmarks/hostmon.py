"""Host monitor for the loader-fed GPU runs: is the drift of the host's loader throughput the host's own (hypervisor
steal, a CPU quota, clock changes, other processes) or our loaders' doing?

On a 2x H100 VM (32 cores) the same split's loader-paced step time moved 9-34% between rounds a minute apart, and
the profile's one-worker loader cost ranged 2.75-4.42 ms a sample over 9 profiles.  This samples, every
--interval seconds until SIGTERM/SIGINT, one JSON line each:

  t, dt        unix time, and seconds since the last sample
  cpu          /proc/stat jiffies since the last sample: user, nice, system, idle, iowait, irq, softirq, steal
  running      procs_running (runnable tasks now)
  cg           cgroup CPU accounting since the last sample: usage_usec, nr_throttled, throttled_usec (v2 or v1)
  mhz          mean "cpu MHz" over /proc/cpuinfo
  top          the 6 processes with the most CPU ticks since the last sample: [pid, comm, ticks]
  probe        fixed work timed on this process's one thread, wall and CPU ms: "pil" (8 bilinear resizes of a
               500x375 RGB image to 224, the loader's kind of work) and "mem" (two 64 MiB copies).  Steal time
               is 0 on these VMs and the MHz reported is fixed, so a core's real speed shows only as fixed work
               taking longer; CPU ms close to wall ms means the thread was not preempted, it ran slower

and a first line of static facts (cores, affinity, CPU quota, threads per core, NUMA nodes, /dev/shm, model).  ``--summarize`` reads such
a file, with optional ``--marks`` (lines "unix_time label"), and prints per-window busy / steal / throttled / MHz.

    python benchmarks/hostmon.py --out host.jsonl [--interval 1] &   ...   kill %1
    python benchmarks/hostmon.py --summarize host.jsonl [--window 10] [--marks marks.txt]
    python benchmarks/hostmon.py --summarize host.jsonl --bench bench.json   # per timed window of the bench
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def proc_stat() -> tuple[list[int], int]:
    """Aggregate CPU jiffies (CPU_FIELDS order) and procs_running from /proc/stat."""
    cpu: list[int] = [0] * len(CPU_FIELDS)
    running = 0
    for line in (_read("/proc/stat") or "").splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            cpu = [int(x) for x in parts[1:1 + len(CPU_FIELDS)]]
        elif parts and parts[0] == "procs_running":
            running = int(parts[1])
    return cpu, running


def cgroup_cpu() -> dict[str, int]:
    """usage_usec, nr_throttled, throttled_usec of this cgroup (v2 cpu.stat, else v1 cpuacct / cpu.stat)."""
    out: dict[str, int] = {}
    text = _read("/sys/fs/cgroup/cpu.stat")
    if text is not None:
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k in ("usage_usec", "nr_throttled", "throttled_usec"):
                out[k] = int(v)
        return out
    usage = _read("/sys/fs/cgroup/cpuacct/cpuacct.usage") or _read("/sys/fs/cgroup/cpu,cpuacct/cpuacct.usage")
    if usage:
        out["usage_usec"] = int(usage) // 1000
    for p in ("/sys/fs/cgroup/cpu/cpu.stat", "/sys/fs/cgroup/cpu,cpuacct/cpu.stat"):
        text = _read(p)
        if text:
            for line in text.splitlines():
                k, _, v = line.partition(" ")
                if k == "nr_throttled":
                    out[k] = int(v)
                elif k == "throttled_time":
                    out["throttled_usec"] = int(v) // 1000
            break
    return out


def mean_mhz() -> float | None:
    vals = [float(line.split(":")[1]) for line in (_read("/proc/cpuinfo") or "").splitlines()
            if line.startswith("cpu MHz")]
    return round(statistics.fmean(vals), 1) if vals else None


def proc_ticks() -> dict[int, tuple[str, int]]:
    """utime + stime ticks and comm of every process."""
    out: dict[int, tuple[str, int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        text = _read(f"/proc/{d}/stat")
        if not text:
            continue
        lpar, rpar = text.find("("), text.rfind(")")
        rest = text[rpar + 2:].split()
        try:
            out[int(d)] = (text[lpar + 1:rpar], int(rest[11]) + int(rest[12]))
        except (IndexError, ValueError):
            continue
    return out


class Probe:
    """Fixed single-thread work, timed: the loader's kind (PIL resizes) and a memory copy."""

    def __init__(self) -> None:
        import random

        try:
            from PIL import Image
        except ImportError:  # the probe is optional
            self.image = None
        else:
            rng = random.Random(0)
            self.image = Image.frombytes("RGB", (500, 375), bytes(rng.getrandbits(8) for _ in range(500 * 375 * 3)))
        self.buf = bytearray(64 << 20)

    def _pil(self) -> None:
        if self.image is not None:
            from PIL import Image

            for _ in range(8):
                self.image.resize((224, 224), Image.Resampling.BILINEAR).tobytes()

    def _mem(self) -> None:
        for _ in range(2):
            bytes(self.buf)

    def __call__(self) -> dict[str, list[float]]:
        out = {}
        for name, work in (("pil", self._pil), ("mem", self._mem)):
            w, c = time.perf_counter(), time.process_time()
            work()
            out[name] = [round(1e3 * (time.perf_counter() - w), 2), round(1e3 * (time.process_time() - c), 2)]
        return out


def facts() -> dict[str, Any]:
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    model = next((line.split(":", 1)[1].strip() for line in (_read("/proc/cpuinfo") or "").splitlines()
                  if line.startswith("model name")), None)
    siblings = (_read("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list") or "").strip()
    quota = (_read("/sys/fs/cgroup/cpu.max") or _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") or "").strip()
    nodes = {d: (_read(f"/sys/devices/system/node/{d}/cpulist") or "").strip()
             for d in sorted(os.listdir("/sys/devices/system/node")) if d.startswith("node")} \
        if os.path.isdir("/sys/devices/system/node") else {}
    try:
        shm = shutil.disk_usage("/dev/shm")._asdict()
    except OSError:
        shm = None
    mem = next((line for line in (_read("/proc/meminfo") or "").splitlines() if line.startswith("MemTotal")), "")
    return {"facts": True, "t": time.time(), "cpu_count": os.cpu_count(), "affinity": affinity, "cpu_max": quota,
            "cpu0_thread_siblings": siblings, "numa_nodes": nodes, "dev_shm": shm, "model": model, "mem": mem, "kernel": platform.release(),
            "loadavg": (_read("/proc/loadavg") or "").strip()}


def monitor(out: Path, interval: float) -> None:
    stop = False

    def _stop(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    with out.open("a") as f:
        f.write(json.dumps(facts()) + "\n")
        f.flush()
        cpu0, _ = proc_stat()
        cg0 = cgroup_cpu()
        ticks0 = proc_ticks()
        probe = Probe()
        probe()  # warm
        last = time.time()
        while not stop:
            time.sleep(interval)
            now = time.time()
            cpu, running = proc_stat()
            cg = cgroup_cpu()
            ticks = proc_ticks()
            probed = probe()
            top = sorted(((pid, comm, t - ticks0.get(pid, (comm, 0))[1]) for pid, (comm, t) in ticks.items()),
                         key=lambda x: -x[2])[:6]
            f.write(json.dumps({"t": round(now, 3), "dt": round(now - last, 3), "cpu": [a - b for a, b in zip(cpu, cpu0, strict=True)],
                                "running": running, "cg": {k: v - cg0.get(k, 0) for k, v in cg.items()},
                                "mhz": mean_mhz(), "top": [list(x) for x in top if x[2] > 0],
                                "probe": probed}) + "\n")
            f.flush()
            cpu0, cg0, ticks0, last = cpu, cg, ticks, now


def _busy_fraction(group: list[dict[str, Any]]) -> tuple[list[int], float]:
    """The samples' summed CPU jiffies (CPU_FIELDS order) and the share of them neither idle nor iowait."""
    tot = [sum(s["cpu"][i] for s in group) for i in range(len(CPU_FIELDS))]
    return tot, (sum(tot) - tot[3] - tot[4]) / max(sum(tot), 1)


def _probe_medians(group: list[dict[str, Any]]) -> dict[str, float]:
    return {f"{name}_ms": round(statistics.median([s["probe"][name][0] for s in group if "probe" in s] or [0]), 2)
            for name in ("pil", "mem")}


def summarize(path: Path, window: float, marks: Path | None) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    head = lines[0] if lines and lines[0].get("facts") else {}
    samples = [x for x in lines if "cpu" in x]
    labels = []
    if marks and marks.exists():
        for line in marks.read_text().splitlines():
            t, _, label = line.partition(" ")
            labels.append((float(t), label.strip()))
    rows: list[dict[str, Any]] = []
    if not samples:
        return rows
    t0 = samples[0]["t"]
    k = 0
    while k < len(samples):
        group = [s for s in samples[k:] if s["t"] < samples[k]["t"] + window]
        k += len(group)
        tot, busy = _busy_fraction(group)
        all_ = max(sum(tot), 1)
        secs = max(sum(s["dt"] for s in group), 1e-9)
        cores = (head.get("affinity") or head.get("cpu_count") or 1)
        label = next((lab for t, lab in reversed(labels) if t <= group[-1]["t"]), "")
        rows.append({"t": round(group[0]["t"] - t0, 1), "label": label,
                     "busy_cores": round(cores * busy, 2),
                     "steal_pct": round(100 * tot[7] / all_, 2),
                     "throttled_ms_per_s": round(sum(s["cg"].get("throttled_usec", 0) for s in group) / 1e3 / secs, 1),
                     "mhz": round(statistics.fmean([s["mhz"] for s in group if s.get("mhz")] or [0]), 0),
                     "running": round(statistics.fmean([s["running"] for s in group]), 1),
                     **_probe_medians(group)})
    return rows


def bench_windows(path: Path, bench: Path) -> list[dict[str, Any]]:
    """Per timed window of a `planner bench` JSON (its "unix" ends): the window's samples/s beside the host
    samples inside it -- median probe ms (PIL, memory), busy cores, runnable tasks."""
    samples = [x for x in map(json.loads, path.read_text().splitlines()) if "cpu" in x]
    data = json.loads(bench.read_text())
    rows = []
    for name, res in data.items():
        if not isinstance(res, dict) or "rounds_window" not in res:
            continue
        for k, w in enumerate(res["rounds_window"]):
            if "unix" not in w:
                continue
            inside = [x for x in samples if w["unix"][0] <= x["t"] - x["dt"] and x["t"] <= w["unix"][1]]
            row: dict[str, Any] = {"strategy": name, "round": k + 1, "samples_per_s": round(w["samples_per_s"], 1),
                                   "step_ms": round(1e3 * w["seconds"] / w["steps"], 1), "host_samples": len(inside)}
            if inside:
                row["busy_frac"] = round(_busy_fraction(inside)[1], 3)
                if any("probe" in x for x in inside):
                    row.update(_probe_medians(inside))
            rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="JSONL to write while monitoring")
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--summarize", type=Path, help="a JSONL written by --out")
    ap.add_argument("--window", type=float, default=10.0)
    ap.add_argument("--marks", type=Path)
    ap.add_argument("--bench", type=Path, help="with --summarize: a planner bench JSON whose windows to line up")
    args = ap.parse_args()
    if args.summarize:
        head = json.loads(args.summarize.read_text().splitlines()[0])
        print(json.dumps(head))
        if args.bench:
            for row in bench_windows(args.summarize, args.bench):
                print(json.dumps(row))
            return 0
        for row in summarize(args.summarize, args.window, args.marks):
            print(json.dumps(row))
        return 0
    if not args.out:
        ap.error("--out or --summarize is needed")
    monitor(args.out, args.interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
