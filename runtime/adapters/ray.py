"""A plan applied to a Ray Train ``TorchTrainer``: inside ``train_loop_per_worker``, two lines change.

    from runtime.adapters.ray import Plan, planned_dataloader, planned_epoch

    def train_loop_per_worker(config):            # config["plan"] = Plan.load("plan.json"), read on the driver
        model = ray.train.torch.prepare_model(Net())                   # DDP over Ray's process group
        loader = planned_dataloader(config["plan"], data, model=model, shuffle=True)   # was DataLoader(...)
        loader = ray.train.torch.prepare_data_loader(loader)           # unchanged: adds device placement only
        for epoch in range(epochs):
            for batch in planned_epoch(loader, epoch, last=epoch == epochs - 1):   # instead of `in loader`
                ...                                                    # forward, backward, optimizer step

``planned_dataloader(plan, data, ...)`` is ``RayPlan(plan, ...).dataloader(data, ...)``; ``planned_epoch`` finds
that ``RayPlan`` on the loader (``loader.sampler.planned``, kept by Ray's wrapper) and runs its ``epoch``.  The
plan goes to the workers as a ``Plan`` object in ``train_loop_config`` (``Plan`` is re-exported here for
``type=Plan.load`` on the driver): Ray Train runs every worker in its own trial directory, possibly on another
node, where a relative path would not be found.

**The loader survives ``prepare_data_loader``.**  That function rebuilds any loader whose ``sampler`` is not a
``DistributedSampler`` over a new ``DistributedSampler`` with the loader's ``batch_size`` -- None for a loader built
on ``batch_sampler=``, so the rebuilt loader hands each sample alone to the batch collate function (an error for
dict samples, a wrong batch for others) and the plan is gone.  The planned loader is a ``DataLoader`` over the planned ``HeteroBatchSampler``
whose ``sampler`` attribute is a ``DistributedSampler`` view of the same batches (this worker's indices in the
planned order; ``set_epoch`` selects the planned sampler's epoch), so ``prepare_data_loader`` recognizes it as
already distributed and only wraps it for device placement.  A stock loop's ``loader.sampler.set_epoch(epoch)``
keeps working.

**Exact weighting.**  ``model=`` is the ``DistributedDataParallel`` that ``prepare_model`` returned: it gets
``runtime.register_weighted_hook``, which scales each gradient bucket by n_i / n and SUM-all-reduces, so every
worker holds the gradient of the sample-weighted mean over all workers' uneven batches.  (One worker:
``prepare_model`` returns the bare module and there is nothing to weight.)  A loop that scales the loss instead
passes no model and multiplies the mean loss by ``RayPlan.loss_scale(step)`` before backward.  Neither (no
``model=``, no factor) would be DDP's plain average, a wrong gradient for uneven batches: the first backward through
the DDP model is refused on every worker with the line naming both fixes.  Ray runs ``train_loop_per_worker`` on a
thread of its own; ``RayPlan`` names that thread the training one (runtime.safety.train_on_this_thread), so the
planned sampler's checks run there as on an own script's main thread.

**Timing, re-planning, run log** go through ``runtime.PlannedRun`` (``RayPlan.run``), the object an own DDP loop
uses: ``planned_epoch`` is ``PlannedRun.epoch`` -- the epoch's shuffle, timed steps, and at the epoch end the
Replanner (``profile=..., replan=True``) and the run log (``log_file=``, written by world rank 0).  It iterates
Ray's wrapper, so the epoch end runs after the epoch's last step.

**Auto mode and a worker group of another size.**  ``profile_fn`` is a zero-argument function that every worker
calls to measure the job (collective): ``profiler.api.profile_job`` on your own step, the profile-any-step API.
``planned_dataloader(None, data, profile_fn=..., global_batch=512)`` profiles in the workers and solves on world
rank 0 under the quality gate (planner.quality.solve_within_noise); every worker receives the same plan.  When Ray
starts the worker group with a size other than the plan's (a restart after a failure, elastic scaling), the
function re-runs in every new worker and ``planned_dataloader(plan, data, profile_fn=...)`` does the same for the
new group at the plan's global batch: the old profile's curves belong to workers that may be gone, so the new
group is profiled and solved, not the old profile re-solved.  Without ``profile_fn`` a size mismatch is one
error naming both fixes.

Ray is imported only when a ``RayPlan`` is made; a missing one is one line naming
``pip install 'ddp-planner[ray]'``.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from planner.errors import ValidationError
from planner.options import SolveOptions
from planner.plan import Plan
from planner.profile import Profile
from planner.quality import solve_within_noise
from runtime.collectives import decide_on_rank0
from runtime.ddp_settings import settings_missing
from runtime.run import PlannedRun, _load_plan
from runtime.safety import train_on_this_thread
from runtime.sampler import HeteroBatchSampler
from runtime.weighting import register_weighted_hook

__all__ = ["Plan", "PlannedDataLoader", "PlannedIndices", "RayPlan", "planned_dataloader", "planned_epoch"]

INSTALL_HINT = "pip install 'ddp-planner[ray]'"
WEIGHTING_FIX = ("pass model= (the model ray.train.torch.prepare_model returned) to planned_dataloader, or "
                 "multiply the loss by loader.sampler.planned.loss_scale(step)")
"""The fix named when an uneven plan's first backward ran with nothing weighting it (runtime.safety's check)."""
T = TypeVar("T")


def _ray_train() -> Any:
    """``ray.train`` (imported here, on first use)."""
    try:
        import ray.train
        import ray.train.torch
    except ImportError:
        raise ValidationError(f"Ray Train is not installed: {INSTALL_HINT}") from None
    return ray.train


class PlannedIndices(DistributedSampler):  # type: ignore[type-arg]
    """The planned batches of this worker seen as a ``DistributedSampler``: its indices in the planned order.

    The DataLoader draws from the ``HeteroBatchSampler``; this object is its ``sampler`` attribute, which only
    says what the loader yields (``prepare_data_loader`` leaves a loader with a ``DistributedSampler`` alone).
    Iterating it walks a copy of the batch sampler, so the planned sampler's pass count (which the weighting
    hook follows) does not move.
    """

    def __init__(self, dataset: Any, batches: HeteroBatchSampler, planned: RayPlan) -> None:
        super().__init__(dataset, num_replicas=batches.world_size, rank=batches.rank, shuffle=batches.shuffle,
                         seed=batches.seed, drop_last=batches.drop_last)
        self.batches = batches
        self.planned = planned
        """The RayPlan that made the loader (``planned_epoch`` finds it here)."""

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.batches.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        for batch in copy.copy(self.batches):
            yield from batch

    def __len__(self) -> int:
        b = self.batches
        return sum(b.counts_at(step)[b.rank] for step in range(b.num_steps))


class PlannedDataLoader(DataLoader):  # type: ignore[type-arg]
    """``DataLoader(dataset, batch_sampler=planned sampler)`` whose ``sampler`` is its ``PlannedIndices`` view."""

    def __init__(self, dataset: Any, batch_sampler: HeteroBatchSampler, planned: RayPlan, **kwargs: Any) -> None:
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        # DataLoader refuses a sampler beside a batch_sampler and a later assignment; the attribute is informative
        # only (a loader with a batch_sampler never draws from ``sampler``), so it is set past that guard.
        object.__setattr__(self, "sampler", PlannedIndices(dataset, batch_sampler, planned))


class RayPlan:
    """A plan applied to one Ray Train worker (module docstring).  Make it inside ``train_loop_per_worker``.

    Args:
        plan: the Plan, passed in ``train_loop_config`` (read it on the driver: Ray Train runs each worker in its
            own trial directory, possibly on another node, so a relative path is not found there), or an absolute
            plan JSON path every worker's node can read; None with ``profile_fn`` (auto mode).
        profile: the Profile the plan was solved from (for ``replan=True``).
        profile_fn: zero-argument function, called on every worker, returning the job's Profile (collective;
            e.g. ``lambda: profile_job(Net, batches_from(data), loss_fn, device, data=data)``): auto mode, and the
            re-plan when the worker group's size is not the plan's.
        global_batch: the auto plan's global batch (default: the given plan's).
        options, min_batch: planner.solve's, for the auto plan.
        shuffle: required, as the DataLoader this replaces had it: True draws each epoch's order from
            ``seed + epoch``, False keeps the dataset's order (the planned loader cannot see yours, so it does not
            guess).
        replan, replan_threshold, log_file, seed, drop_last, quiet, allow_workload_mismatch: see
            runtime.run.PlannedRun.
    """

    def __init__(self, plan: Plan | str | os.PathLike[str] | None = None, *,
                 profile: Profile | str | os.PathLike[str] | None = None,
                 profile_fn: Callable[[], Profile] | None = None, global_batch: int | None = None,
                 options: SolveOptions | None = None, min_batch: int = 1, replan: bool = False,
                 replan_threshold: float = 0.05, log_file: str | os.PathLike[str] | None = None, seed: int = 0,
                 shuffle: bool | None = None, drop_last: bool = False, quiet: bool = False,
                 allow_workload_mismatch: bool = False) -> None:
        if shuffle is None:
            raise ValidationError("RayPlan: pass shuffle=True or shuffle=False, as the DataLoader it replaces had it "
                                  "(DataLoader's default is False): the planned loader cannot see yours")
        train = _ray_train()
        train_on_this_thread()  # Ray's TrainingThread: the sampler's checks run here (module docstring)
        context = train.get_context()
        self.world_size = int(context.get_world_size())
        self.device = train.torch.get_device()
        self.replanned_for_world: int | None = None
        """The world size this object re-planned for because the given plan was for another one (None: it
        was not)."""
        loaded = _load_plan(plan) if plan is not None else None
        if loaded is None or loaded.world_size != self.world_size:
            if profile_fn is None:
                if loaded is None:
                    raise ValidationError("RayPlan needs a plan, or profile_fn= to profile the workers and solve")
                raise ValidationError(
                    f"the plan is for {loaded.world_size} worker(s) but Ray started {self.world_size}; pass "
                    "profile_fn= to re-profile and re-plan in the workers, or re-plan for this worker count")
            batch = global_batch if global_batch is not None else (loaded.global_batch if loaded else None)
            if batch is None:
                raise ValidationError("RayPlan(profile_fn=...) without a plan needs global_batch=")
            profile = profile_fn()
            if profile.world_size != self.world_size:
                raise ValidationError(f"profile_fn returned a profile of {profile.world_size} rank(s) for "
                                      f"{self.world_size} workers; it must profile every worker (profile_job)")
            solved = profile

            def decide() -> dict[str, Any]:
                return solve_within_noise(solved, global_batch=batch, options=options,
                                          min_batch=min_batch).to_dict()

            if loaded is not None:
                self.replanned_for_world = self.world_size
            loaded = Plan.from_dict(decide_on_rank0(decide), path="world rank 0's plan")
        self.run = PlannedRun(loaded, profile=profile, replan=replan, replan_threshold=replan_threshold,
                              log_file=log_file, seed=seed, shuffle=shuffle, drop_last=drop_last, quiet=quiet,
                              allow_workload_mismatch=allow_workload_mismatch)

    @property
    def plan(self) -> Plan:
        """The plan in force (a re-plan adopted at an epoch end replaces it)."""
        return self.run.plan

    def dataloader(self, dataset: Any, *, model: torch.nn.Module | None = None, num_workers: int | None = None,
                   **loader_kwargs: Any) -> DataLoader:  # type: ignore[type-arg]
        """This worker's planned DataLoader (collective: every worker calls it once).

        Args:
            dataset: a map-style dataset (``len`` and indexing), the same on every worker.
            model: the model ``ray.train.torch.prepare_model`` returned: its DDP gets the exact weighting hook and
                its first parameter's gradient closes each step's compute span.
            num_workers: loader workers (default: the plan's for this rank).
            loader_kwargs: other DataLoader arguments (collate_fn, pin_memory, ...; not batch_size or sampler).
        """
        bad = sorted({"batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"} & set(loader_kwargs))
        if bad:
            raise ValidationError(f"RayPlan.dataloader: {', '.join(bad)} come from the plan; drop them")
        sampler = self.run.sampler_for(len(dataset), self.device)
        sampler.weighting_fix = WEIGHTING_FIX
        sampler.epoch_fix = ("iterate `for batch in planned_epoch(loader, epoch)`, or call "
                             "loader.sampler.set_epoch(epoch) before each epoch's `for batch in loader`")
        workers = self.run.num_workers(0) if num_workers is None else int(num_workers)
        self.run.loader_workers = workers
        if model is not None:
            self.watch(model)
        return PlannedDataLoader(dataset, sampler, self, num_workers=workers, **loader_kwargs)

    def watch(self, model: torch.nn.Module) -> None:
        """Weight ``model``'s gradients exactly (its DDP's comm hook) and time its steps; ``dataloader(model=)``
        calls it.  Call it yourself when the model is prepared after the loader."""
        sampler = self.run.sampler
        if sampler is None:
            raise ValidationError("RayPlan.watch: make the loader first (planned.dataloader(data))")
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            register_weighted_hook(model, sampler)
            missing = settings_missing(model, self.run.ddp_kwargs())
            if missing:  # prepare_model built the DDP before the plan was seen: only the user can pass them
                warnings.warn(f"RayPlan: the prepared model lacks the plan's DDP settings ({', '.join(missing)}); pass "
                              "ray.train.torch.prepare_model(model, parallel_strategy_kwargs=ddp_kwargs(plan)) "
                              "(runtime.ddp_settings.ddp_kwargs)", stacklevel=2)
        elif self.world_size > 1 and dist.is_available() and dist.is_initialized():
            raise ValidationError(
                f"RayPlan: the model is a {type(model).__name__}, not the DistributedDataParallel that "
                "ray.train.torch.prepare_model returns; pass the prepared model")
        self.run.watch(model)

    def loss_scale(self, step: int, accumulation_steps: int = 1) -> float:
        """n_i * W / n for sampler step ``step`` (for a loop that scales the loss instead of the hook)."""
        return self.run.loss_scale(step, accumulation_steps)

    def epoch(self, epoch: int, loader: Iterable[T], *, last: bool = False,
              loss: Callable[[], float | None] | None = None) -> Iterator[T]:
        """``for batch in planned.epoch(epoch, loader, last=...)``: runtime.run.PlannedRun.epoch (the
        epoch's shuffle and split, timed steps, then the collective epoch end: re-plan and run log)."""
        return self.run.epoch(epoch, loader, last=last, loss=loss)


def planned_dataloader(plan: Plan | str | os.PathLike[str] | None, dataset: Any, *,
                       model: torch.nn.Module | None = None, num_workers: int | None = None,
                       loader_kwargs: dict[str, Any] | None = None, **plan_kwargs: Any) -> DataLoader:  # type: ignore[type-arg]
    """``RayPlan(plan, **plan_kwargs).dataloader(dataset, model=model, num_workers=num_workers, **loader_kwargs)``:
    this worker's planned DataLoader, to pass to ``ray.train.torch.prepare_data_loader`` (module docstring)."""
    return RayPlan(plan, **plan_kwargs).dataloader(dataset, model=model, num_workers=num_workers,
                                                   **(loader_kwargs or {}))


def planned_epoch(loader: Iterable[T], epoch: int, *, last: bool = False,
                  loss: Callable[[], float | None] | None = None) -> Iterator[T]:
    """``for batch in planned_epoch(loader, epoch, last=...)`` instead of ``for batch in loader``: the RayPlan's
    ``epoch`` (PlannedRun.epoch) over ``loader`` -- a planned loader, or Ray's wrapper of one."""
    view = getattr(loader, "sampler", None)
    if not isinstance(view, PlannedIndices):
        raise ValidationError("planned_epoch: the loader is not a planned one (make it with planned_dataloader, then "
                              "ray.train.torch.prepare_data_loader)")
    return view.planned.epoch(epoch, loader, last=last, loss=loss)
