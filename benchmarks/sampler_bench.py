"""One epoch of this rank's indices: HeteroBatchSampler vs DistributedSampler + BatchSampler, same run.

Measures, for one rank of W with uneven batch sizes (the baseline gets the mean batch size):
  - build + iterate time: from constructing the sampler to having consumed every batch of one epoch;
  - extra memory per sample: peak RSS growth over the process before construction (catches torch tensors, which
    tracemalloc does not see) and the tracemalloc peak (Python objects: lists of ints), each divided by N.

    .venv/bin/python benchmarks/sampler_bench.py                 # N = 10^8, W = 4 (about a minute, ~5 GB RAM)
    .venv/bin/python benchmarks/sampler_bench.py --n 1000000     # quick
"""

from __future__ import annotations

import argparse
import gc
import os
import time
import tracemalloc
from collections.abc import Callable, Iterable

import psutil
import torch
from torch.utils.data import BatchSampler, DistributedSampler

from runtime.sampler import HeteroBatchSampler


def _rss() -> int:
    return int(psutil.Process(os.getpid()).memory_info().rss)


def measure(make: Callable[[], Iterable[list[int]]], *, trace: bool) -> dict[str, float]:
    """Time and memory of building the sampler and iterating one epoch (batches are consumed, not kept).

    tracemalloc slows every Python allocation (the baseline makes N int objects), so it runs in its own pass.
    """
    gc.collect()
    rss0 = _rss()
    peak_rss = rss0
    if trace:
        tracemalloc.start()
    t0 = time.perf_counter()
    sampler = make()
    num_batches = num_indices = 0
    for i, batch in enumerate(sampler):
        num_batches += 1
        num_indices += len(batch)
        if i % 4096 == 0:
            peak_rss = max(peak_rss, _rss())
    elapsed = time.perf_counter() - t0
    peak_rss = max(peak_rss, _rss())
    peak_traced = 0
    if trace:
        _, peak_traced = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    del sampler
    return {"seconds": elapsed, "peak_traced_bytes": float(peak_traced), "peak_rss_growth_bytes": float(peak_rss - rss0),
            "batches": num_batches, "indices": num_indices}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=10**8, help="dataset length N (samples)")
    parser.add_argument("--batch-sizes", default="400,112,300,212", help="per-rank batch sizes, comma-separated")
    parser.add_argument("--rank", type=int, default=1, help="the rank whose indices are produced")
    parser.add_argument("--skip-baseline", action="store_true", help="do not run DistributedSampler (it needs "
                        "about 40 bytes per sample of Python ints)")
    parser.add_argument("--trace", action="store_true", help="also a tracemalloc pass per sampler (slower)")
    args = parser.parse_args(argv)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    n, w = args.n, len(sizes)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    print(f"N = {n:,}, W = {w}, batch sizes {sizes}, rank {args.rank}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs")

    mean_b = round(sum(sizes) / w)
    makers: list[tuple[str, Callable[[], Iterable[list[int]]]]] = [
        ("HeteroBatchSampler", lambda: HeteroBatchSampler(n, sizes, args.rank, seed=0))]
    if not args.skip_baseline:
        makers.append((f"DistributedSampler+BatchSampler(b={mean_b})", lambda: BatchSampler(
            DistributedSampler(range(n), num_replicas=w, rank=args.rank, seed=0),  # type: ignore[arg-type]
            mean_b, drop_last=False)))
    list(HeteroBatchSampler(10_000, sizes, args.rank))  # warm up allocators and lazy imports outside the numbers
    print(f"{'sampler':44s} {'build+iterate s':>16s} {'RSS B/sample':>13s} {'traced B/sample':>16s} {'batches':>8s}")
    for name, make in makers:
        timed = measure(make, trace=False)
        traced = measure(make, trace=True) if args.trace else {"peak_traced_bytes": float("nan")}
        print(f"{name:44s} {timed['seconds']:16.2f} {timed['peak_rss_growth_bytes'] / n:13.2f} "
              f"{traced['peak_traced_bytes'] / n:16.2f} {int(timed['batches']):8d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
