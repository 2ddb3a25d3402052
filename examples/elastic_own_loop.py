"""An own DDP loop on a plan under elastic torchrun (``--nnodes MIN:MAX``): nodes may join and leave mid-run.

torchrun restarts every worker when the membership changes, and each one runs this script again, at a new world
size.  A plan is for one world size, so every start plans for the world it finds: the ranks profile the training
step together (``profiler.api.profile_job``: the new node has no curve yet, and the communication belongs to the
new world), rank 0 solves at the same global batch and every rank gets its plan; the run continues from the last
epoch checkpoint (rank 0 writes it where every node reads it).  The launch settings are in docs/FRAMEWORKS.md
("Nodes that come and go"):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:2 --nproc-per-node 1 --max-restarts 3 \\
        --rdzv-backend c10d --rdzv-endpoint head:29500 --rdzv-id job1 \\
        --rdzv-conf join_timeout=120,last_call_timeout=5,keep_alive_interval=2,keep_alive_max_attempt=4 \\
        examples/elastic_own_loop.py --checkpoint /shared/ckpt.pt --log-file /shared/run.jsonl
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from planner import Plan
from planner.quality import solve_within_noise
from profiler.api import batches_from, profile_job
from runtime import PlannedRun, register_weighted_hook
from runtime.collectives import decide_on_rank0


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--global-batch", type=int, default=64, help="samples per step over all ranks (kept)")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--num-samples", type=int, default=4096, help="size of the synthetic dataset")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", required=True, help="epoch checkpoint every node can read (rank 0 writes)")
    parser.add_argument("--log-file", default=None, help="run log for planner report --log (rank 0 writes)")
    return parser


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))


def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1234)  # the same data on every rank
    data = TensorDataset(torch.randn(args.num_samples, 16, generator=g), torch.randn(args.num_samples, 1, generator=g))
    # Plan for this world: every rank measures its step (collective), rank 0 solves, every rank gets that plan.
    profile = profile_job(make_model, batches_from(data), loss_fn, "cpu", data=data, quick=True)
    plan = Plan.from_dict(decide_on_rank0(lambda: solve_within_noise(profile, global_batch=args.global_batch)
                                          .to_dict()), path="rank 0's plan")
    model = DDP(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    start = 0
    if os.path.exists(args.checkpoint):  # a restart: continue at the first epoch the checkpoint has not done
        state = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["epoch"])
    if rank == 0:
        print(f"{time.strftime('%H:%M:%S')} world {world}: plan {list(plan.batch_sizes)} at global batch "
              f"{plan.global_batch}, from epoch {start}", flush=True)
    run = PlannedRun(plan, profile=profile, replan=True, log_file=args.log_file, seed=args.seed)
    sampler = run.sampler_for(len(data), "cpu")
    loader = DataLoader(data, batch_sampler=sampler)
    register_weighted_hook(model, sampler)
    run.watch(model)
    for epoch in range(start, args.epochs):
        for x, y in run.epoch(epoch, loader, last=epoch == args.epochs - 1):
            loss = loss_fn(model, (x, y))
            opt.zero_grad()
            loss.backward()
            opt.step()
        if rank == 0:  # the epoch is done on every rank: a restart continues after it
            tmp = f"{args.checkpoint}.tmp"
            torch.save({"epoch": epoch + 1, "model": model.module.state_dict(), "opt": opt.state_dict()}, tmp)
            os.replace(tmp, args.checkpoint)
            print(f"{time.strftime('%H:%M:%S')} epoch {epoch} done on {world} rank(s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    # A bounded wait: a peer that is gone fails the collective instead of holding this rank forever.
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        train(args)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
