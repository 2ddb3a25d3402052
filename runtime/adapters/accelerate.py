"""A plan applied to a Hugging Face Accelerate training loop.

    from runtime.adapters.accelerate import planned_dataloader

    accelerator = Accelerator()                                       # gradient_accumulation_steps=K works too
    loader = planned_dataloader(accelerator, "plan.json", dataset, model=model, shuffle=True)  # was DataLoader(...)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)      # returns this loader as is
    for epoch in range(epochs):
        for batch in loader:
            with accelerator.accumulate(model):
                loss = loss_fn(model(batch["x"]), batch["y"])
                accelerator.backward(loss * loader.loss_scale())          # exact sample-weighted gradient
                optimizer.step(); optimizer.zero_grad()

The loader is accelerate's own ``DataLoaderShard`` (device placement, the end-of-epoch signal that
``accelerator.accumulate`` synchronizes on, ``set_epoch``) built over the planned ``HeteroBatchSampler``, so it
yields this rank's planned batches, already on the device.  It carries accelerate's "already prepared" mark:
``accelerator.prepare`` registers it and returns it unchanged instead of wrapping its sampler in a
``BatchSamplerShard``, which would hand each process every W-th of *its own* batches (tests/frameworks check
that prepare leaves it alone).  Passing it to prepare is optional.

``loss_scale()`` is n_i * W / n for the batch just yielded, over the window of K micro-batches that
``accelerator.accumulate`` synchronizes (windows of K from each epoch start, the epoch's last batch closing one,
as accelerate does), times K because ``accelerator.backward`` divides the loss by K: DDP's averaging all-reduce
then yields the sample-weighted mean gradient, exactly.  (DeepSpeed scales the loss itself: no K there.)  A loop
that forgets the factor with an uneven plan is refused at its first backward through the DDP model, on every
process, with the line naming it (runtime.safety.arm_weighting_check): accelerate's averaging alone would train a
wrong gradient without a word.

Timing, re-planning and the run log need no call: the loader times every batch (data wait around the fetch;
compute from the batch's hand-over until backward reaches ``model``'s first parameter, so pass ``model=`` --
without it compute includes the wait for the peers and re-planning cannot see who is slow), and when an epoch's
batches are exhausted it runs the epoch end on every rank (PlannedRun.epoch_end: the Replanner, whose batch
sizes apply from the next epoch, and the run log).  A loop that breaks out of an epoch early skips that epoch end.

The DDP settings the plan records (``plan.meta["ddp"]``: runtime.ddp_settings) go into the accelerator's
``DistributedDataParallelKwargs`` (a value you set there yourself stays), which ``accelerator.prepare(model)``
builds DDP with: so call ``planned_dataloader`` before preparing the model, as above (after, one warning says
they were not applied).
Accelerate is imported only when a loader is made; a missing one is one line naming
``pip install ddp-planner[accelerate]``.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from planner.errors import ValidationError
from planner.plan import Plan
from planner.profile import Profile
from runtime.run import PlannedRun

INSTALL_HINT = "pip install ddp-planner[accelerate]"
WEIGHTING_FIX = "multiply the loss by the planned loader's factor: accelerator.backward(loss * loader.loss_scale())"
"""The fix named when an uneven plan's first backward ran without the loss scale (runtime.safety's check)."""


def planned_dataloader(accelerator: Any, plan: Plan | str | os.PathLike[str], dataset: Any, *,
                       model: torch.nn.Module | None = None, profile: Profile | str | os.PathLike[str] | None = None,
                       replan: bool = False, replan_threshold: float = 0.05,
                       log_file: str | os.PathLike[str] | None = None, seed: int = 0, shuffle: bool | None = None,
                       drop_last: bool = False, epochs: int | None = None, num_workers: int | None = None,
                       quiet: bool = False, allow_workload_mismatch: bool = False, **loader_kwargs: Any) -> Any:
    """This rank's planned DataLoader for an ``Accelerator`` (collective: every process calls it).

    Args:
        accelerator: the run's ``accelerate.Accelerator`` (its process group is the job's).
        plan: Plan or plan JSON path, the same on every process.
        dataset: a map-style dataset (``len`` and indexing).
        model: the model (before or after ``prepare``): its first parameter's gradient closes each step's
            compute span.
        shuffle: required, as the DataLoader this call replaces had it (``DataLoader``'s default is False):
            True draws each epoch's order from ``seed + epoch``, False keeps the dataset's order.  The planned
            loader cannot see the loader it replaces, so it does not guess.
        profile, replan, replan_threshold, log_file, seed, drop_last, quiet, allow_workload_mismatch: see
            runtime.run.PlannedRun.
        epochs: the number of epochs, when known: the last epoch end writes the run log's end record and skips the
            (useless) re-plan.
        num_workers: loader workers (default: the plan's for this rank).
        loader_kwargs: other ``DataLoader`` arguments (collate_fn, pin_memory, ...; not batch_size or sampler).
    """
    bad = sorted({"batch_size", "sampler", "batch_sampler", "drop_last"} & set(loader_kwargs))
    if bad:
        raise ValidationError(f"planned_dataloader: {', '.join(bad)} come from the plan; drop them")
    if replan and model is None:
        warnings.warn("planned_dataloader(replan=True) without model=: compute times include waiting for the peers, "
                      "so the re-planner cannot tell which process is slow", stacklevel=2)
    loader_cls = _loader_class()
    if shuffle is None:
        raise ValidationError("planned_dataloader: pass shuffle=True or shuffle=False, as the DataLoader it replaces "
                              "had it (DataLoader's default is False): the planned loader cannot see yours")
    run = PlannedRun(plan, profile=profile, replan=replan, replan_threshold=replan_threshold, log_file=log_file,
                     seed=seed, shuffle=shuffle, drop_last=drop_last, quiet=quiet,
                     allow_workload_mismatch=allow_workload_mismatch)
    sampler = run.sampler_for(len(dataset), accelerator.device)
    if run.sampler is not None:  # what the first backward's check names when the loss is not scaled
        run.sampler.weighting_fix = WEIGHTING_FIX
    apply_ddp_settings(accelerator, run.ddp_kwargs(), model)
    if model is not None:
        run.watch(model)
    workers = run.num_workers(0) if num_workers is None else int(num_workers)
    run.loader_workers = workers
    return loader_cls(dataset, run=run, accelerator=accelerator, epochs=epochs, batch_sampler=sampler,
                      num_workers=workers, device=accelerator.device if accelerator.device_placement else None,
                      _non_blocking=bool(getattr(accelerator, "non_blocking", False)), **loader_kwargs)


def apply_ddp_settings(accelerator: Any, settings: dict[str, Any], model: torch.nn.Module | None = None, *,
                       who: str = "planned_dataloader") -> bool:
    """Put the plan's DDP ``settings`` into ``accelerator.ddp_handler`` (created when absent; a field you set
    away from accelerate's default stays yours).  False, with one warning, when the model is already wrapped in
    DDP (``prepare`` ran first) or the accelerator has no DDP handler to carry them."""
    if not settings:
        return True
    listed = ", ".join(f"{k}={v}" for k, v in sorted(settings.items()))
    wrapped = isinstance(model, torch.nn.parallel.DistributedDataParallel) or any(
        isinstance(m, torch.nn.parallel.DistributedDataParallel) for m in getattr(accelerator, "_models", ()))
    if wrapped or not hasattr(accelerator, "ddp_handler"):
        warnings.warn(f"{who}: the plan's DDP settings ({listed}) are not applied: "
                      + (f"the model was prepared before {who}; call it before accelerator.prepare(model)"
                         if wrapped else "this accelerator has no ddp_handler")
                      + " or pass Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(**ddp_kwargs(plan))])",
                      stacklevel=3)
        return False
    from accelerate.utils import DistributedDataParallelKwargs

    handler = accelerator.ddp_handler
    if handler is None:
        accelerator.ddp_handler = DistributedDataParallelKwargs(**settings)
        return True
    defaults = DistributedDataParallelKwargs()
    for key, value in settings.items():
        if getattr(handler, key) == getattr(defaults, key):
            setattr(handler, key, value)
    return True


@functools.cache
def _loader_class() -> type[Any]:
    """accelerate's DataLoaderShard with the planned run's timing, loss scale and epoch end (built once)."""
    try:
        from accelerate.data_loader import DataLoaderShard
    except ImportError:
        raise ValidationError(f"Accelerate is not installed: {INSTALL_HINT}") from None

    class PlannedDataLoader(DataLoaderShard):  # type: ignore[misc, valid-type]
        """See the module docstring.  ``type(loader)`` is this class; ``loader.__class__`` says DataLoader (as
        every accelerate loader does)."""

        def __init__(self, dataset: Any, *, run: PlannedRun, accelerator: Any, epochs: int | None,
                     **kwargs: Any) -> None:
            super().__init__(dataset, **kwargs)
            self.run = run
            self.accelerator = accelerator
            self.epochs = epochs
            self.step = -1
            """Index in the epoch of the batch last yielded (the sampler step the loss scale is for)."""
            # accelerate's own mark for a loader it must not wrap again (Accelerator.prepare_data_loader).
            self._is_accelerate_prepared = True

        def __iter__(self) -> Iterator[Any]:
            run, epoch = self.run, int(self.iteration)
            last = self.epochs is not None and epoch + 1 >= self.epochs
            self.step = -1
            # The epoch's shuffle and a re-plan adopted at the last epoch end, every step timed, then the epoch end.
            for i, batch in enumerate(run.epoch(epoch, super().__iter__(), last=last)):
                self.step = i
                yield batch

        def loss_scale(self) -> float:
            """Multiply the mean loss by this before ``accelerator.backward`` (exact weighting; module docstring)."""
            if self.step < 0:
                raise ValidationError("loss_scale() is for the batch just drawn from this loader; draw one first")
            acc = self.accelerator
            k = max(1, int(acc.gradient_accumulation_steps))
            deepspeed = getattr(acc.distributed_type, "value", str(acc.distributed_type)) == "DEEPSPEED"
            return self.run.loss_scale(self.step, k) * (1 if deepspeed else k)

    return PlannedDataLoader
