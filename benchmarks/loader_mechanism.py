"""Why the profiled loader cost misses the training loader's (#16 item 3, #18): CPU only, no GPU needed.

Session 6, 2x H200, `planner bench --data loader --emulate-loader 1=2` (ResNet-50 fake 224, PIL transforms): the
profile's worker-timed scaling curve put 10 concurrent workers at 315 samples/s each, so the plan [410, 102] was
predicted at 168 ms a step; it ran 133.5 ms, every worker at ~383 samples/s -- faster than the curve's own one-worker
point (298) and as fast as the in-process reading (2.69 ms a sample, 372/s).  The equal split's 2 workers at batch
256 ran at ~343/s each.  Candidate causes, each measured here on the same pipeline:

  warm-up   a fresh worker is slow for a while (copy-on-write faults, allocator): the scaling run times 1 s right
            after each worker's first batch, training runs for minutes with persistent workers
  batch     per-sample cost depends on the batch a worker builds (32 in the scaling run, 102..410 in training)
  together  two loaders at once, 8 workers x 410 and 2 workers x 102 (the plan's), each worker timed
  drift     (session 8) one loader alone for --drift-s seconds, then the session-8 plan's two loaders together
            (16 workers x 455 and 2 x 57), each loader's delivered samples/s per 2 s: the 2x H100 host's loader
            throughput moved 10-30% within a bench launch (docs/BENCHMARKS.md section 16) -- this says whether one
            loader alone drifts as much (the host) or only two together do (their contention)

    python benchmarks/loader_mechanism.py [--json out.json] [--seconds 3] [--drift-s 40] [--drift-only]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch.utils.data import BatchSampler, DataLoader, RandomSampler

from profiler.loader import LoaderOptions, _BuildTimed, measure_sample_cost, measure_scaling, usable_cores
from profiler.workloads.specs import build_workload


def rate_series(stamps: list[float], batch: int, bin_s: float) -> list[float]:
    """Delivered samples/s in each whole ``bin_s`` window after the first (start-up) one."""
    n = int(stamps[-1] // bin_s) if stamps else 0
    counts = [0] * n
    for t in stamps:
        k = int(t // bin_s)
        if k < n:
            counts[k] += 1
    return [round(c * batch / bin_s, 1) for c in counts[1:]]


def run_loader(dataset: Any, workers: int, batch: int, seconds: float, out: dict[str, Any],
               persistent: bool = True, bin_s: float | None = None) -> None:
    """Iterate a worker-timed DataLoader for ``seconds``; per-sample build seconds of every batch, in order
    (and, with ``bin_s``, the delivered samples/s per window and their spread, max / min - 1)."""
    timed = _BuildTimed(dataset, __import__("torch").utils.data.default_collate)
    if len(dataset) < batch:  # no whole batch: the epoch loop below would never reach ``seconds``
        raise SystemExit(f"loader_mechanism: a dataset of {len(dataset)} samples holds no batch of {batch}")
    sampler = BatchSampler(RandomSampler(range(len(dataset))), batch, drop_last=True)
    loader = DataLoader(timed, sampler=sampler, batch_size=None, num_workers=workers,
                        persistent_workers=persistent, prefetch_factor=4)
    per_sample: list[float] = []
    t0 = time.perf_counter()
    stamps: list[float] = []
    # Epoch after epoch until ``seconds`` (session 9: 16 x 455 ran out of its 25,600 samples after 11 s of a 40 s
    # drift run, and the 2-worker loader beside it ran alone from then on).
    while not stamps or stamps[-1] < seconds:
        it = iter(loader)
        try:
            for _b, s in it:
                per_sample.append(float(s) / batch)
                stamps.append(time.perf_counter() - t0)
                if stamps[-1] >= seconds:
                    break
        finally:
            del it
    first = [x for x, t in zip(per_sample, stamps, strict=True) if t < 1.0]
    last = [x for x, t in zip(per_sample, stamps, strict=True) if t >= seconds / 2]
    out.update(workers=workers, batch=batch, batches=len(per_sample),
               delivered_samples_per_s=batch * len(per_sample) / max(stamps[-1], 1e-9) if stamps else 0.0,
               ms_per_sample_first_s=1e3 * statistics.median(first) if first else None,
               ms_per_sample_second_half=1e3 * statistics.median(last) if last else None,
               ms_per_sample_all=1e3 * statistics.median(per_sample) if per_sample else None)
    if bin_s:
        series = rate_series(stamps, batch, bin_s)
        out.update(bin_s=bin_s, samples_per_s_series=series,
                   series_spread=round(max(series) / min(series) - 1, 4) if series and min(series) > 0 else None)


def together(dataset: Any, loaders: list[tuple[int, int]], seconds: float,
             bin_s: float | None = None) -> dict[str, dict[str, Any]]:
    """``run_loader`` for each (workers, batch) at the same time, one thread each; results by "WxB"."""
    out: dict[str, dict[str, Any]] = {f"{w}x{b}": {} for w, b in loaders}
    threads = [threading.Thread(target=run_loader, args=(dataset, w, b, seconds, out[f"{w}x{b}"]),
                                kwargs={"bin_s": bin_s}) for w, b in loaders]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def measure_parts(ds: Any, seconds: float, res: dict[str, Any]) -> None:
    """The warm-up, batch-size and two-loaders parts (session 6's questions), into ``res``."""
    res["warmup"] = []
    for w in (1, 2, 8):
        r: dict[str, Any] = {}
        run_loader(ds, w, 32, seconds, r)
        res["warmup"].append(r)
        print("warmup", json.dumps(r), flush=True)
    res["batch"] = []
    for b in (32, 102, 256):
        r = {}
        run_loader(ds, 2, b, seconds, r)
        res["batch"].append(r)
        print("batch", json.dumps(r), flush=True)
    res["together"] = together(ds, [(8, 410), (2, 102)], seconds + 1)
    print("together", json.dumps(res["together"]), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "loader_mechanism.json"))
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--num-samples", type=int, default=25600)
    ap.add_argument("--drift-s", type=float, default=40.0, help="seconds of each drift run (0: skip)")
    ap.add_argument("--drift-only", action="store_true", help="only the drift part (after the in-process cost)")
    args = ap.parse_args()
    ds = build_workload("resnet50", "fake", num_samples=args.num_samples).dataset
    res: dict[str, Any] = {"cores": usable_cores(), "seconds": args.seconds}
    t = time.perf_counter()
    cost = measure_sample_cost(ds, LoaderOptions())
    res["in_process_ms_per_sample"] = 1e3 * cost.sec_per_sample
    res["scaling_1s"] = [{"workers": p.num_workers, "per_worker_ms": 1e3 * p.num_workers / p.samples_per_s}
                         for p in measure_scaling(ds, [1, 2, 4, 8], batch_size=32, seconds=1.0)]
    print(json.dumps(res), flush=True)
    if not args.drift_only:
        measure_parts(ds, args.seconds, res)
    if args.drift_s > 0:
        alone: dict[str, Any] = {}
        run_loader(ds, 2, 57, args.drift_s, alone, bin_s=2.0)
        res["drift"] = {"2x57_alone": alone, "together": together(ds, [(16, 455), (2, 57)], args.drift_s, bin_s=2.0)}
        print("drift", json.dumps(res["drift"]), flush=True)
    res["wall_s"] = time.perf_counter() - t
    Path(args.json).write_text(json.dumps(res, indent=1))
    print("wrote", args.json, f"({res['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
