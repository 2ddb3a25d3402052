# ruff: noqa: F401, F841, I001 -- the documented diff applied verbatim: unused stock names stay as they were
"""The stock DDP accumulation script moved onto a plan with per-rank micro-batches: the literal result of the
change in docs/ADOPTING.md ('Gradient accumulation (DDP with no_sync)') applied to stock_accum_ddp_script.py
(tests/runtime/test_accumulation_adopting.py checks that and runs both on 2 gloo ranks).

    planner plan --profile profile.json --global-batch 16 --out plan.json
    torchrun --standalone --nproc-per-node 2 tests/runtime/planned_accum_ddp_script.py --plan plan.json
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset
from runtime import HeteroBatchSampler, micro_steps


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--plan", required=True, help="plan.json from planner plan")
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
    sampler = HeteroBatchSampler.from_plan(args.plan, rank, len(data), seed=args.seed)
    loader = DataLoader(data, batch_sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batch_sizes: list[int] = []
    optimizer_steps = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for (x, y), micro in micro_steps(loader, sampler):
            sync = micro.is_last
            with contextlib.nullcontext() if sync else model.no_sync():  # all-reduce only on the last micro-batch
                loss = F.mse_loss(model(x), y) * micro.loss_scale
                loss.backward()
            batch_sizes.append(len(x))
            if sync:
                opt.step()
                opt.zero_grad()
                optimizer_steps += 1
    return {"rank": rank, "batch_sizes": batch_sizes, "optimizer_steps": optimizer_steps, "loss": loss.item(),
            "params": [p.detach().clone() for p in model.parameters()]}


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
