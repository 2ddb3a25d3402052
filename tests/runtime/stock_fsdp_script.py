"""A stock FSDP2 script with gradient accumulation: DistributedSampler + BatchSampler + fully_shard, nothing else.

docs/ADOPTING.md ('FSDP2') shows the change that moves it onto a plan with per-rank micro-batches (the same
number of micro-steps on every rank); tests/runtime/test_accumulation_adopting.py applies that change to this
file's text, checks that it gives planned_fsdp_script.py, and runs both on 2 gloo ranks.

    torchrun --standalone --nproc-per-node 2 tests/runtime/stock_fsdp_script.py --batch-size 4
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-size", type=int, default=4, help="samples per rank per micro-batch")
    parser.add_argument("--accumulation-steps", type=int, default=2, help="micro-batches per optimizer step")
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
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)  # each layer's parameters are all-gathered for its forward, then freed
    fully_shard(model)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=args.seed)
    loader = DataLoader(data, batch_sampler=BatchSampler(sampler, args.batch_size, drop_last=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batch_sizes: list[int] = []
    optimizer_steps = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            sync = (i + 1) % args.accumulation_steps == 0 or i + 1 == len(loader)
            model.set_requires_gradient_sync(sync)  # reduce-scatter only on the last micro-batch
            loss = F.mse_loss(model(x), y) / args.accumulation_steps
            loss.backward()
            batch_sizes.append(len(x))
            if sync:
                opt.step()
                opt.zero_grad()
                optimizer_steps += 1
    params = [p.full_tensor().detach().clone() for p in model.parameters()]  # gathered: the same on every rank
    return {"rank": rank, "batch_sizes": batch_sizes, "optimizer_steps": optimizer_steps, "loss": loss.item(),
            "params": params}


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    try:
        out = train(args)
        print(f"rank {out['rank']}: {out['optimizer_steps']} optimizer steps of micro-batches "
              f"{sorted(set(out['batch_sizes']))}, final loss {out['loss']:.4f}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
