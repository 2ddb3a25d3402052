"""A Lightning script, stock and planned: a small regressor on synthetic dict batches under DDP.

    torchrun --nproc-per-node 2 examples/lightning_stock.py --batch-size 8      # the same batch on every rank
    torchrun --nproc-per-node 2 examples/lightning_planned.py --plan plan.json  # the plan's per-rank batches

lightning_planned.py is lightning_stock.py with the 5-line change of docs/FRAMEWORKS.md (the test
tests/frameworks/test_examples.py applies that diff to this text and runs both).  The planned strategy batches
each rank's training data by the plan (--batch-size is then unused) and scales the loss so DDP's gradient is the
exact sample-weighted mean; its callback times the steps (and re-plans and logs when asked to).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from runtime.adapters.lightning import LightningPlan


class Synthetic(Dataset[dict[str, torch.Tensor]]):
    """``num_samples`` samples {"x": 16 features, "y": 1 target}, the same on every rank (seeded per index)."""

    def __init__(self, num_samples: int = 256) -> None:
        self.num_samples = num_samples
        self.w = torch.linspace(-1.0, 1.0, 16)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.randn(16, generator=torch.Generator().manual_seed(i))
        return {"x": x, "y": (x @ self.w).reshape(1) + 0.1}


class Regressor(L.LightningModule):
    def __init__(self, batch_size: int = 8, lr: float = 0.05, num_samples: int = 256) -> None:
        super().__init__()
        self.batch_size, self.lr = batch_size, lr
        self.data = Synthetic(num_samples)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        self.seen: list[int] = []  # local batch sizes this rank trained on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append(len(batch["x"]))
        loss = F.mse_loss(self(batch["x"]), batch["y"])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--num-samples", type=int, default=256, help="size of the synthetic dataset")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plan", required=True, help="plan.json from planner plan")
    return parser


def train(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = Regressor(args.batch_size, num_samples=args.num_samples)
    planned = LightningPlan(args.plan, seed=args.seed)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), strategy=planned.strategy, callbacks=[planned.callback],
                        max_epochs=args.epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model)
    return {"rank": trainer.global_rank, "batch_sizes": model.seen,
            "params": [p.detach().clone() for p in model.parameters()]}


def main(argv: list[str] | None = None) -> int:
    out = train(get_args_parser().parse_args(argv))
    print(f"rank {out['rank']}: {len(out['batch_sizes'])} steps, batch sizes {sorted(set(out['batch_sizes']))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
