"""Solve time of planner.solve for 8 .. 4096 ranks (goal: <= 50 ms at 64 ranks, <= 1 s at 4096, 2-core CPU).

    python benchmarks/solve_time.py                   # prints two markdown tables
    python benchmarks/solve_time.py --ranks 8,64 --repeats 3 --json solve_time.json

Profiles are random but realistic: GPUs 1-4x apart, flat-then-linear step curves measured at 4 batch sizes,
memory caps, 8 ranks per host with 8-64 cores; `loader` adds per-sample loader costs large enough that some
hosts run short of cores (the harder, two-step case).  At 256 samples per rank the fast GPUs' memory caps bind,
so the planner lets some of them accumulate (the "micro-steps" column: ranks that do / the most any runs).

The second table is a memory-heterogeneous cluster: a global batch 1.5x what the ranks' memory holds in one step
(GPUs of 16-80 GB, the same 1-4x speed spread), solved under ddp (micro-steps per rank) and fsdp (the same K on
every rank).  Beside the solve time it gives the predicted throughput against two baselines: the equal split with
the fewest micro-steps each rank needs, and what users do by hand today -- the same micro-batch at the smallest
cap and the same accumulation everywhere (planner.solve.equal_accumulation_split).

Raw results go to --json PATH, or to $OUT/solve_time.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import planner
from planner.profile import (
    ComputePoint,
    HostProfile,
    LoaderProfile,
    MemoryPoint,
    MemoryProfile,
    Profile,
    RankProfile,
)
from planner.solve import build_models, equal_accumulation_split


def random_profile(n: int, *, loader: bool, seed: int = 0, capacity_gb: tuple[float, float] = (16, 80)) -> Profile:
    rng = np.random.default_rng(seed)
    hosts = tuple(HostProfile(name=f"h{i}", cpu_cores=int(rng.integers(8, 64))) for i in range((n + 7) // 8))
    ranks = []
    for i in range(n):
        f = float(rng.uniform(1, 4))
        base, slope = float(rng.uniform(0.003, 0.01)), float(rng.uniform(5e-5, 3e-4))
        compute = tuple(ComputePoint(batch_size=b, step_time_s=f * (base + slope * max(b, 32))) for b in (8, 32, 128, 512))
        mem = MemoryProfile(capacity_bytes=int(rng.uniform(*capacity_gb) * 1e9),
                            points=(MemoryPoint(batch_size=32, peak_bytes=2_000_000_000),
                                    MemoryPoint(batch_size=512, peak_bytes=20_000_000_000)))
        ld = LoaderProfile(sec_per_sample=float(rng.uniform(1e-4, 2e-3))) if loader else None
        ranks.append(RankProfile(rank=i, host=f"h{i // 8}", device=f"cuda:{i % 8}", compute=compute, memory=mem,
                                 loader=ld))
    return Profile(hosts=hosts, ranks=tuple(ranks))


def _time(prof: Profile, B: int, repeats: int, **options: Any) -> tuple[list[float], list[float], planner.Plan]:
    """(wall times, CPU times, plan): on a shared machine the wall time counts other jobs' turns too."""
    wall, cpu, plan = [], [], None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        plan = planner.solve(prof, global_batch=B, **options)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    assert plan is not None
    return wall, cpu, plan


def _steps(plan: planner.Plan) -> str:
    k = plan.accumulation_steps
    return f"{sum(x > 1 for x in k)} / {max(k)}"


def _ms(times: list[float], cpu: list[float]) -> str:
    return (f"{1000 * statistics.median(times):.1f} ms | {1000 * min(times):.1f} ms | {1000 * max(times):.1f} ms | "
            f"{1000 * statistics.median(cpu):.1f} ms")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="8,64,1024,4096")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch-per-rank", type=int, default=256)
    p.add_argument("--json", default=None, metavar="PATH", help="raw results (default: $OUT/solve_time.json if set)")
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.ranks.split(",")]
    rows: list[dict[str, Any]] = []

    print("| ranks | loaders | median solve | min | max | median CPU | method | micro-steps | plan / ideal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in sizes:
        for loader in (False, True):
            prof = random_profile(n, loader=loader)
            times, cpu, plan = _time(prof, args.batch_per_rank * n, args.repeats)
            ratio = plan.predicted.samples_per_s / plan.predicted.ideal_samples_per_s
            print(f"| {n} | {'yes' if loader else 'no'} | {_ms(times, cpu)} | {plan.solver['method']} | {_steps(plan)} | "
                  f"{ratio:.3f} |", flush=True)
            rows.append({"table": "random", "ranks": n, "loaders": loader, "solve_s": times, "cpu_s": cpu,
                         "method": plan.solver["method"], "accumulation_steps_max": max(plan.accumulation_steps),
                         "accumulating_ranks": sum(k > 1 for k in plan.accumulation_steps),
                         "plan_over_ideal": ratio})

    print("\nmemory-heterogeneous, global batch 1.5x the sum of the memory caps")
    print("| ranks | mode | median solve | min | max | median CPU | micro-steps | plan / equal split | "
          "plan / same micro-batch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in sizes:
        prof = random_profile(n, loader=False, seed=1)
        caps = sum(m.cap or 0 for m in build_models(prof, planner.SolveOptions()))
        B = int(1.5 * caps)
        for mode in ("ddp", "fsdp"):
            times, cpu, plan = _time(prof, B, args.repeats, mode=mode)
            eq = plan.predicted.equal_split_samples_per_s
            hand = equal_accumulation_split(prof, B, mode=mode).predicted.samples_per_s
            x = plan.predicted.samples_per_s
            print(f"| {n} | {mode} | {_ms(times, cpu)} | {_steps(plan)} | {x / eq:.2f}x | {x / hand:.2f}x |",
                  flush=True)
            rows.append({"table": "memory", "ranks": n, "mode": mode, "global_batch": B, "sum_of_caps": caps,
                         "solve_s": times, "cpu_s": cpu, "method": plan.solver["method"],
                         "accumulation_steps_max": max(plan.accumulation_steps),
                         "accumulating_ranks": sum(k > 1 for k in plan.accumulation_steps),
                         "plan_samples_per_s": x, "equal_split_samples_per_s": eq,
                         "equal_accumulation_samples_per_s": hand})

    out = args.json or (str(Path(os.environ["OUT"]) / "solve_time.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps({"machine": platform.platform(), "cpu_count": os.cpu_count(),
                                         "repeats": args.repeats, "rows": rows}, indent=1) + "\n")
        print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
