"""Epochs of this rank's indices: HeteroBatchSampler vs DistributedSampler + BatchSampler, same run.

For one rank of W with uneven batch sizes (the baseline gets the mean batch size), per sampler:
  - epoch 0 ("cold"): from constructing the sampler to having consumed every batch of the epoch -- nothing could
    be prepared ahead of time;
  - epoch 1 ("steady"): ``set_epoch(1)`` and a full pass, after epoch 0's consumer spent ``--train-s`` seconds
    "training" (a sleep: an epoch over 10^8 samples lasts minutes to hours, so the time between epoch starts is
    never shorter than the shuffle). HeteroBatchSampler builds that shuffle on a background thread
    (``prefetch``); DistributedSampler builds it, and a Python list of N ints, when the epoch starts;
  - the stall at each epoch start: the time to the epoch's first batch, when training waits for the sampler;
  - extra memory per sample: peak RSS growth over the process before construction, over both epochs (catches
    torch tensors, which tracemalloc does not see), divided by N; with ``--trace`` also the tracemalloc peak.

    .venv/bin/python benchmarks/sampler_bench.py                 # N = 10^8, W = 4 (about 1.5 minutes, ~5 GB RAM)
    .venv/bin/python benchmarks/sampler_bench.py --n 1000000     # quick
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import psutil
import torch
from torch.utils.data import BatchSampler, DistributedSampler

from runtime.sampler import HeteroBatchSampler


def _rss() -> int:
    return int(psutil.Process(os.getpid()).memory_info().rss)


def measure(make: Callable[[], Any], *, train_s: float, trace: bool) -> dict[str, float]:
    """Times and memory of building the sampler and consuming epochs 0 and 1 (batches are counted, not kept).

    tracemalloc slows every Python allocation (the baseline makes N int objects), so it runs in its own pass.
    """
    gc.collect()
    rss0 = _rss()
    peak_rss = rss0
    if trace:
        tracemalloc.start()
    out: dict[str, float] = {}
    t_build = time.perf_counter()
    sampler = make()
    for epoch in (0, 1):
        if epoch == 1:
            time.sleep(train_s)  # epoch 0's training, during which a prefetching sampler shuffles epoch 1
            t0 = time.perf_counter()
            inner = sampler.sampler if isinstance(sampler, BatchSampler) else sampler
            inner.set_epoch(1)  # type: ignore[union-attr]
        else:
            t0 = t_build
        num_batches = num_indices = 0
        first = float("nan")
        for i, batch in enumerate(sampler):
            if i == 0:
                first = time.perf_counter() - t0
            num_batches += 1
            num_indices += len(batch)
            if i % 4096 == 0:
                peak_rss = max(peak_rss, _rss())
        out[f"epoch{epoch}_s"] = time.perf_counter() - t0
        out[f"epoch{epoch}_first_batch_s"] = first
        out["batches"], out["indices"] = num_batches, num_indices
        peak_rss = max(peak_rss, _rss())
    out["peak_rss_growth_bytes"] = float(peak_rss - rss0)
    if trace:
        out["peak_traced_bytes"] = float(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    del sampler
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=10**8, help="dataset length N (samples)")
    parser.add_argument("--batch-sizes", default="400,112,300,212", help="per-rank batch sizes, comma-separated")
    parser.add_argument("--rank", type=int, default=1, help="the rank whose indices are produced")
    parser.add_argument("--train-s", type=float, default=5.0, help="seconds of stand-in training between the "
                        "epochs (default 5)")
    parser.add_argument("--skip-baseline", action="store_true", help="do not run DistributedSampler (it needs "
                        "about 40 bytes per sample of Python ints)")
    parser.add_argument("--trace", action="store_true", help="also a tracemalloc pass per sampler (slower)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    n, w = args.n, len(sizes)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    g = torch.Generator()
    g.manual_seed(0)
    t0 = time.perf_counter()
    torch.randperm(n, generator=g, dtype=torch.int32)
    randperm_s = time.perf_counter() - t0
    cpu = platform.processor() or platform.machine()
    print(f"N = {n:,}, W = {w}, batch sizes {sizes}, rank {args.rank}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs ({cpu}); torch.randperm(N) alone: {randperm_s:.2f} s")

    mean_b = round(sum(sizes) / w)
    makers: list[tuple[str, Callable[[], Any]]] = [
        ("HeteroBatchSampler", lambda: HeteroBatchSampler(n, sizes, args.rank, seed=0))]
    if not args.skip_baseline:
        makers.append((f"DistributedSampler+BatchSampler(b={mean_b})", lambda: BatchSampler(
            DistributedSampler(range(n), num_replicas=w, rank=args.rank, seed=0),  # type: ignore[arg-type]
            mean_b, drop_last=False)))
    list(HeteroBatchSampler(10_000, sizes, args.rank))  # warm up allocators and lazy imports outside the numbers
    print(f"{'sampler':44s} {'epoch 0 s':>10s} {'epoch 1 s':>10s} {'stall 0 s':>10s} {'stall 1 s':>10s} "
          f"{'RSS B/smp':>10s} {'traced B/smp':>13s}")
    results: dict[str, Any] = {"n": n, "batch_sizes": sizes, "rank": args.rank, "train_s": args.train_s,
                               "torch": torch.__version__, "cpus": os.cpu_count(), "cpu": cpu,
                               "randperm_s": randperm_s, "samplers": {}}
    for name, make in makers:
        timed = measure(make, train_s=args.train_s, trace=False)
        if args.trace:
            timed["peak_traced_bytes"] = measure(make, train_s=args.train_s, trace=True)["peak_traced_bytes"]
        results["samplers"][name] = timed
        print(f"{name:44s} {timed['epoch0_s']:10.2f} {timed['epoch1_s']:10.2f} {timed['epoch0_first_batch_s']:10.3f} "
              f"{timed['epoch1_first_batch_s']:10.3f} {timed['peak_rss_growth_bytes'] / n:10.2f} "
              f"{timed.get('peak_traced_bytes', float('nan')) / n:13.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
