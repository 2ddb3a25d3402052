"""Per-step cost of the runtime's pieces on a fast, launch-bound model, against plain DDP in the same processes.

    torchrun --standalone --nproc-per-node 2 benchmarks/hook_overhead.py [--model resnet18 --image-size 32 --batch 512]

Variants (each a fresh DDP model; they alternate in rounds so drift hits all alike; median over rounds):
  ddp          plain DDP, default (C++) all-reduce -- what a DistributedSampler script runs
  pyhook       DDP + torch's own Python allreduce_hook (the cost any Python comm hook pays)
  weighted     DDP + runtime.register_weighted_hook
  weighted+timer   the above + StepTimer (events at forward start and in the hook) -- what `planner train` runs
  loss_scale   plain DDP, loss multiplied by runtime.weighting.loss_scale(sampler, step) (exact, no hook)
  loss_scale+timer the above + StepTimer, compute end recorded after backward() returns
  loss_scale+gradtimer  the above, compute end recorded when the first parameter's gradient is accumulated
                   (planner.cli.train.close_compute_on_last_gradient) -- what `planner train` runs by default
Equal batches on every rank (a homogeneous plan), synthetic data on the device, bf16 autocast, SGD.
Prints ms/step per variant and the ratio to plain DDP; --json writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from planner.cli.train import close_compute_on_last_gradient
from profiler.workloads.specs import build_workload
from runtime.sampler import HeteroBatchSampler
from runtime.timing import StepTimer
from runtime.weighting import loss_scale, register_weighted_hook

VARIANTS = ("ddp", "pyhook", "weighted", "weighted+timer", "loss_scale", "loss_scale+timer", "loss_scale+gradtimer")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch", type=int, default=512, help="per-rank batch")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:  # CPU/gloo only for a dry run of this script
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=120))
    torch.backends.cudnn.benchmark = True
    wl = build_workload(args.model, "fake", image_size=args.image_size, num_samples=10**6)
    x0 = wl.dataset[0][0]
    x = torch.randn(args.batch, *x0.shape, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (args.batch,), device=device)
    sampler = HeteroBatchSampler(10**6, [args.batch] * world, rank, prefetch=False)

    setups = {}
    for v in VARIANTS:
        torch.manual_seed(0)
        model = wl.model_fn().to(device).to(memory_format=torch.channels_last)
        ddp = DDP(model, device_ids=[device.index] if cuda else None)
        timer = StepTimer(device) if v.endswith("timer") else None
        if v.endswith("+gradtimer"):
            assert timer is not None
            close_compute_on_last_gradient(model, timer)
        if v == "pyhook":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        elif v.startswith("weighted"):
            register_weighted_hook(ddp, sampler, on_last_bucket=timer.compute_end if timer else None)
        setups[v] = (ddp, torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9), timer)

    def run(v: str, steps: int) -> float:
        ddp, opt, timer = setups[v]
        it = iter(sampler)  # a new pass: the weighted hook's step count restarts
        if timer is not None:
            timer.reset()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for step in range(steps):
            next(it)
            if timer is not None:
                timer.compute_start()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = wl.loss_fn(ddp(x), y)
            if v.startswith("loss_scale"):
                loss = loss * loss_scale(sampler, step)
            loss.backward()
            if timer is not None:
                timer.compute_end()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if timer is not None:
                timer.step_end()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps

    for v in VARIANTS:
        run(v, 15)  # warm-up: cudnn autotune, allocator, NCCL
    per: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
        for v in order:
            per[v].append(run(v, args.steps))
    med = {v: statistics.median(ts) for v, ts in per.items()}
    if rank == 0:
        print(f"{args.model} {args.image_size}px, batch {args.batch}/rank x {world}, torch {torch.__version__}, "
              f"{torch.cuda.get_device_name(device) if cuda else 'cpu'}")
        # Paired ratios: each round runs every variant back to back, so round-to-round drift (which is large on a
        # launch-bound model: host jitter) cancels in the per-round ratio to plain DDP.
        for v in VARIANTS:
            paired = statistics.median(d / t for d, t in zip(per["ddp"], per[v], strict=True))
            print(f"{v:18s} median {med[v] * 1e3:8.3f} ms/step  mean {statistics.fmean(per[v]) * 1e3:8.3f}  "
                  f"x{paired:.3f} of plain DDP throughput (median of per-round ratios)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "image_size": args.image_size, "batch": args.batch, "world": world,
                           "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
                           "ms_per_step": {v: [t * 1e3 for t in per[v]] for v in VARIANTS}}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
