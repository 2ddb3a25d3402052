"""Solve time of planner.solve for 8 .. 4096 ranks (goal: <= 50 ms at 64 ranks, <= 1 s at 4096, 2-core CPU).

    python benchmarks/solve_time.py                   # prints a markdown table
    python benchmarks/solve_time.py --ranks 8,64 --repeats 3

Profiles are random but realistic: GPUs 1-4x apart, flat-then-linear step curves measured at 4 batch sizes,
memory caps, 8 ranks per host with 8-64 cores; `loader` adds per-sample loader costs large enough that some
hosts run short of cores (the harder, two-step case).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

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


def random_profile(n: int, *, loader: bool, seed: int = 0) -> Profile:
    rng = np.random.default_rng(seed)
    hosts = tuple(HostProfile(name=f"h{i}", cpu_cores=int(rng.integers(8, 64))) for i in range((n + 7) // 8))
    ranks = []
    for i in range(n):
        f = float(rng.uniform(1, 4))
        base, slope = float(rng.uniform(0.003, 0.01)), float(rng.uniform(5e-5, 3e-4))
        compute = tuple(ComputePoint(batch_size=b, step_time_s=f * (base + slope * max(b, 32))) for b in (8, 32, 128, 512))
        mem = MemoryProfile(capacity_bytes=int(rng.uniform(16e9, 80e9)),
                            points=(MemoryPoint(batch_size=32, peak_bytes=2_000_000_000),
                                    MemoryPoint(batch_size=512, peak_bytes=20_000_000_000)))
        ld = LoaderProfile(sec_per_sample=float(rng.uniform(1e-4, 2e-3))) if loader else None
        ranks.append(RankProfile(rank=i, host=f"h{i // 8}", device=f"cuda:{i % 8}", compute=compute, memory=mem,
                                 loader=ld))
    return Profile(hosts=hosts, ranks=tuple(ranks))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="8,64,1024,4096")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch-per-rank", type=int, default=256)
    args = p.parse_args(argv)
    print("| ranks | loaders | median solve | min | max | method | plan / ideal |")
    print("|---|---|---|---|---|---|---|")
    for n in [int(x) for x in args.ranks.split(",")]:
        for loader in (False, True):
            prof = random_profile(n, loader=loader)
            times, plan = [], None
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                plan = planner.solve(prof, global_batch=args.batch_per_rank * n)
                times.append(time.perf_counter() - t0)
            assert plan is not None
            ratio = plan.predicted.samples_per_s / plan.predicted.ideal_samples_per_s
            print(f"| {n} | {'yes' if loader else 'no'} | {1000 * statistics.median(times):.1f} ms | "
                  f"{1000 * min(times):.1f} ms | {1000 * max(times):.1f} ms | {plan.solver['method']} | {ratio:.3f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
