"""A Ray Train script, stock and planned: a small regressor on synthetic dict batches, one Ray worker per rank.

    python examples/ray_stock.py --workers 2 --batch-size 8        # the same batch on every worker
    python examples/ray_planned.py --workers 2 --plan plan.json    # the plan's per-worker batches

ray_planned.py is ray_stock.py with the 5-line change of docs/FRAMEWORKS.md (tests/frameworks/test_ray.py applies
that diff to this text and runs both on 2 CPU workers).  The planned loader yields each worker's planned batch
(--batch-size is then unused) and survives ``prepare_data_loader``; the DDP model ``prepare_model`` returned gets
the exact weighting hook; ``planned_epoch`` times the steps (and re-plans and logs when asked to).
"""

from __future__ import annotations

import argparse
from typing import Any

import ray.train
import ray.train.torch
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset


class Synthetic(Dataset[dict[str, torch.Tensor]]):
    """``num_samples`` samples {"x": 16 features, "y": 1 target}, the same on every worker (seeded per index)."""

    def __init__(self, num_samples: int = 256) -> None:
        self.num_samples = num_samples
        self.w = torch.linspace(-1.0, 1.0, 16)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.randn(16, generator=torch.Generator().manual_seed(i))
        return {"x": x, "y": (x @ self.w).reshape(1) + 0.1}


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="Ray Train workers (one rank each)")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per worker per step")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--num-samples", type=int, default=256, help="size of the synthetic dataset")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def train(config: dict[str, Any]) -> dict[str, Any]:
    """One worker's training; returns what it saw (batch sizes, parameters) for tests."""
    torch.manual_seed(config["seed"])  # the same initial weights on every worker
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model = ray.train.torch.prepare_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = Synthetic(config["num_samples"])
    loader = torch.utils.data.DataLoader(data, batch_size=config["batch_size"], shuffle=True)
    loader = ray.train.torch.prepare_data_loader(loader)
    seen: list[int] = []
    for epoch in range(config["epochs"]):
        if ray.train.get_context().get_world_size() > 1:
            loader.sampler.set_epoch(epoch)
        for batch in loader:
            loss = F.mse_loss(model(batch["x"]), batch["y"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen.append(len(batch["x"]))
        ray.train.report({"epoch": epoch, "loss": loss.item()})
    module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return {"rank": ray.train.get_context().get_world_rank(), "batch_sizes": seen,
            "params": [p.detach().clone() for p in module.parameters()]}


def train_loop_per_worker(config: dict[str, Any]) -> None:
    train(config)  # Ray Train refuses a loop's return value that holds tensors


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    trainer = ray.train.torch.TorchTrainer(train_loop_per_worker, train_loop_config=vars(args),
                                           scaling_config=ray.train.ScalingConfig(num_workers=args.workers))
    trainer.fit()
    print(f"trained {args.epochs} epochs on {args.workers} workers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
