"""`planner report` on a 200-rank profile: wall and CPU seconds, and the length of the first finding.

    python benchmarks/report_scale.py                      # 3 runs per profile, a markdown table
    python benchmarks/report_scale.py --ranks 200,1000 --repeats 5 --json out.json

Goal: <= 10 s on the 2-core CI box, first finding <= 300 characters. Each run
is a fresh `python -m planner report` process (imports, figures and HTML included), timed from outside; the CPU
seconds are the child's own (getrusage), which a box shared with other jobs inflates less than the wall time,
so both are reported with the load average at the time. Two profiles: "unnamed" (every rank measured apart and
unnamed -- each its own kind, benchmarks/solve_time.py's generator) and "named" (3 device kinds, per-rank noise).
Writes the raw numbers as JSON to --json, or to $OUT/report_scale.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from solve_time import random_profile  # noqa: E402

from planner.profile import (  # noqa: E402
    ComputePoint,
    HostProfile,
    LoaderProfile,
    MemoryPoint,
    MemoryProfile,
    Profile,
    RankProfile,
)


def named_profile(n: int, seed: int = 1) -> Profile:
    """3 named device kinds (A100 / V100 / T4 speeds), +-3% per-rank noise, 8 ranks per host, most hosts short of
    cores for their loaders."""
    rng = np.random.default_rng(seed)
    kinds = (("A100", 4e-5, 0.004, 80e9), ("V100", 8e-5, 0.005, 32e9), ("T4", 2e-4, 0.006, 16e9))
    hosts = tuple(HostProfile(name=f"node{h}", cpu_cores=96 if h < (n + 7) // 40 else 8) for h in range((n + 7) // 8))
    ranks = []
    for r in range(n):
        name, slope, base, cap = kinds[r % 3]
        f = float(rng.uniform(0.97, 1.03))
        ranks.append(RankProfile(
            rank=r, host=f"node{r // 8}", device=f"cuda:{r % 8}", device_name=name,
            compute=tuple(ComputePoint(batch_size=b, step_time_s=f * (base + slope * b)) for b in (16, 64, 256)),
            memory=MemoryProfile(capacity_bytes=int(cap), points=(MemoryPoint(batch_size=16, peak_bytes=1_800_000_000),
                                                                  MemoryPoint(batch_size=256, peak_bytes=13_800_000_000))),
            loader=LoaderProfile(sec_per_sample=0.002 * float(rng.uniform(0.9, 1.1)))))
    return Profile(hosts=hosts, ranks=tuple(ranks))


def run_once(profile_path: Path, global_batch: int, out_dir: Path) -> dict[str, float | int | str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "planner", "report", "--profile", str(profile_path),
                           "--global-batch", str(global_batch), "--out", str(out_dir / "report.html")],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"planner report failed ({proc.returncode}): {proc.stderr[-2000:]}")
    lines = proc.stdout.splitlines()
    first = lines[1].removeprefix("  - ") if len(lines) > 1 else ""
    return {"wall_s": wall, "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "first_finding_chars": len(first), "first_finding": first, "load_avg_1min": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="200", help="comma-separated rank counts (default 200)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-per-rank", type=int, default=256)
    p.add_argument("--json", default=None, help="raw results (default $OUT/report_scale.json when $OUT is set)")
    args = p.parse_args(argv)
    results = []
    print("| profile | ranks | median wall | min-max wall | median CPU | first finding | load avg |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in args.ranks.split(",")]:
            for name, prof in (("unnamed", random_profile(n, loader=True)), ("named", named_profile(n))):
                path = Path(tmp) / f"{name}{n}.json"
                prof.save(path)
                runs = [run_once(path, args.batch_per_rank * n, Path(tmp)) for _ in range(args.repeats)]
                walls = [float(r["wall_s"]) for r in runs]
                cpus = [float(r["cpu_s"]) for r in runs]
                results.append({"profile": name, "ranks": n, "global_batch": args.batch_per_rank * n, "runs": runs})
                print(f"| {name} | {n} | {statistics.median(walls):.1f} s | {min(walls):.1f}-{max(walls):.1f} s | "
                      f"{statistics.median(cpus):.1f} s | {runs[0]['first_finding_chars']} chars | "
                      f"{statistics.median(float(r['load_avg_1min']) for r in runs):.1f} |", flush=True)
    target = args.json or (os.path.join(os.environ["OUT"], "report_scale.json") if os.environ.get("OUT") else None)
    if target:
        Path(target).write_text(json.dumps({"benchmark": "report_scale", "cpu_count": os.cpu_count(),
                                            "results": results}, indent=1) + "\n")
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
