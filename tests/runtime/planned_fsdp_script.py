# ruff: noqa: F401, F841, I001 -- the documented diff applied verbatim: unused stock names stay as they were
"""The stock FSDP2 accumulation script moved onto a plan with per-rank micro-batches: the literal result of the
change in docs/ADOPTING.md ('FSDP2') applied to stock_fsdp_script.py (tests/runtime/test_accumulation_adopting.py
checks that and runs both on 2 gloo ranks).

    planner plan --profile profile.json --global-batch 16 --mode fsdp --out plan.json
    torchrun --standalone --nproc-per-node 2 tests/runtime/planned_fsdp_script.py --plan plan.json
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset
from runtime import HeteroBatchSampler, micro_steps


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--plan", required=True, help="plan.json from planner plan --mode fsdp")
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
    sampler = HeteroBatchSampler.from_plan(args.plan, rank, len(data), seed=args.seed, mode="fsdp")
    loader = DataLoader(data, batch_sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batch_sizes: list[int] = []
    optimizer_steps = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for (x, y), micro in micro_steps(loader, sampler):
            sync = micro.is_last
            model.set_requires_gradient_sync(sync)  # reduce-scatter only on the last micro-batch
            loss = F.mse_loss(model(x), y) * micro.loss_scale
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
