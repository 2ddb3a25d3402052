"""An Accelerate script, stock and planned: a small regressor on synthetic dict batches, one process per rank.

    torchrun --nproc-per-node 2 examples/accelerate_stock.py --batch-size 8      # the same batch on every process
    torchrun --nproc-per-node 2 examples/accelerate_planned.py --plan plan.json  # the plan's per-process batches

accelerate_planned.py is accelerate_stock.py with the 5-line change of docs/FRAMEWORKS.md (the test
tests/frameworks/test_examples.py applies that diff to this text and runs both).  The planned loader yields each
process's planned batch (--batch-size is then unused), ``loss_scale()`` makes the gradient the exact
sample-weighted mean, and the loader times the steps (and re-plans and logs when asked to).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import Dataset

from runtime.adapters.accelerate import planned_dataloader


class Synthetic(Dataset[dict[str, torch.Tensor]]):
    """``num_samples`` samples {"x": 16 features, "y": 1 target}, the same on every process (seeded per index)."""

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
    parser.add_argument("--batch-size", type=int, default=8, help="samples per process per step")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--num-samples", type=int, default=256, help="size of the synthetic dataset")
    parser.add_argument("--accumulate", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plan", required=True, help="plan.json from planner plan")
    return parser


def train(args: argparse.Namespace, accelerator: Accelerator) -> dict[str, Any]:
    torch.manual_seed(args.seed)  # the same initial weights on every process
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = Synthetic(args.num_samples)
    loader = planned_dataloader(accelerator, args.plan, data, model=model, shuffle=True, seed=args.seed, epochs=args.epochs)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    seen: list[int] = []
    for _epoch in range(args.epochs):
        for batch in loader:
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(batch["x"]), batch["y"])
                accelerator.backward(loss * loader.loss_scale())
                optimizer.step()
                optimizer.zero_grad()
            seen.append(len(batch["x"]))
    accelerator.wait_for_everyone()  # no process tears the group down while a peer still talks to it
    return {"rank": accelerator.process_index, "batch_sizes": seen,
            "params": [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]}


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulate)
    out = train(args, accelerator)
    print(f"rank {out['rank']}: {len(out['batch_sizes'])} steps, batch sizes {sorted(set(out['batch_sizes']))}")
    accelerator.end_training()  # destroys the process group
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
