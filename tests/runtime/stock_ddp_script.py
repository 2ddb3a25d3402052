"""A stock DDP training script: DistributedSampler + BatchSampler + DataLoader + DDP, nothing from ddp-planner.

The BatchSampler form, model built first. docs/ADOPTING.md shows the change that moves it onto a plan;
tests/runtime/test_adopting.py applies that change to this file's text and runs both versions on 2 gloo ranks
(as it does for the other forms: stock_ddp_loader_script.py, stock_ddp_late_model_script.py).

    torchrun --standalone --nproc-per-node 2 tests/runtime/stock_ddp_script.py --batch-size 8
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-size", type=int, default=8, help="samples per rank per step")
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
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=args.seed)
    loader = DataLoader(data, batch_sampler=BatchSampler(sampler, args.batch_size, drop_last=False),
                        num_workers=args.workers)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * args.batch_size * world / 16)  # linear scaling rule
    batch_sizes: list[int] = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
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
