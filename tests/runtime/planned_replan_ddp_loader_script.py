# ruff: noqa: F401, F841, I001 -- the documented diff applied verbatim: unused stock names stay as they were
"""The stock DDP script of the DataLoader(batch_size=, sampler=) form moved onto a plan that re-plans between
epochs, in your own loop: the literal result of docs/ADOPTING.md's "Re-planning in your own loop" change for that
form applied to stock_ddp_loader_script.py (tests/runtime/test_own_loop_replan_loader_form.py checks that and runs
it on 2 gloo ranks).

    torchrun --standalone --nproc-per-node 2 tests/runtime/planned_replan_ddp_loader_script.py --plan plan.json \
        --profile profile.json --log-file run.jsonl
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from runtime import PlannedRun, register_weighted_hook


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--plan", required=True, help="plan.json from planner plan")
    parser.add_argument("--profile", required=True, help="the profile the plan was solved from")
    parser.add_argument("--log-file", default="run.jsonl", help="run log for planner report --log")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate at a global batch of 16")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--num-samples", type=int, default=100, help="size of the synthetic dataset")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def train(args: argparse.Namespace) -> dict[str, Any]:
    rank = dist.get_rank()
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(1234)  # same data on every rank
    data = TensorDataset(torch.randn(args.num_samples, 8, generator=g), torch.randn(args.num_samples, 1, generator=g))
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
    run = PlannedRun(args.plan, profile=args.profile, replan=True, log_file=args.log_file, seed=args.seed)
    sampler = run.sampler_for(len(data), "cpu")
    loader = DataLoader(data, batch_sampler=sampler, num_workers=run.num_workers(args.workers))
    register_weighted_hook(model, sampler)
    run.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * sampler.global_batch / 16)  # linear scaling rule
    batch_sizes: list[int] = []
    for epoch in range(args.epochs):
        for x, y in run.epoch(epoch, loader, last=epoch == args.epochs - 1):
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            batch_sizes.append(len(x))
    return {"rank": rank, "batch_sizes": batch_sizes, "loss": loss.item(), "num_workers": loader.num_workers,
            "lr": opt.param_groups[0]["lr"], "params": [p.detach().clone() for p in model.parameters()]}


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    try:
        out = train(args)
        print(f"rank {out['rank']}: {len(out['batch_sizes'])} steps, batch sizes {sorted(set(out['batch_sizes']))}, "
              f"final loss {out['loss']:.4f}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
