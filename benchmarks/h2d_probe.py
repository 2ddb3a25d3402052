"""What a loader-fed step pays for its batch's host-to-device copy (#18; docs/BENCHMARKS.md section 17).

Session 9, 2x H100: with both ranks at their GPUs' pace, `planner train`'s loader-fed steps took 10.7 ms (3x skew,
rank 0 at batch 408) and 5.3 ms (loader skew, batch 465) longer than the longest rank's compute plus data wait, a
gap the profile's on-device compute sweep does not see.  `planner train` copies the batch on the compute stream
right before the step's compute span.  One GPU, ResNet-50 bf16 (autocast, channels_last, SGD), per batch size:

  h2d_pinned_ms / h2d_pageable_ms   one (b, 3, 224, 224) float32 batch copied to the GPU, median of 10
  step_on_device_ms                 a training step on a batch already on the GPU (the profile's sweep)
  step_copy_ms                      the same step after copying its batch from pinned memory on the compute stream
                                    (what `planner train` does)
  step_prefetch_ms                  the same with the next batch copied on a side stream during this step
  step_devicecopy_ms                the same through `planner.cli.steps.DeviceCopy` (what `planner train` does since
                                    session 10: the copy on a side stream once the loader hands the batch over)

    python benchmarks/h2d_probe.py [--batches 104,408,465] [--steps 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torchvision

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from planner.cli.steps import DeviceCopy


def _median_ms(fn: Any, n: int) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="104,408,465")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    model = torchvision.models.resnet50().to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "rows": []}

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def measure(b: int) -> dict[str, Any]:
        host = torch.randn(b, 3, 224, 224)
        pinned = host.pin_memory()
        y = torch.randint(0, 1000, (b,), device=dev)
        row: dict[str, Any] = {"batch": b, "batch_mib": round(host.numel() * 4 / 2**20, 1)}
        row["h2d_pinned_ms"] = round(_median_ms(lambda: pinned.to(dev, non_blocking=True), 10), 2)
        row["h2d_pageable_ms"] = round(_median_ms(lambda: host.to(dev), 5), 2)
        x_dev = pinned.to(dev)
        for _ in range(5):
            step(x_dev, y)

        def timed(body: Any) -> float:
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(args.steps):
                body()
            torch.cuda.synchronize()
            return round(1e3 * (time.perf_counter() - t) / args.steps, 2)

        row["step_on_device_ms"] = timed(lambda: step(x_dev, y))
        row["step_copy_ms"] = timed(lambda: step(pinned.to(dev, non_blocking=True), y))
        side = torch.cuda.Stream()
        nxt: list[torch.Tensor] = []

        def prefetched() -> None:
            if not nxt:
                with torch.cuda.stream(side):
                    nxt.append(pinned.to(dev, non_blocking=True))
            torch.cuda.current_stream().wait_stream(side)
            x = nxt.pop()
            x.record_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                nxt.append(pinned.to(dev, non_blocking=True))
            step(x, y)

        prefetched()
        row["step_prefetch_ms"] = timed(prefetched)
        nxt.clear()
        copier, y_host = DeviceCopy(dev, channels_last=True), y.cpu().pin_memory()
        row["step_devicecopy_ms"] = timed(lambda: step(*copier(pinned, y_host)))
        row["devicecopy_cost_ms"] = round(row["step_devicecopy_ms"] - row["step_on_device_ms"], 2)
        row["copy_cost_ms"] = round(row["step_copy_ms"] - row["step_on_device_ms"], 2)
        row["prefetch_cost_ms"] = round(row["step_prefetch_ms"] - row["step_on_device_ms"], 2)
        return row

    for b in (int(v) for v in args.batches.split(",")):
        row = measure(b)
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
