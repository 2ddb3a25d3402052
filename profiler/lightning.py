"""Auto mode for Lightning: profile your own LightningModule's training step, solve, hand the adapter the plan.

    from profiler.lightning import auto_plan
    from runtime.adapters.lightning import LightningPlan

    plan, profile = auto_plan(MyModule(), train_dataset, global_batch=512)   # every rank, before the Trainer
    planned = LightningPlan(plan, profile=profile, replan=True)
    trainer = L.Trainer(strategy=planned.strategy, callbacks=[planned.callback], ...)

What is timed is one full step of *your* module: ``training_step(batch, 0)`` on batches collated from your
dataset exactly as your DataLoader collates them, backward, and the first optimizer of ``configure_optimizers()``
(SGD when it cannot run without a Trainer) -- on a deep copy, so your module's weights do not move.  The sweep,
memory search, loader cost and gathering are profiler.api's (the same code as `planner profile`).

Under torchrun the profile needs the process group before the Trainer exists, so ``auto_plan`` initializes it
from torchrun's environment when nobody has (NCCL for CUDA devices, gloo otherwise); Lightning then uses that
group as it is.  It lives in profiler/ because runtime/ (the adapters) never measures.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from planner.options import SolveOptions
from planner.plan import Plan
from planner.profile import Profile
from planner.quality import solve_within_noise
from profiler.api import batches_from, profile_job
from runtime.collectives import decide_on_rank0


class TrainingStep(nn.Module):
    """``forward(batch)`` = the module's ``training_step(batch, 0)`` loss, so DDP and the profiler see one call."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Any) -> torch.Tensor:
        with warnings.catch_warnings():
            # self.log() without a Trainer warns on every step; nothing is logged while profiling.
            warnings.simplefilter("ignore")
            out = self.module.training_step(batch, 0)  # type: ignore[operator]
        loss = out["loss"] if isinstance(out, dict) else out
        if not isinstance(loss, torch.Tensor):
            from planner.errors import ValidationError

            raise ValidationError("training_step must return the loss tensor (or a dict with 'loss') to be profiled")
        return loss


def first_optimizer(module: nn.Module) -> Callable[[nn.Module], torch.optim.Optimizer]:
    """optimizer_fn for profiler.api: the step's own first optimizer from ``configure_optimizers``."""

    def make(step: nn.Module) -> torch.optim.Optimizer:
        inner = step.module if isinstance(step, TrainingStep) else step
        try:
            found = _find_optimizer(inner.configure_optimizers())  # type: ignore[operator]
        except Exception as e:  # e.g. a scheduler that reads self.trainer
            found = None
            warnings.warn(f"configure_optimizers() did not run without a Trainer ({type(e).__name__}: {e}); "
                          "profiling with SGD instead", stacklevel=2)
        return found if found is not None else torch.optim.SGD(inner.parameters(), lr=1e-4, momentum=0.9)

    return make


def _find_optimizer(value: Any) -> torch.optim.Optimizer | None:
    """The first optimizer in any form configure_optimizers may return (one, a list, a tuple of lists, a dict)."""
    if isinstance(value, torch.optim.Optimizer):
        return value
    if isinstance(value, dict):
        return _find_optimizer(value.get("optimizer"))
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _find_optimizer(item)
            if found is not None:
                return found
    return None


def ensure_process_group(device: torch.device, timeout_s: float = 900.0) -> None:
    """Initialize torch.distributed from torchrun's environment when it is set and nobody has yet."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "MASTER_ADDR" not in os.environ:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def auto_plan(module: nn.Module, data: Any, *, global_batch: int, device: torch.device | str | None = None,
              collate_fn: Callable[[list[Any]], Any] | None = None, quick: bool = False, min_batch: int = 1,
              options: SolveOptions | None = None, plan_out: str | os.PathLike[str] | None = None,
              profile_out: str | os.PathLike[str] | None = None, **profile_kw: Any) -> tuple[Plan, Profile]:
    """Profile ``module``'s training step on every rank, solve on rank 0 under the quality gate
    (planner.quality.solve_within_noise, as `planner train --auto` does); every rank gets (plan, profile).

    Args:
        module: your LightningModule (copied; its weights are not changed).
        data: the training dataset (or a DataLoader over it): batches and loader cost come from it.
        global_batch: samples per optimizer step over all ranks (your convergence choice).
        device: this rank's device (default cuda:LOCAL_RANK when CUDA is available, else cpu).
        quick: a CI-sized sweep; min_batch: 2 for BatchNorm models; options: planner.SolveOptions.
        plan_out, profile_out: where rank 0 writes the plan and the profile.
        profile_kw: more profiler.api.profile_step arguments (batch_sizes, amp, sweep, loader, ...).
    """
    dev = torch.device(device) if device is not None else default_device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    ensure_process_group(dev)
    step = TrainingStep(copy.deepcopy(module))
    profile_kw.setdefault("max_batch", global_batch)  # the sweep stops where no plan goes further
    profile = profile_job(step, batches_from(data, collate_fn), lambda m, batch: m(batch), dev,
                          optimizer_fn=first_optimizer(module), data=data, collate_fn=collate_fn, quick=quick,
                          min_batch=min_batch, model_name=type(module).__name__, **profile_kw)

    def decide() -> dict[str, Any]:
        # The quality gate of every auto mode: the equal split when the gain is inside the profile's noise.
        plan = solve_within_noise(profile, global_batch=global_batch, min_batch=min_batch, options=options)
        if plan_out:
            plan.save(plan_out)
        if profile_out:
            profile.save(profile_out)
        return plan.to_dict()

    return Plan.from_dict(decide_on_rank0(decide), path="rank 0's plan"), profile
