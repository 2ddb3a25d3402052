"""A plan applied to a Lightning 2.x Trainer through Lightning's own extension points.

    from runtime.adapters.lightning import LightningPlan

    planned = LightningPlan("plan.json", log_file="run.jsonl")       # profile=..., replan=True to re-plan
    trainer = L.Trainer(accelerator="gpu", devices=2, strategy=planned.strategy, callbacks=[planned.callback])
    trainer.fit(model, datamodule)                                    # your LightningModule, unchanged

``planned.strategy`` is a ``DDPStrategy`` subclass; ``planned.callback`` a ``Callback``.  What each does:

  * ``Strategy.process_dataloader`` (the hook Lightning gives strategies to wrap loaders): the *training*
    DataLoader is rebuilt over the same dataset and collate function with ``batch_sampler=HeteroBatchSampler``
    (this rank's planned batch, the plan's worker count).  Whatever sampler Lightning injected before
    (``use_distributed_sampler=True``, the default) is replaced, so that flag does not matter; validation and
    test loaders are left as they are.
  * ``Strategy.backward``: the loss is multiplied by n_i * W / n of the current step's accumulation window
    (runtime.weighting.loss_scale) before Lightning's backward, so DDP's averaging all-reduce yields the
    sample-weighted mean gradient -- exact for uneven batches, with ``accumulate_grad_batches`` (Lightning has
    already divided the loss by K; the factor puts K back) and with SyncBatchNorm.  Under manual optimization
    (``self.manual_backward``) the factor is the per-step one.  The step index is Lightning's ``batch_idx``
    (``Strategy.on_train_batch_start``).
  * the Callback: ``set_epoch`` at every epoch start (Lightning only calls it on samplers it recognises), the
    StepTimer around every batch, and at every epoch end the Replanner (collective; an adopted plan's batch
    sizes apply from the next epoch) and the run log (rank 0).

The two go together.  The strategy without the callback would repeat epoch 0's order every epoch and never
re-plan: the strategy adds its callback to the Trainer's callbacks itself (``Strategy.setup``) when it is not
there.  The callback with another strategy (``strategy="ddp"``) would apply no plan at all: it refuses the fit at
its start, on every rank, with the line naming ``strategy=planned.strategy``.

Lightning is imported only here and only when a LightningPlan is made: from ``lightning.pytorch`` or
``pytorch_lightning`` -- whichever your script imported (``package=`` to force one).  An auto mode that profiles
your own LightningModule's step before training lives in profiler.lightning (runtime never measures).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from planner.errors import ValidationError
from planner.plan import Plan
from planner.profile import Profile
from runtime.run import PlannedRun

PACKAGES = ("lightning.pytorch", "pytorch_lightning")
INSTALL_HINT = "pip install ddp-planner[lightning]"


def lightning_package(package: str | None = None) -> str:
    """The Lightning import path to build on: ``package``, else the one already imported, else the first found.

    The Trainer checks strategies and callbacks against its own package's classes, so the adapter must subclass
    the package the user's script uses.
    """
    if package is not None and package not in PACKAGES:
        raise ValidationError(f"package must be one of {', '.join(PACKAGES)}, got {package!r}")
    imported = [p for p in PACKAGES if p in sys.modules]
    for name in ([package] if package else [*imported, *(p for p in PACKAGES if p not in imported)]):
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        return name
    raise ValidationError(f"Lightning is not installed (tried {', '.join([package] if package else PACKAGES)}): "
                          f"{INSTALL_HINT}")


class LightningPlan:
    """The plan for a Lightning Trainer: pass ``strategy=planned.strategy, callbacks=[planned.callback]``.

    Args:
        plan: Plan or plan JSON path (the same on every rank).
        shuffle: None (default) follows the training DataLoader Lightning hands the strategy: a loader made with
            ``shuffle=False`` (a ``SequentialSampler``) keeps the dataset's order, ``shuffle=True`` draws each
            epoch's order from ``seed + epoch``; a sampler that says neither is refused unless you pass True/False.
        profile, replan, replan_threshold, log_file, seed, drop_last, quiet, allow_workload_mismatch: see
            runtime.run.PlannedRun.
        num_workers: the training loader's workers: "plan" (the plan's, default), "loader" (your DataLoader's), or
            a number.
        package: "lightning.pytorch" or "pytorch_lightning" (default: the one your script imported).
        strategy_kwargs: passed on to ``DDPStrategy`` (timeout, find_unused_parameters, process_group_backend...),
            over the DDP settings the plan records (``plan.meta["ddp"]``: runtime.ddp_settings), which the strategy
            passes to ``DistributedDataParallel`` unless a keyword here sets the same one.
    """

    def __init__(self, plan: Plan | str | os.PathLike[str], *, profile: Profile | str | os.PathLike[str] | None = None,
                 replan: bool = False, replan_threshold: float = 0.05, log_file: str | os.PathLike[str] | None = None,
                 seed: int = 0, shuffle: bool | None = None, drop_last: bool = False, num_workers: int | str = "plan",
                 package: str | None = None, quiet: bool = False, allow_workload_mismatch: bool = False,
                 **strategy_kwargs: Any) -> None:
        if not (num_workers in ("plan", "loader") or (isinstance(num_workers, int) and num_workers >= 0)):
            raise ValidationError(f"num_workers must be 'plan', 'loader' or an integer >= 0, got {num_workers!r}")
        strategy_cls, callback_cls = _classes(lightning_package(package))
        self.run = PlannedRun(plan, profile=profile, replan=replan, replan_threshold=replan_threshold,
                              log_file=log_file, seed=seed, shuffle=bool(shuffle), drop_last=drop_last, quiet=quiet,
                              allow_workload_mismatch=allow_workload_mismatch)
        self.shuffle = shuffle
        """As given: None follows the training DataLoader (``loader_shuffles``) when the planned loader is built."""
        self.num_workers = num_workers
        self.step = 0
        """Lightning's batch_idx of the batch being trained (the sampler step the loss scale is for)."""
        self.epoch = 0
        self.strategy = strategy_cls(self, **{**self.run.ddp_kwargs(), **strategy_kwargs})
        self.callback = callback_cls(self)

    @property
    def plan(self) -> Plan:
        """The plan in force (a re-plan replaces it at an epoch end)."""
        return self.run.plan

    def planned_loader(self, loader: Any, device: torch.device, module: torch.nn.Module | None) -> DataLoader[Any]:
        """The training DataLoader over the same dataset, batched by this rank's planned sampler."""
        if not isinstance(loader, DataLoader):
            raise ValidationError(f"the planned strategy needs a torch DataLoader for training, got {type(loader).__name__}")
        if isinstance(loader.dataset, IterableDataset):
            raise ValidationError("the planned strategy needs a map-style dataset (len and indexing), not an "
                                  "IterableDataset: the plan splits sample indices between ranks")
        if self.run.sampler is None:  # the first planned loader fixes the order for the whole run
            self.run.shuffle = loader_shuffles(loader) if self.shuffle is None else self.shuffle
        sampler = self.run.sampler_for(len(loader.dataset), device)  # type: ignore[arg-type]
        if module is not None:
            self.run.watch(module)
        workers = (loader.num_workers if self.num_workers == "loader" else
                   self.run.num_workers(loader.num_workers) if self.num_workers == "plan" else int(self.num_workers))
        self.run.loader_workers = workers
        return DataLoader(loader.dataset, batch_sampler=sampler, num_workers=workers, collate_fn=loader.collate_fn,
                          pin_memory=loader.pin_memory, timeout=loader.timeout if workers else 0,
                          worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context
                          if workers else None, generator=loader.generator,
                          prefetch_factor=loader.prefetch_factor if workers else None,
                          persistent_workers=loader.persistent_workers and workers > 0)

    def scale(self, automatic: bool, accumulate: int) -> float:
        """The loss factor for the current step (Lightning divided an automatic-optimization loss by K)."""
        if self.run.sampler is None:
            return 1.0  # not a planned training step (no planned loader was built): leave the loss alone
        if not automatic:
            return self.run.loss_scale(self.step)
        return self.run.loss_scale(self.step, accumulate) * accumulate


def loader_shuffles(loader: DataLoader[Any]) -> bool:
    """Whether ``loader`` draws a shuffled order: the sampler it batches from (its batch sampler's, when that is a
    ``BatchSampler``) is a ``RandomSampler``, or a ``DistributedSampler`` with ``shuffle`` on -- what Lightning
    injects, carrying the user's ``shuffle=`` over; ``SequentialSampler`` keeps the order.

    Raises:
        ValidationError: any other sampler (the plan's sampler replaces it and cannot tell what it meant).
    """
    batch_sampler = loader.batch_sampler
    sampler = batch_sampler.sampler if isinstance(batch_sampler, BatchSampler) else batch_sampler or loader.sampler
    if isinstance(sampler, DistributedSampler):
        return bool(sampler.shuffle)
    if isinstance(sampler, (RandomSampler, SequentialSampler)):
        return isinstance(sampler, RandomSampler)
    raise ValidationError(f"LightningPlan: the training DataLoader draws from a {type(sampler).__name__}, which the "
                          "plan's sampler replaces; say which order to keep: LightningPlan(..., shuffle=True) or "
                          "shuffle=False")


@functools.cache
def _classes(package: str) -> tuple[type[Any], type[Any]]:
    """The strategy and callback classes, subclassing ``package``'s own (built once per package)."""
    pl = importlib.import_module(package)
    DDPStrategy = pl.strategies.DDPStrategy

    class PlannedDDPStrategy(DDPStrategy):  # type: ignore[misc, valid-type]
        """DDPStrategy with the planned training loader and the exact loss scale (see the module docstring)."""

        def __init__(self, planned: LightningPlan, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.planned = planned

        def setup(self, trainer: Any) -> None:
            if not any(c is self.planned.callback for c in trainer.callbacks):
                trainer.callbacks.append(self.planned.callback)  # its epoch starts, timing and epoch ends
            super().setup(trainer)

        def process_dataloader(self, dataloader: object) -> object:
            dataloader = super().process_dataloader(dataloader)
            module = self.lightning_module
            if module is None or not module.trainer.training:
                return dataloader  # validation, test and predict loaders keep their own batching
            return self.planned.planned_loader(dataloader, self.root_device, module)

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            super().on_train_batch_start(batch, batch_idx)
            self.planned.step = batch_idx

        def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            module = self.lightning_module
            trainer = module.trainer
            factor = self.planned.scale(module.automatic_optimization, int(trainer.accumulate_grad_batches))
            return super().backward(closure_loss * factor, optimizer, *args, **kwargs)  # type: ignore[no-any-return]

    class PlannerCallback(pl.Callback):  # type: ignore[misc, name-defined]
        """Epoch shuffle, step timing, re-planning and the run log (see the module docstring)."""

        def __init__(self, planned: LightningPlan) -> None:
            self.planned = planned

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if stage == "fit" and trainer.strategy is not self.planned.strategy:
                raise ValidationError(
                    f"LightningPlan: the Trainer's strategy is {type(trainer.strategy).__name__}, not the planned one, "
                    "so the plan is not applied (the DataLoader's own batches train); pass "
                    "L.Trainer(strategy=planned.strategy, callbacks=[planned.callback])")

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            self.planned.epoch = int(trainer.current_epoch)
            self.planned.run.epoch_start(self.planned.epoch)
            if self.planned.run.timer is not None:
                self.planned.run.timer.data_start()  # the first batch was fetched by now; the span starts here

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            timer = self.planned.run.timer
            if timer is not None:
                timer.data_end()
                timer.compute_start()

        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            if self.planned.run.timer is not None:
                self.planned.run.timer.compute_end()  # ignored when the first-parameter hook closed the span

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            timer = self.planned.run.timer
            if timer is not None:
                timer.step_end()
                timer.data_start()

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            max_epochs = trainer.max_epochs
            last = bool(trainer.should_stop) or (max_epochs is not None and 0 < max_epochs <= self.planned.epoch + 1)
            self.planned.run.epoch_end(self.planned.epoch, last=last)

        def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
            self.planned.run.finish(self.planned.epoch + 1)

    return PlannedDDPStrategy, PlannerCallback
