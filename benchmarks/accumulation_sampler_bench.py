"""What micro-batches cost the sampler: one epoch of this rank's indices, with and without accumulation, same run.

Variants, interleaved in rounds (median and min-max over rounds, the same warm-up for all):
  plain        HeteroBatchSampler(batch_sizes), one batch of b_i per step
  micro        HeteroBatchSampler(batch_sizes, accumulation_steps): k_i micro-batches per step
  micro+loop   the same through runtime.accumulate.micro_steps (the MicroStep of every micro-batch)
  stock        DistributedSampler + BatchSampler at this rank's micro-batch size (what a stock accumulation loop
               iterates; equal shards, so only a cost reference)
Shuffled, prefetch off (the shuffle is in every variant's time: torch.randperm(N) once per epoch).

    .venv/bin/python benchmarks/accumulation_sampler_bench.py                # N = 10^7, about a minute
    .venv/bin/python benchmarks/accumulation_sampler_bench.py --n 100000 --rounds 2   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import BatchSampler, DistributedSampler

from runtime.accumulate import micro_steps
from runtime.sampler import HeteroBatchSampler


def timed(make: Callable[[], Iterable[Any]]) -> tuple[float, int, int]:
    """Seconds for one full pass (construction included), the batches and the samples it yielded."""
    t0 = time.perf_counter()
    batches = samples = 0
    for item in make():
        batch = item[0] if isinstance(item, tuple) else item  # micro_steps yields (batch, MicroStep)
        batches += 1
        samples += len(batch)
    return time.perf_counter() - t0, batches, samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=10**7, help="dataset length N (samples)")
    parser.add_argument("--batch-sizes", default="400,112,300,212", help="per-rank batch sizes, comma-separated")
    parser.add_argument("--accumulation-steps", default="4,1,3,2", help="per-rank micro-steps, comma-separated")
    parser.add_argument("--rank", type=int, default=0, help="the rank whose indices are produced")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of every variant")
    parser.add_argument("--json", help="output path (default $OUT/accumulation_sampler.json when OUT is set)")
    args = parser.parse_args(argv)
    sizes = [int(v) for v in args.batch_sizes.split(",")]
    steps = [int(v) for v in args.accumulation_steps.split(",")]
    n, rank, world = args.n, args.rank, len(sizes)
    micro_size = -(-sizes[rank] // steps[rank])

    def hetero(acc: list[int] | None) -> HeteroBatchSampler:
        return HeteroBatchSampler(n, sizes, rank, seed=1, prefetch=False, accumulation_steps=acc)

    def stock() -> Iterable[Any]:
        return BatchSampler(DistributedSampler(range(n), world, rank, seed=1), micro_size, drop_last=False)

    def with_loop() -> Iterable[Any]:
        s = hetero(steps)
        return micro_steps(s, s)

    variants: dict[str, Callable[[], Iterable[Any]]] = {
        "plain": lambda: hetero(None), "micro": lambda: hetero(steps), "micro+loop": with_loop, "stock": stock}
    for make in variants.values():  # warm-up: imports, allocator, first randperm
        timed(make)
    times: dict[str, list[float]] = {k: [] for k in variants}
    counts: dict[str, tuple[int, int]] = {}
    for _ in range(args.rounds):
        for name, make in variants.items():
            seconds, *counts[name] = timed(make)  # type: ignore[assignment]
            times[name].append(seconds)
    result = {
        "kind": "accumulation_sampler_bench", "n": n, "batch_sizes": sizes, "accumulation_steps": steps,
        "rank": rank, "micro_batch_size": micro_size, "rounds": args.rounds, "torch": torch.__version__,
        "host": platform.node(), "cpu_count": os.cpu_count(),
        "variants": {k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v), "batches": counts[k][0],
                         "samples": counts[k][1], "us_per_batch": 1e6 * statistics.median(v) / counts[k][0]}
                     for k, v in times.items()},
    }
    for k, v in result["variants"].items():  # type: ignore[attr-defined]
        print(f"{k:11s} {v['batches']:9d} batches {v['samples']:10d} samples  median {v['median_s']:7.3f} s (min "
              f"{v['min_s']:.3f}, max {v['max_s']:.3f})  {v['us_per_batch']:6.2f} us/batch")
    path = args.json or (os.path.join(os.environ["OUT"], "accumulation_sampler.json") if "OUT" in os.environ else None)
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
