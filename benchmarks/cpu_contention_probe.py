"""Does a busy host slow a GPU rank's own compute, and what keeps it off? (#18; docs/BENCHMARKS.md section 24)

Sessions 15-16, 2x H100 (32 vCPUs): in `planner train`'s loader-fed skew case, rank 0's compute span (forward start
to the last gradient bucket, CUDA events) kept its profiled median in most steps but took 20-50 ms longer in
15-35% of them, and its median rose by up to 10% in some launches -- while its 21-23 loader workers and the peer's
kept the host 93-97% busy.  In the drain epoch (workers idle) the tail was gone.  Nice 10 on the workers
(`--loader-nice 10`) did not remove it in one launch.

This probe runs the same step alone on one GPU -- ResNet-50 bf16, channels_last, SGD, batch B copied from pinned
memory as `planner train` does (planner.cli.steps.DeviceCopy), free-running like the trainer (no per-step sync) -- beside
CPU burners that run the fake dataset's PIL transform in a loop, in these conditions (``--conditions``):

  idle                 no burners
  burnN                N burners at nice 0, anywhere
  burnN_niceK          N burners at nice K
  burnN_own            the probe pinned to 2 vCPUs of its own, N burners on the others (CPU affinity)
  loaderW[_burnN]      a DataLoader over the fake dataset beside it (W workers, batch B, pin_memory=True, as
                       `planner train` builds it), its batches taken each step and dropped: the step still runs on
                       the batch already pinned; with N burners for the peer rank's workers
  loaderW_nopin        the same without pin_memory (no pin thread in the process)
  loaderW_used         the step runs on the DataLoader's batch (copied from its pinned memory): the training path

Per condition it prints the compute span's p10 / median / mean / p90 (ms, the step log's ``compute_ms``), the
wall time a step, and the main thread's CPU time a step (``time.thread_time``): a main thread whose CPU time
nears the GPU's step has no slack for a slower core.

    python benchmarks/cpu_contention_probe.py [--batch 393] [--steps 60] \
        [--conditions idle,burn30,burn30_nice10,burn24,burn16,burn30_own] [--json out.json]
    (session 16's second run: --conditions idle,loader23_burn7_nopin,loader23_burn7,loader23_burn7_used,idle)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from typing import Any

import numpy as np
import torch
import torchvision

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _burn(nice: int, cpus: list[int] | None) -> None:
    """One loader worker's work, forever: the fake dataset's samples through the PIL transform pipeline."""
    if nice:
        os.nice(nice)
    if cpus:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(1)
    from profiler.workloads.specs import build_workload

    ds = build_workload("resnet50", "fake", num_samples=100_000).dataset
    i = 0
    while True:
        ds[i % 100_000]  # type: ignore[index]
        i += 1


def _parse(cond: str) -> dict[str, Any]:
    """A condition's name as its parts: burners, nice, own (CPU affinity), loader workers, pin, used."""
    tokens = [] if cond == "idle" else cond.split("_")

    def num(prefix: str) -> int:
        return next((int(t.removeprefix(prefix)) for t in tokens if t.startswith(prefix)), 0)

    return {"burners": num("burn"), "nice": num("nice"), "own": "own" in tokens, "loader": num("loader"),
            "pin": "nopin" not in tokens, "used": "used" in tokens}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=393)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--conditions", default="idle,burn30,burn30_nice10,burn24,burn16,burn30_own")
    ap.add_argument("--json")
    args = ap.parse_args()
    from planner.cli.steps import DeviceCopy

    dev = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    model = torchvision.models.resnet50().to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    x_host = torch.randn(args.batch, 3, 224, 224).pin_memory()
    y_host = torch.randint(0, 1000, (args.batch,)).pin_memory()
    copier = DeviceCopy(dev, channels_last=True)
    all_cpus = sorted(os.sched_getaffinity(0))
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                           "batch": args.batch, "cpus": len(all_cpus), "rows": []}

    def window(n: int, batches: Any = None) -> dict[str, Any]:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        cpu_ms = []
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(n):
            c0 = time.thread_time()
            got = next(batches) if batches is not None else None
            x, y = copier(*got) if got is not None and used else copier(x_host, y_host)
            starts[i].record()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(model(x), y)
            loss.backward()
            ends[i].record()
            opt.step()
            opt.zero_grad(set_to_none=True)
            cpu_ms.append(1e3 * (time.thread_time() - c0))
        torch.cuda.synchronize()
        wall = 1e3 * (time.perf_counter() - t0) / n
        comp = np.array([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)])
        return {"compute_ms": [round(float(v), 2) for v in np.percentile(comp, [10, 50, 90])],
                "compute_mean_ms": round(float(comp.mean()), 2), "wall_ms_per_step": round(wall, 2),
                "main_cpu_ms_per_step": round(float(np.median(cpu_ms)), 2)}

    window(8)  # cudnn autotune, allocator
    ctx = mp.get_context("spawn")
    used = False
    for cond in args.conditions.split(","):
        c = _parse(cond)
        mine = all_cpus[-2:] if c["own"] else all_cpus
        os.sched_setaffinity(0, mine)
        others = [v for v in all_cpus if v not in mine] if c["own"] else None
        procs = [ctx.Process(target=_burn, args=(c["nice"], others), daemon=True) for _ in range(c["burners"])]
        for p in procs:
            p.start()
        loader, batches = None, None
        try:
            if c["loader"]:
                from torch.utils.data import BatchSampler, DataLoader, RandomSampler

                from profiler.workloads.specs import build_workload

                ds = build_workload("resnet50", "fake", num_samples=1_000_000).dataset
                loader = DataLoader(ds, batch_sampler=BatchSampler(RandomSampler(ds), args.batch, drop_last=True),
                                    num_workers=c["loader"], pin_memory=c["pin"], persistent_workers=True,
                                    prefetch_factor=4)
                batches = iter(loader)
            used = c["used"]
            time.sleep(6 if c["burners"] else 1)  # the burners import and reach their loop
            window(5 + 5 * c["loader"], batches)  # past the loader's first cycle of batches
            row = {"condition": cond, **c, **window(args.steps, batches)}
        finally:
            del batches, loader
            for p in procs:
                p.kill()
            for p in procs:
                p.join(timeout=10)
            os.sched_setaffinity(0, all_cpus)
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
