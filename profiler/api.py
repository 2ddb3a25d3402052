"""Profile any training step: your model, your batches, your loss -- measured like `planner profile` measures.

    from profiler.api import batches_from, profile_job, profile_step

    def loss_fn(model, batch):                       # batch: whatever your DataLoader yields (dict, tuple, ...)
        return F.cross_entropy(model(batch["x"]), batch["y"])

    rank_profile = profile_step(model, batches_from(dataset), loss_fn, "cuda:0", data=dataset)   # this rank
    profile = profile_job(model, batches_from(dataset), loss_fn, device)   # under torch.distributed: every rank
    plan = planner.solve(profile, global_batch=512)

The step is timed with the same code as `planner profile --model ...` (profiler.compute.TimedSteps: warm-up,
median of repeats, CUDA synchronization, out-of-memory recovery; profiler.sweep's batch series and stop rules;
profiler.memory's largest batch that fits; profiler.run's loader turns, device facts and gathering), so a
profile from here plans exactly like one from the CLI.  What one step is:

  * ``model``: a module (deep-copied: profiling trains, and your weights must not move) or a zero-argument
    factory (no copy; prefer it for a model that barely fits);
  * ``make_batch(b)``: a batch of b samples, any structure; tensors inside tuples, lists and dicts are moved to
    the device.  ``batches_from(dataset, collate_fn)`` makes one from a map-style dataset;
  * ``loss_fn(model, batch)``: forward and loss as a scalar tensor.  It must call the model it is given (not a
    captured one): under torch.distributed the DDP overhead is measured with a DDP wrapper passed in;
  * ``optimizer_fn(model)``: your optimizer (default SGD, lr 1e-4, momentum 0.9: an Adam step costs more).

Emulated heterogeneity belongs in ``loss_fn`` (e.g. ``profiler.workloads.emulate.Slowdown(3).apply(model, F.mse_loss,
x, y)`` on one rank), exactly as in the training step it stands for.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, default_collate

from planner.profile import LoaderProfile, Profile, RankProfile
from planner.shadow import require_runtime

require_runtime()  # before the imports below reach it: a user's own package named runtime is one clear line

from profiler import inventory  # noqa: E402
from profiler.compiled import compile_options, compile_runner  # noqa: E402
from profiler.compute import TimedSteps  # noqa: E402
from profiler.loader import LoaderOptions, profile_loader  # noqa: E402
from profiler.run import assemble_profile, gather_ranks, measure_rank, sweep_options  # noqa: E402
from profiler.sweep import SweepOptions, SweepPoint  # noqa: E402
from runtime.collectives import broadcast_json  # noqa: E402

LossFn = Callable[[nn.Module, Any], torch.Tensor]
"""loss_fn(model, batch) -> scalar loss tensor (forward included)."""
MakeBatch = Callable[[int], Any]
"""make_batch(batch_size) -> a batch of that many samples, any structure."""
OptimizerFn = Callable[[nn.Module], torch.optim.Optimizer]


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor inside tuples, lists and dicts moved to ``device`` (other leaves kept)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple keeps its type
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def batches_from(data: Any, collate_fn: Callable[[list[Any]], Any] | None = None) -> MakeBatch:
    """make_batch for a map-style dataset (or a DataLoader over one): samples 0..b-1, cycling, collated.

    The collate function is ``collate_fn``, else the DataLoader's, else torch's ``default_collate``: the batch
    has exactly the structure your training loop receives.
    """
    dataset, collate = _dataset_and_collate(data, collate_fn)
    n = len(dataset)
    if n == 0:
        from planner.errors import ValidationError

        raise ValidationError("batches_from: the dataset is empty")
    return lambda b: collate([dataset[i % n] for i in range(b)])


def _dataset_and_collate(data: Any, collate_fn: Callable[[list[Any]], Any] | None) -> tuple[Any, Callable[..., Any]]:
    if isinstance(data, DataLoader):
        return data.dataset, collate_fn or data.collate_fn
    return data, collate_fn or default_collate


class UserStep(TimedSteps):
    """A user's model, batches and loss on one device (profiler.compute's timing, OOM recovery, optimizer)."""

    def __init__(self, model: nn.Module | Callable[[], nn.Module], make_batch: MakeBatch, loss_fn: LossFn,
                 device: torch.device | str, *, optimizer_fn: OptimizerFn | None = None, amp: bool = False) -> None:
        module = copy.deepcopy(model) if isinstance(model, nn.Module) else model()
        dev = torch.device(device)
        self._make_batch, self._loss_fn = make_batch, loss_fn
        super().__init__(module.to(dev), dev, amp=amp, optimizer_fn=optimizer_fn or _default_optimizer)

    def make_batch(self, batch_size: int) -> Any:
        return to_device(self._make_batch(batch_size), self.device)

    def loss(self, module: nn.Module, batch: Any) -> torch.Tensor:
        loss = self._loss_fn(module, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            from planner.errors import ValidationError

            raise ValidationError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                                  + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
        return loss


def _default_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # A small lr keeps weights finite over hundreds of random-data steps (as profiler.compute.StepRunner).
    return torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)


def profile_step(
    model: nn.Module | Callable[[], nn.Module],
    make_batch: MakeBatch,
    loss_fn: LossFn,
    device: torch.device | str = "cpu",
    *,
    optimizer_fn: OptimizerFn | None = None,
    data: Any = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    quick: bool = False,
    batch_sizes: Sequence[int] | None = None,
    min_batch: int = 1,
    amp: bool = False,
    sweep: SweepOptions | None = None,
    loader: LoaderOptions | None = None,
    rank: int | None = None,
    on_point: Callable[[SweepPoint], None] | None = None,
    max_batch: int | None = None,
    compile: bool | str | None = None,
    compile_backend: str = "inductor",
    compile_dynamic: bool = True,
) -> RankProfile:
    """Measure this rank's training step: compute curve, memory cap, loader cost (``data`` given), device facts.

    Collective under torch.distributed (loaders are measured one local rank at a time): every rank calls it.

    Args:
        model, make_batch, loss_fn, optimizer_fn: one training step (see the module docstring).
        device: where the step runs (``"cuda:0"``, ``"cpu"``).
        data: your dataset or DataLoader; its loader cost (seconds per sample of one worker, scaling over
            workers) is measured with its own collate function.  None: no loader cost (the plan then assumes the
            loader keeps up).
        quick: a CI-sized sweep (seconds); batch_sizes: explicit local batches instead of the geometric series.
        min_batch: smallest batch tried (2 for BatchNorm models).
        amp: bf16 autocast around the forward and loss, as in training with autocast.
        rank: the rank to record (default: the process group's rank, or 0).
        max_batch: the largest local batch a plan can give this rank (the global batch you will plan for): the
            sweep stops there.  None: the sweep's own limit.
        compile: time the step compiled -- ``torch.compile(model, mode=compile, backend=compile_backend)`` (True:
            mode "default"), dim 0 of every batch tensor marked dynamic before the first step (profiler.compiled);
            the compute points are compiled steps and ``meta["compile"]`` records the compile (first_s,
            recompile_s, recompiles, sizes).  None: eager.  The DDP overhead (``gather``) is measured eager.
            ``compile_dynamic=False``: static shapes (``torch.compile(dynamic=False)``, nothing marked), every new
            size compiles -- as a run with CUDA graphs or static shapes will.
    """
    copts = compile_options(compile, compile_backend, dynamic_batch=compile_dynamic)
    sopts = sweep_options(quick, batch_sizes, sweep, min_batch=min_batch, max_batch=max_batch)
    measure_loader = None
    if data is not None:
        dataset, collate = _dataset_and_collate(data, collate_fn)
        lopts = loader or (LoaderOptions.quick() if quick else LoaderOptions())

        def measure_loader() -> tuple[LoaderProfile, dict[str, Any]]:
            return profile_loader(dataset, lopts, collate_fn=collate)

    return measure_rank(
        lambda dev: compile_runner(UserStep(model, make_batch, loss_fn, dev, optimizer_fn=optimizer_fn, amp=amp), copts),
        device,
        sweep=sopts, rank=rank, measure_loader=measure_loader, on_point=on_point,
        meta={"step": "user", "model_class": _model_name(model)})


def gather(rank_profile: RankProfile, model: nn.Module | Callable[[], nn.Module], make_batch: MakeBatch,
           loss_fn: LossFn, *, optimizer_fn: OptimizerFn | None = None, amp: bool = False,
           model_name: str | None = None, measure_ddp: bool = True, comm_repeats: int = 10,
           meta: Mapping[str, Any] | None = None) -> Profile:
    """Collective: every rank's profile, the all-reduce time and the DDP overhead, as one Profile on EVERY rank.

    Rank 0 assembles it (profiler.run.gather_ranks) and broadcasts it as JSON (runtime.collectives.broadcast_json), so
    each rank can solve, check or save the same profile.  Without a process group: this rank's Profile.
    ``measure_ddp`` runs a few real DDP steps of the same step (``loss_fn`` gets the DDP wrapper).
    """
    def make_runner() -> TimedSteps:
        return UserStep(model, make_batch, loss_fn, rank_profile.device, optimizer_fn=optimizer_fn, amp=amp)

    name = model_name or _model_name(model)
    profile = gather_ranks(rank_profile, model_name=name, make_runner=make_runner if measure_ddp else None,
                           comm_repeats=comm_repeats, meta={"profiled": "profiler.api", **(meta or {})})
    if not (dist.is_available() and dist.is_initialized()):
        assert profile is not None
        return profile
    shared = broadcast_json(profile.to_dict() if profile is not None else None, 0)
    return profile if profile is not None else Profile.from_dict(shared, path="rank 0's profile")


def profile_job(model: nn.Module | Callable[[], nn.Module], make_batch: MakeBatch, loss_fn: LossFn,
                device: torch.device | str = "cpu", *, optimizer_fn: OptimizerFn | None = None, amp: bool = False,
                model_name: str | None = None, meta: Mapping[str, Any] | None = None, **kw: Any) -> Profile:
    """``profile_step`` then ``gather``: the whole job's Profile on every rank (one rank without a group).

    ``kw`` goes to profile_step (data, quick, batch_sizes, min_batch, sweep, loader, ...).
    """
    rp = profile_step(model, make_batch, loss_fn, device, optimizer_fn=optimizer_fn, amp=amp, **kw)
    return gather(rp, model, make_batch, loss_fn, optimizer_fn=optimizer_fn, amp=amp, model_name=model_name,
                  meta=meta)


def local_profile(rank_profiles: Sequence[RankProfile], *, model_name: str = "model",
                  meta: Mapping[str, Any] | None = None) -> Profile:
    """One Profile from RankProfiles measured in this process (several local devices in turn, ranks 0..n-1;
    no communication measured) -- as `planner profile --devices cuda:0,cpu` does."""
    return assemble_profile(list(rank_profiles), [inventory.host_profile()], model_name, None,
                     {"profiled": "profiler.api", **(meta or {})})


def _model_name(model: Any) -> str:
    return type(model).__name__ if isinstance(model, nn.Module) else getattr(model, "__name__", "model")
