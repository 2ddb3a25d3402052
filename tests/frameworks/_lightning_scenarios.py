"""Lightning runs for tests/frameworks/test_lightning.py, one torchrun launch, each scenario a Trainer.fit.

    torchrun --standalone --nproc-per-node 2 tests/frameworks/_lightning_scenarios.py OUT PLAN73 PLAN88

exact   the planned strategy + callback, plan [7, 3], 30 float64 samples: 3 optimizer steps  -> exact.pt
plain   the same [7, 3] batches from the user's own sampler, Lightning's plain averaging  -> plain.pt
stock   Lightning's default: DataLoader(batch_size=5, shuffle=True), DistributedSampler   -> stock.pt
unplanned  strategy="ddp" with the planned callback: refused at the fit's start on each rank -> unplanned_<rank>.pt
alone   the planned strategy without its callback, 2 epochs: each epoch's first features of rank 0 -> alone.pt
replan  plan [8, 8], rank 1 emulated 3x slower (profiler.workloads.emulate.Slowdown), re-planning, run log -> run.jsonl
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from planner.errors import ValidationError
from profiler.workloads.emulate import Slowdown
from runtime.adapters.lightning import LightningPlan
from runtime.sampler import HeteroBatchSampler
from tests.frameworks._common import DictData, dict_loss, exit_without_teardown, make_net, make_optimizer, save_rank0


class Module(L.LightningModule):
    def __init__(self, data: Any, loader: str, net: torch.nn.Module, slowdown: float = 1.0,
                 batch_sizes: list[int] | None = None) -> None:
        super().__init__()
        self.data, self.loader, self.net = data, loader, net
        self.slowdown = Slowdown(slowdown)
        self.batch_sizes = batch_sizes
        self.seen: list[int] = []
        self.firsts: list[float] = []
        """Each batch's first sample's first feature (which samples, in which order)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append(len(batch["x"]))
        self.firsts.append(float(batch["x"][0, 0]))
        self.slowdown.apply(self.net, F.mse_loss, batch["x"], batch["y"])  # emulated extra work on one rank
        return dict_loss(self.net, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.net)

    def train_dataloader(self) -> DataLoader[Any]:
        if self.loader == "own_sampler":  # uneven batches without the adapter: Lightning's plain averaging
            assert self.batch_sizes is not None
            sampler = HeteroBatchSampler(len(self.data), self.batch_sizes, self.global_rank, seed=0)
            return DataLoader(self.data, batch_sampler=sampler)
        return DataLoader(self.data, batch_size=5, shuffle=True)


def fit(module: Module, epochs: int, **kw: Any) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=2, max_epochs=epochs, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kw)
    trainer.fit(module)


def params(module: Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.net.parameters()]


def main(out: Path, plan73: Path, plan88: Path) -> None:
    # exact: the adapter, uneven batches, 1 epoch of 30 samples at global batch 10 = 3 optimizer steps
    planned = LightningPlan(plan73, seed=0)
    module = Module(DictData(30), "default", make_net())
    fit(module, 1, strategy=planned.strategy, callbacks=[planned.callback])
    save_rank0(out, "exact", {"params": params(module), "seen": module.seen})

    # plain: the same uneven batches, but Lightning's own DDP averaging (no weighting)
    module = Module(DictData(30), "own_sampler", make_net(), batch_sizes=[7, 3])
    fit(module, 1, strategy="ddp", use_distributed_sampler=False)
    save_rank0(out, "plain", {"params": params(module), "seen": module.seen})

    # stock: Lightning's default, equal batches of 5 (DistributedSampler + plain averaging)
    module = Module(DictData(30), "default", make_net())
    fit(module, 1, strategy="ddp")
    save_rank0(out, "stock", {"params": params(module), "seen": module.seen})

    # the planned callback beside Lightning's own DDP strategy: the plan would not apply; refused at the start
    planned = LightningPlan(plan73, seed=0)
    module = Module(DictData(30), "default", make_net())
    try:
        fit(module, 1, strategy="ddp", callbacks=[planned.callback])
        error = None
    except ValidationError as e:
        error = str(e)
    torch.save({"error": error, "seen": module.seen}, out / f"unplanned_{torch.distributed.get_rank()}.pt")

    # the planned strategy without its callback: the strategy adds it (epoch shuffle, epoch ends)
    planned = LightningPlan(plan73, seed=0)
    module = Module(DictData(30), "default", make_net())
    fit(module, 2, strategy=planned.strategy)
    save_rank0(out, "alone", {"seen": module.seen, "firsts": module.firsts})

    # replan: rank 1 does 3x the work; the planned callback re-plans between epochs and logs it
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    # ~10 ms of float64 compute per step on rank 0 (30 on rank 1): well above the scheduling noise of a busy
    # 2-core machine, where a preempted rank's wall-clock compute grows by whole time slices
    net = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                              torch.nn.ReLU(), torch.nn.Linear(1024, 1)).double()
    planned = LightningPlan(plan88, profile=plan88.with_suffix(".profile.json"), replan=True,
                            log_file=out / "run.jsonl", seed=0)
    module = Module(DictData(16 * 12, features=512), "default", net, slowdown=3.0 if rank == 1 else 1.0)
    fit(module, 3, strategy=planned.strategy, callbacks=[planned.callback])
    save_rank0(out, "replan", {"seen": module.seen})
    if rank == 1:
        torch.save({"seen": module.seen}, out / "replan_rank1.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
    exit_without_teardown()
