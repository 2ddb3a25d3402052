"""One rank of benchmarks/replan_midrun.py's "own" form: docs/ADOPTING.md's own DDP loop on ``runtime.PlannedRun``
(re-planning at every epoch end), with a slowdown that starts mid-run.

The loop is ADOPTING's "Re-planning in your own loop" as written -- ``PlannedRun(plan, profile=..., replan=True,
log_file=..., seed=...)``, ``run.sampler_for(len(data), device)``, ``register_weighted_hook``, ``run.watch(model)``,
``for batch in run.epoch(epoch, loader, last=...)`` -- plus two things the benchmark needs:

  * ``--slow-rank R --slow-factor F --slow-from-epoch E``: emulated compute skew, rank R doing F x its compute
    from epoch E, by ``profiler.workloads.emulate.Slowdown`` (F - 1 extra forward+backward passes on the unwrapped
    module through ``torch.autograd.grad``; nothing reaches ``.grad`` or DDP's reducer), the mechanism `planner
    train --emulate-slowdown` uses, so the two forms are slowed alike;
  * ``--data synthetic``: inputs made once in host memory (a TensorDataset, no worker), so the compute skew is what
    the ranks differ by; ``--data pipeline``: the workload's real dataset and its CPU transforms in DataLoader
    workers (the loader-bound GPU case, where the heterogeneity is a real CPU hog on one rank's cores).

The driver launches it with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT):

    python benchmarks/_midrun_own_loop.py --plan plan.json --profile profile.json --log-file run.jsonl \\
        --model cifar_cnn --num-samples 768 --epochs 9 --devices cpu,cpu --slow-rank 1 --slow-factor 4 \\
        --slow-from-epoch 2
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere: the repo's packages

from profiler.workloads.emulate import Slowdown
from profiler.workloads.specs import build_workload, synthetic_batch
from runtime import PlannedRun, register_weighted_hook


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", required=True, help="plan.json from planner plan")
    p.add_argument("--profile", required=True, help="the profile the plan was solved from")
    p.add_argument("--log-file", required=True, help="run log for planner report --log (rank 0 writes it)")
    p.add_argument("--model", default="cifar_cnn", help="a profiler.workloads model spec (default cifar_cnn)")
    p.add_argument("--dataset", default="fake", help="a profiler.workloads dataset spec, for --data pipeline")
    p.add_argument("--image-size", type=int, default=None, help="input side (default: the model's)")
    p.add_argument("--data", choices=("synthetic", "pipeline"), default="synthetic",
                   help="synthetic: inputs held in memory, no workers; pipeline: the dataset's transforms in workers")
    p.add_argument("--num-samples", type=int, default=768, help="samples per epoch")
    p.add_argument("--epochs", type=int, default=9)
    p.add_argument("--devices", default="cpu,cpu", help="one device per rank, e.g. cuda:0,cpu")
    p.add_argument("--workers", type=int, default=0, help="loader workers before the plan says (--data pipeline)")
    p.add_argument("--amp", action="store_true", help="bf16 autocast on CUDA ranks")
    p.add_argument("--gpu-normalize", action="store_true",
                   help="--data pipeline: workers hand over uint8 images, normalized on the device (as planner train "
                        "does on all-CUDA ranks)")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate, momentum 0.9 (as planner train)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--slow-factor", type=float, default=1.0, help="compute multiplier of --slow-rank (1: none)")
    p.add_argument("--slow-from-epoch", type=int, default=2)
    p.add_argument("--main-cores", type=int, default=0,
                   help="the first N cores this process may run on run it (and its gloo threads); its loader workers "
                        "run on the rest (0: all of them for both)")
    p.add_argument("--pg-timeout-s", type=float, default=300.0, help="gloo timeout: a dead peer ends the run")
    return p


def _pin_worker(cores: set[int], worker_id: int) -> None:
    os.sched_setaffinity(0, cores)


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    specs = [s.strip() for s in args.devices.split(",") if s.strip()]
    if len(specs) != world:
        raise SystemExit(f"--devices lists {len(specs)} devices for {world} ranks")
    device = torch.device(specs[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cuda = device.type == "cuda"
    workload = build_workload(args.model, args.dataset, image_size=args.image_size, num_samples=args.num_samples,
                              gpu_normalize=args.gpu_normalize and args.data == "pipeline")
    norm = None
    if workload.normalize is not None:
        mean, std = (torch.tensor(v, device=device).view(1, -1, 1, 1) for v in workload.normalize)
        norm = (mean, std)
    if args.data == "synthetic":
        torch.manual_seed(1234)  # the same inputs on every rank, as a shared dataset
        x, y = synthetic_batch(workload, args.num_samples, "cpu")
        data: Any = TensorDataset(x, y)
    else:
        data = workload.dataset
    torch.manual_seed(args.seed)  # every replica starts from the same weights (DDP also broadcasts rank 0's)
    net = workload.model_fn().to(device)
    model = DDP(net, device_ids=[device.index] if cuda else None)
    run = PlannedRun(args.plan, profile=args.profile, replan=True, log_file=args.log_file, seed=args.seed)
    sampler = run.sampler_for(len(data), device)
    workers = run.num_workers(args.workers) if args.data == "pipeline" else 0
    init = None
    if args.main_cores > 0:  # the training process on its first cores, the loader workers on the rest
        cores = sorted(os.sched_getaffinity(0))
        main, rest = set(cores[:args.main_cores]), set(cores[args.main_cores:])
        if rest:
            os.sched_setaffinity(0, main)
            init = functools.partial(_pin_worker, rest)
    loader = DataLoader(data, batch_sampler=sampler, num_workers=workers, pin_memory=cuda,
                        persistent_workers=workers > 0, worker_init_fn=init)
    register_weighted_hook(model, sampler)
    run.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    slow = Slowdown(args.slow_factor) if rank == args.slow_rank else Slowdown(1.0)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if args.amp and cuda else contextlib.nullcontext()
    losses = [0.0]  # the last step's, for the run log's epoch record
    for epoch in range(args.epochs):
        slowed = slow.enabled and epoch >= args.slow_from_epoch
        for xb, yb in run.epoch(epoch, loader, last=epoch == args.epochs - 1, loss=lambda: losses[-1]):
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            if norm is not None:
                xb = (xb.float() / 255 - norm[0]) / norm[1]
            with amp:
                if slowed:  # the extra passes first (and, interleaved, armed inside the real backward)
                    slow.apply(model, workload.loss_fn, xb, yb)
                loss = workload.loss_fn(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[-1] = float(loss.detach())
        if rank == 0:
            late = args.slow_factor > 1 and epoch >= args.slow_from_epoch  # rank 0 prints; the slow rank may not be it
            print(f"epoch {epoch}: batch sizes {list(sampler.batch_sizes)}, rank {args.slow_rank} slowed {late}",
                  flush=True)


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout_s))  # gloo: CPU, or CUDA beside CPU
    try:
        train(args)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
