"""How fast a DataLoader can hand finished batches to the training process (#18; docs/BENCHMARKS.md section 19).

Session 10, 2x H100: rank 0's 28 workers built a batch of 455 ResNet-50 samples in 2.7-3.4 s (103-125 ms a step
between them) but the batches reached the training loop at 150-195 ms a step.  The difference is on the training
process's side -- receiving each batch from shared memory and copying it into pinned memory (283 MB of float32 per
batch) -- or in-order delivery behind a late worker.  This probe takes the workers' build cost away: each worker
returns a batch it made once (a fresh shared-memory tensor per batch, as collate makes), so what is timed is the
hand-over alone, in batches/s delivered to the loop, with and without ``pin_memory``.  The loop touches nothing.

    python benchmarks/handover_probe.py [--batch 455] [--workers 4,16,28] [--batches 60] [--json out.json]
    python benchmarks/handover_probe.py --batch 32,128,455 --workers 28 --load 24 --pin-only  # under load
    python benchmarks/handover_probe.py --batch 476 --workers 28 --load 24 --pin-only --pin-ahead 1,4

``--batch`` takes a list (the profile's loader scan pins 32-sample batches, training 300 MB ones); ``--load N``
keeps N more processes resizing images meanwhile, as a training host's busy workers do (session 11: the pin
thread handed 274-298 MB batches over at 2.8-3.2 GB/s on an idle host and at about 2.3 GB/s in training, and the
profile's scan read 3.97 GB/s on 19 MB batches); ``--pin-only`` keeps the pin-thread rows without the copy to
the GPU.

With a GPU each setting also runs with every batch copied to it on a side stream (``to_gpu``, waited for: the
copy from pinned memory, or from the workers' shared memory without the pin thread).

Rows: workers, pin_memory, to_gpu, batches_per_s, gb_per_s and ms_per_batch, each the mean over the timed batches (they
arrive in bursts), after 2 x workers untimed ones; ``pinned_in_window``: page-locked blocks the pinned-host pool
created during the timed batches and the milliseconds they took (pytorch#97432), and the pool's size after.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import multiprocessing as mp
import os
import sys
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class PremadeBatches(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """dataset[index list] -> a (b, 3, side, side) float32 batch and its labels, copied from one made at start:
    the copy is what collate's output costs a worker to write into shared memory, without the PIL transforms."""

    def __init__(self, batch: int, side: int) -> None:
        self.x = torch.randn(batch, 3, side, side)
        self.y = torch.zeros(batch, dtype=torch.long)

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, indices: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x.clone(), self.y.clone()


def measure(batch: int, side: int, workers: int, pin: bool, batches: int, warmup: int,
            to_gpu: bool = False, pin_ahead: int | None = None) -> dict[str, Any]:
    ds = PremadeBatches(batch, side)
    sampler = [list(range(batch))] * (batches + warmup)
    loader = DataLoader(ds, sampler=sampler, batch_size=None, num_workers=workers,
                        pin_memory=pin and pin_ahead is None, prefetch_factor=4 if workers else None)
    it: Any = iter(loader)
    if pin and pin_ahead is not None:  # as `planner train` pins: runtime.pinning.PinAhead, pin_ahead copy threads
        from runtime.pinning import PinAhead, pin_tree

        it = PinAhead(it, torch.device("cuda", torch.cuda.current_device()),
                      pin=functools.partial(pin_tree, threads=pin_ahead))
    for _ in range(warmup):
        next(it)
    stream = torch.cuda.Stream() if to_gpu else None
    before = _pinned()
    t0 = time.perf_counter()
    for _ in range(batches):
        x, _y = next(it)
        if stream is not None:  # as planner.cli.steps.DeviceCopy: on a side stream; here waited for, to time it whole
            with torch.cuda.stream(stream):
                x.to("cuda", non_blocking=True)
            stream.synchronize()
    dt = time.perf_counter() - t0
    after = _pinned()
    if hasattr(it, "close"):
        it.close()
    del it, loader
    nbytes = x.numel() * x.element_size()
    pinned = ({k: round(after[k] - before[k], 3) for k in ("allocs", "alloc_ms")} | {"pool_mb": after["pool_mb"]}
              if before is not None and after is not None else None)
    return {"pinned_in_window": pinned, "pin_ahead_threads": pin_ahead if pin else None, "batch": batch, "workers": workers, "pin_memory": pin, "to_gpu": to_gpu, "batches": batches,
            "batches_per_s": round(batches / dt, 2), "ms_per_batch": round(1e3 * dt / batches, 1),
            "gb_per_s": round(batches * nbytes / dt / 1e9, 2), "batch_mb": round(nbytes / 1e6, 1)}


def _pinned() -> dict[str, float] | None:
    """The pinned-host pool's counters (planner.cli.steps.pinned_pool_stats), to tell whether the timed window still
    created page-locked blocks (cudaHostAlloc) or ran on the pool's reused ones."""
    from planner.cli.steps import pinned_pool_stats

    return pinned_pool_stats(torch.device("cuda"))


def _busy(stop: Any) -> None:
    """One image-resizing process until ``stop`` is set: a loader worker's kind of load."""
    from PIL import Image

    img = Image.new("RGB", (500, 375), (120, 80, 40))
    while not stop.is_set():
        img.resize((224, 224)).tobytes()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="455", help="samples a batch, a list: 32,128,455")
    ap.add_argument("--load", type=int, default=0, help="processes resizing images meanwhile (default 0)")
    ap.add_argument("--pin-only", action="store_true", help="only the pin thread's rows (no copy to the GPU)")
    ap.add_argument("--pin-ahead", default="",
                    help="also pin as `planner train` does (runtime.pinning.PinAhead), a list of copy threads: 1,4")
    ap.add_argument("--side", type=int, default=224)
    ap.add_argument("--workers", default="4,16,28")
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--json")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    settings = [(True, False)] if args.pin_only and cuda else [
        (pin, to_gpu) for pin in ([False, True] if cuda else [False]) for to_gpu in ([False, True] if cuda else [False])]
    out: dict[str, Any] = {"torch": torch.__version__, "cpus": os.cpu_count(), "load": args.load, "rows": []}
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    burners = [ctx.Process(target=_busy, args=(stop,), daemon=True) for _ in range(args.load)]
    for p in burners:
        p.start()
    try:
        for batch in (int(v) for v in args.batch.split(",")):
            for w in (int(v) for v in args.workers.split(",")):
                ahead = [None] + [int(v) for v in args.pin_ahead.split(",") if v] if cuda else [None]
                for (pin, to_gpu), threads in itertools.product(settings, ahead):
                    if threads is not None and not pin:
                        continue
                    row = {**measure(batch, args.side, w, pin, args.batches, 2 * w, to_gpu, threads),
                           "load": args.load}
                    out["rows"].append(row)
                    print(json.dumps(row), flush=True)
    finally:
        stop.set()
        for p in burners:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
