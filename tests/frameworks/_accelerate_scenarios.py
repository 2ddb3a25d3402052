"""Accelerate loops for tests/frameworks/test_accelerate.py, one torchrun launch, one scenario after another.

    torchrun --standalone --nproc-per-node 2 tests/frameworks/_accelerate_scenarios.py OUT PLAN73 PLAN88

unscaled    planned_dataloader, plan [7, 3], backward without loader.loss_scale(): the first backward's
            refusal on each rank (run first: nothing has weighted a gradient in this process yet) -> unscaled_<rank>.pt
resharded   a plain DataLoader(batch_sampler=HeteroBatchSampler) passed to accelerator.prepare: refused at its
            first batch (prepare's BatchSamplerShard would deal each rank's planned batches out again) -> resharded.pt
profile     profiler.api.profile_job of the dict-batch step on both ranks: the same Profile everywhere -> profile.pt
exact       planned_dataloader, plan [7, 3], 30 float64 samples, accelerator.prepare + backward: 3 steps -> exact.pt
accumulate  the same with gradient_accumulation_steps=2 inside accelerator.accumulate: 2 steps -> accumulate.pt
plain       the same [7, 3] batches from the user's own sampler, accelerate's plain averaging    -> plain.pt
replan      plan [8, 8], rank 1 emulated 3x slower, re-planning and the run log               -> run.jsonl
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader

from planner.errors import ValidationError
from profiler.api import batches_from, profile_job
from profiler.workloads.emulate import Slowdown
from runtime.adapters.accelerate import planned_dataloader
from runtime.collectives import all_gather_json
from runtime.sampler import HeteroBatchSampler
from tests.frameworks._common import DictData, dict_loss, exit_without_teardown, make_net, make_optimizer, save_rank0


def train(accelerator: Accelerator, loader: Any, model: torch.nn.Module, epochs: int = 1, *, scale: bool = True,
          slowdown: float = 1.0) -> dict[str, Any]:
    opt = make_optimizer(model)
    ddp, opt, prepared = accelerator.prepare(model, opt, loader)
    slow = Slowdown(slowdown)
    seen, steps = [], 0
    for _ in range(epochs):
        for batch in prepared:
            with accelerator.accumulate(ddp):
                slow.apply(ddp, F.mse_loss, batch["x"], batch["y"])  # emulated extra work on one rank
                loss = dict_loss(ddp, batch)
                accelerator.backward(loss * prepared.loss_scale() if scale else loss)
                opt.step()
                steps += int(accelerator.sync_gradients)
                opt.zero_grad()
            seen.append(len(batch["x"]))
    return {"params": [p.detach().clone() for p in model.parameters()], "seen": seen, "steps": steps,
            "prepare_kept_loader": prepared is loader}


def refused(accelerator: Accelerator, loader: Any, model: torch.nn.Module) -> dict[str, Any]:
    """The first step of ``train`` without the loss scale: the ValidationError's line, and whether any gradient
    reached the parameters (None: the step trained)."""
    try:
        train(accelerator, loader, model, scale=False)
    except ValidationError as e:
        return {"error": str(e), "grads": [p.grad is not None for p in model.parameters()]}
    return {"error": None, "grads": [p.grad is not None for p in model.parameters()]}


def main(out: Path, plan73: Path, plan88: Path) -> None:
    accelerator = Accelerator(cpu=True)
    data = DictData(30)

    # the loss scale forgotten (the documented loop without `* loader.loss_scale()`): refused on every rank
    model = make_net()
    loader = planned_dataloader(accelerator, plan73, data, model=model, shuffle=True, seed=0, epochs=1)
    torch.save(refused(accelerator, loader, model), out / f"unscaled_{accelerator.process_index}.pt")

    # the planned sampler in a plain loader through prepare: accelerate re-shards its batches; refused
    own = DataLoader(data, batch_sampler=HeteroBatchSampler(len(data), [7, 3], accelerator.process_index, seed=0))
    try:
        next(iter(accelerator.prepare(own)))
        error = None
    except ValidationError as e:
        error = str(e)
    save_rank0(out, "resharded", {"error": error})

    # every rank profiles the user's own step (dict batches) and receives the gathered Profile
    profile = profile_job(make_net, batches_from(data), dict_loss, "cpu", quick=True, batch_sizes=[4, 8],
                          model_name="net")
    comm = profile.comm
    save_rank0(out, "profile", {"fingerprints": all_gather_json(profile.fingerprint()),
                                "ranks": [r.rank for r in profile.ranks], "hosts": [h.name for h in profile.hosts],
                                "allreduce_s": comm.allreduce_s if comm else None,
                                "exposed_s": comm.exposed_s if comm else None})

    model = make_net()
    loader = planned_dataloader(accelerator, plan73, data, model=model, shuffle=True, seed=0, epochs=1)
    save_rank0(out, "exact", train(accelerator, loader, model))

    accelerator.gradient_accumulation_steps = 2
    model = make_net()
    loader = planned_dataloader(accelerator, plan73, data, model=model, shuffle=True, seed=0, epochs=1)
    save_rank0(out, "accumulate", train(accelerator, loader, model))
    accelerator.gradient_accumulation_steps = 1

    # accelerate's own averaging over the same uneven batches (a loader prepare must not re-shard: not prepared)
    model = make_net()
    sampler = HeteroBatchSampler(len(data), [7, 3], accelerator.process_index, seed=0)
    ddp, opt = accelerator.prepare(model, make_optimizer(model))
    for batch in DataLoader(data, batch_sampler=sampler):
        opt.zero_grad()
        accelerator.backward(dict_loss(ddp, batch))
        opt.step()
    save_rank0(out, "plain", {"params": [p.detach().clone() for p in model.parameters()]})

    # replan: rank 1 does 3x the work
    torch.manual_seed(0)
    # ~10 ms of float64 compute per step on rank 0 (30 on rank 1): well above the scheduling noise of a busy
    # 2-core machine, where a preempted rank's wall-clock compute grows by whole time slices
    net = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                              torch.nn.ReLU(), torch.nn.Linear(1024, 1)).double()
    loader = planned_dataloader(accelerator, plan88, DictData(16 * 12, features=512), model=net, shuffle=True, seed=0,
                                epochs=3,
                                profile=plan88.with_suffix(".profile.json"), replan=True, log_file=out / "run.jsonl")
    res = train(accelerator, loader, net, 3, slowdown=3.0 if accelerator.process_index == 1 else 1.0)
    save_rank0(out, "replan", {"seen": res["seen"]})
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
    exit_without_teardown()
