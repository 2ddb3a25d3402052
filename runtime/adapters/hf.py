"""A plan applied to the Hugging Face ``Trainer``: each rank's planned batch and the exact token-mean gradient.

    from runtime.adapters.hf import planned_trainer

    trainer = planned_trainer("plan.json", model=model, args=training_args, train_dataset=data)  # was Trainer(...)
    trainer.train()

``planned_trainer(plan, trainer_cls=Trainer, **kwargs)`` builds ``trainer_cls(**kwargs)`` (any Trainer subclass:
pass yours) with three things changed through the Trainer's own extension points:

  * ``get_train_dataloader`` (the override the Trainer documents for custom loading) returns a DataLoader over the
    planned ``HeteroBatchSampler`` -- this rank's planned batch, exactly-once coverage, the same number of steps
    on every rank -- and does NOT pass it through ``accelerator.prepare``, whose ``BatchSamplerShard`` would hand
    each process every W-th of *its own* batches. ``per_device_train_batch_size`` is then unused. The Trainer
    moves each batch to the device itself (``_prepare_inputs``) and calls the loader's ``set_epoch``.
  * the weighting. A causal-LM loss is a mean over counted target tokens, so ranks must be weighted by tokens, not
    samples (huggingface/transformers#34242). ``get_batch_samples`` (called once per optimizer step with the step's
    micro-batches) counts each micro-batch's tokens and runs one scalar all-reduce (runtime.weighting.step_weights);
    the model returns its own mean loss (the Trainer's ``num_items_in_batch`` is not passed to it) and
    ``compute_loss`` multiplies micro-batch j's mean by w_ij * W / N, so DDP's average gives sum_ij (w_ij / N) g_ij:
    the token mean over every rank's step, exactly. Tokens are counted as the loss averages them: ``labels !=
    -100``, shifted by one when the model's loss is transformers' causal-LM loss; ``count_tokens=`` for another
    rule. Why not the Trainer's own ``average_tokens_across_devices`` path (it gathers the global count too): in
    transformers 5.24 it counts a GPT-2's targets unshifted (its config has no ``loss_type``, so the Trainer does not
    see that the loss shifts), one token per sequence too many, and the step's gradient comes out scaled by
    N / (N + sequences). With a ``compute_loss_func`` the Trainer's path is kept (that function receives the
    Trainer's count); the adapter turns ``average_tokens_across_devices`` on if it is off.
  * a ``TrainerCallback``: the StepTimer around every batch (data wait, compute closed when backward reaches the
    model's first parameter), and at every epoch end the Replanner (collective; adopted batch sizes apply from
    the next epoch) and the run log on rank 0 (runtime.run.PlannedRun).

Predictions: the profiler times the model's step in its own DDP loop; ``measure_trainer_overhead(profile,
scratch_trainer)`` adds the Trainer's own per-step work (measured on a scratch Trainer at the equal split) to the
profile before solving, so the plan predicts the Trainer's steps (docs/FRAMEWORKS.md).

The weighting happens in ``compute_loss``: a Trainer subclass whose ``training_step`` computes its loss another
way leaves it unweighted, and with an uneven plan its first backward is refused on every rank, with the line
naming the fix (runtime.safety's check; counting the step's tokens alone does not count as weighting).

Not covered: resuming mid-epoch from a Trainer checkpoint (the Trainer's ``skip_first_batches`` rebuilds the
loader without the planned sampler: resume at an epoch boundary), DeepSpeed and FSDP through the Trainer, and
step timing with gradient accumulation (the Trainer fetches a step's micro-batches before running them, so the
timer sees fetch and compute out of order: use accumulation 1 when re-planning). transformers is imported only
when a trainer is built; a missing one is one line naming ``pip install ddp-planner[hf]``.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from planner.errors import ValidationError
from planner.plan import Plan
from planner.profile import Profile
from runtime.adapters.accelerate import apply_ddp_settings
from runtime.collectives import all_gather_json, is_distributed
from runtime.run import PlannedRun
from runtime.safety import note_weighting
from runtime.weighting import StepWeights, step_weights

INSTALL_HINT = "pip install ddp-planner[hf]"
WEIGHTING_FIX = ("planned_trainer weights each micro-batch's loss in its compute_loss, which this Trainer's step "
                 "never called; compute the loss with self.compute_loss(model, inputs) (or pass compute_loss_func=)")
"""The fix named when an uneven plan's first backward ran without the adapter's factor (runtime.safety's check)."""

CountTokens = Callable[[dict[str, Any]], "int | torch.Tensor"]
"""count_tokens(batch) -> the number of target tokens the batch's mean loss averages over."""


class PlannedLoader(DataLoader[Any]):
    """The planned training DataLoader: times every batch; ``set_epoch`` selects the epoch's shuffle (and a re-plan
    adopted at the last epoch end)."""

    def __init__(self, dataset: Any, *, run: PlannedRun, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.run = run
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self.run.epoch_start(self.epoch)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator around DataLoader's iterator
        yield from self.run.timed(super().__iter__())  # handed over: the Trainer's forward starts at each batch


class _PlannedTrainerMixin:
    """What ``planned_trainer`` adds to a Trainer class (module docstring). Mixed in before the Trainer."""

    planned_run: PlannedRun
    count_tokens: CountTokens | None
    own_weighting: bool
    step_weights: StepWeights | None
    micro_index: int
    planned_workers: int | None
    shift_labels: bool
    last_scale: float | None

    def _init_planned(self, run: PlannedRun, count_tokens: CountTokens | None, num_workers: int | None) -> None:
        t: Any = self
        self.planned_run, self.count_tokens, self.planned_workers = run, count_tokens, num_workers
        self.step_weights, self.micro_index, self.last_scale = None, 0, None
        if count_tokens is not None and t.compute_loss_func is not None:
            raise ValidationError("planned_trainer: count_tokens and compute_loss_func both define the loss's token "
                                  "count; drop count_tokens (compute_loss_func gets the Trainer's global count)")
        hf_counts = t.compute_loss_func is not None
        if hf_counts and not t.args.average_tokens_across_devices:
            warnings.warn("planned_trainer: turning average_tokens_across_devices on -- without it each rank divides by "
                          "its own token count and uneven ranks get a biased gradient", stacklevel=3)
            t.args.average_tokens_across_devices = True
        self.own_weighting = not hf_counts
        if hf_counts:  # the Trainer's own global token count weights the loss (module docstring)
            note_weighting("planned_trainer: compute_loss_func")
        self.shift_labels = _loss_shifts_labels(t.model)
        if self.own_weighting:
            # The model must return its own mean (no num_items_in_batch, no factor W from the Trainer): the exact
            # factor is ours alone.
            t.model_accepts_loss_kwargs = False
            if hasattr(type(t), "loss_is_scaled_for_ga"):
                t.loss_is_scaled_for_ga = True  # our factor holds the step's 1/K already

    # -- data -----------------------------------------------------------------------------------------------------
    def get_train_dataloader(self) -> DataLoader[Any]:
        t: Any = self
        if t.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        run = self.planned_run
        sampler = run.sampler_for(len(t.train_dataset), t.args.device)
        if run.sampler is not None:  # what the first backward's check names when compute_loss never weighted
            run.sampler.weighting_fix = WEIGHTING_FIX
        run.watch(t.model)
        workers = run.num_workers(0) if self.planned_workers is None else self.planned_workers
        run.loader_workers = workers
        return PlannedLoader(t.train_dataset, run=run, batch_sampler=sampler, collate_fn=t.data_collator,
                             num_workers=workers, pin_memory=t.args.dataloader_pin_memory)

    # -- exact token weighting: the step's counts, one scalar all-reduce, the factor on each micro-batch's mean ----
    def get_batch_samples(self, epoch_iterator: Iterator[Any], num_batches: int,
                          device: torch.device) -> tuple[list[Any], Any]:
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)  # type: ignore[misc]
        if self.own_weighting and batches:
            count = self.count_tokens or self._default_count
            self.step_weights = step_weights([count(b) for b in batches])  # the step's one scalar all-reduce
            self.micro_index = 0
        return batches, num_items

    def _default_count(self, batch: dict[str, Any]) -> torch.Tensor:
        if "labels" not in batch:
            raise ValidationError("planned_trainer: the batch has no 'labels' to count tokens in; pass count_tokens=")
        labels = batch.get("shift_labels")
        if labels is None:
            labels = batch["labels"][..., 1:] if self.shift_labels else batch["labels"]
        return (labels != -100).sum()

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        out = super().compute_loss(model, inputs, return_outputs=return_outputs,  # type: ignore[misc]
                                   num_items_in_batch=num_items_in_batch)
        w = self.step_weights
        if not self.own_weighting or w is None or not model.training:
            return out
        t: Any = self
        scale = self.last_scale = w.loss_scale(self.micro_index)
        if not hasattr(type(t), "loss_is_scaled_for_ga"):  # older Trainers divide by K themselves: put it back
            scale *= t.current_gradient_accumulation_steps
        self.micro_index += 1
        if return_outputs:
            loss, outputs = out
            return loss * scale, outputs
        return out * scale

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
        """The Trainer's step; the loss it returns for logging is this rank's mean / K, as the stock Trainer logs it
        (the backward used the weighted loss: the factor is taken out of the reported value only)."""
        self.last_scale = None
        loss = super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]
        if self.last_scale:  # None: not weighted here; 0: a rank without tokens reports 0
            t: Any = self
            loss = loss / (self.last_scale * t.current_gradient_accumulation_steps)
        return loss


def _loss_shifts_labels(model: Any) -> bool:
    """Whether the model's loss predicts label t+1 at position t (transformers' causal-LM loss), so that the
    first label of every row is never a target. ``loss_function`` resolves a config without ``loss_type`` to the
    model's default loss, which the Trainer's own check (by ``loss_type``) misses."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return False
    encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    return getattr(model, "loss_function", None) is ForCausalLMLoss and not encoder_decoder


def _callback(trainer_module: Any) -> Any:
    class PlannedCallback(trainer_module.TrainerCallback):  # type: ignore[misc, name-defined]
        """Epoch ends: re-plan (collective) and the run log; the log's end record when training ends."""

        def __init__(self, run: PlannedRun) -> None:
            self.run = run

        def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            loader = kwargs.get("train_dataloader")
            epoch = int(getattr(loader, "epoch", int(state.epoch or 1) - 1))
            self.run.epoch_end(epoch, last=state.max_steps > 0 and state.global_step >= state.max_steps)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.run.finish(max(1, round(state.epoch or 0)))

    return PlannedCallback


def planned_trainer(plan: Plan | str | os.PathLike[str], *, trainer_cls: type[Any] | None = None,
                    profile: Profile | str | os.PathLike[str] | None = None, replan: bool = False,
                    replan_threshold: float = 0.05, log_file: str | os.PathLike[str] | None = None,
                    count_tokens: CountTokens | None = None, num_workers: int | None = None, quiet: bool = False,
                    allow_workload_mismatch: bool = False, **trainer_kwargs: Any) -> Any:
    """``trainer_cls(**trainer_kwargs)`` (default ``transformers.Trainer``) training on the plan (module docstring).

    Args:
        plan: Plan or plan JSON path, the same on every rank.
        trainer_cls: the Trainer class to build (``Trainer`` or a subclass of it).
        profile, replan, replan_threshold, log_file, quiet, allow_workload_mismatch: see runtime.run.PlannedRun (the
            model the Trainer trains is compared with the plan's when the loader is built; the shuffle seed is the
            TrainingArguments' ``data_seed``, else ``seed``; the order follows its ``train_sampling_strategy``:
            ``trainer_shuffles``).
        count_tokens: ``count_tokens(batch)`` -> the tokens the batch's mean loss averages over (default: labels !=
            -100, shifted for a transformers causal-LM loss).
        num_workers: training loader workers (default: the plan's for this rank).
        trainer_kwargs: the Trainer's own arguments (model, args, train_dataset, data_collator, callbacks, ...).
    """
    try:
        import transformers
    except ImportError:
        raise ValidationError(f"transformers is not installed: {INSTALL_HINT}") from None
    cls = trainer_cls or transformers.Trainer
    if not (isinstance(cls, type) and issubclass(cls, transformers.Trainer)):
        raise ValidationError(f"trainer_cls must be transformers.Trainer or a subclass, got {cls!r}")
    args = trainer_kwargs.get("args")
    seed = 0 if args is None else (args.data_seed if args.data_seed is not None else args.seed)
    drop_last = bool(getattr(args, "dataloader_drop_last", False))
    run = PlannedRun(plan, profile=profile, replan=replan, replan_threshold=replan_threshold, log_file=log_file,
                     seed=seed, shuffle=trainer_shuffles(args), drop_last=drop_last, quiet=quiet,
                     allow_workload_mismatch=allow_workload_mismatch)
    planned_cls = type(f"Planned{cls.__name__}", (_PlannedTrainerMixin, cls), {})
    trainer = planned_cls(**trainer_kwargs)
    trainer._init_planned(run, count_tokens, None if num_workers is None else int(num_workers))
    # The plan's DDP settings into the DistributedDataParallelKwargs the Trainer built from its TrainingArguments
    # (ddp_bucket_cap_mb, ddp_static_graph); a value set there stays.
    apply_ddp_settings(getattr(trainer, "accelerator", None), run.ddp_kwargs(), who="planned_trainer")
    trainer.add_callback(_callback(transformers)(run))
    return trainer


def trainer_shuffles(args: Any) -> bool:
    """Whether the Trainer would shuffle the training set, from its ``TrainingArguments``: ``train_sampling_strategy``
    "random" (the default) shuffles, "sequential" keeps the dataset's order; the planned sampler follows.

    Raises:
        ValidationError: a length-grouping strategy ("group_by_length", "batch_rebalance", or the older
            ``group_by_length=True``), which the planned sampler replaces and cannot reproduce.
    """
    if args is None:
        return True
    strategy = getattr(args, "train_sampling_strategy", None)
    if strategy is None:  # transformers before train_sampling_strategy: group_by_length or a RandomSampler
        strategy = "group_by_length" if getattr(args, "group_by_length", False) else "random"
    if strategy in ("random", "sequential"):
        return bool(strategy == "random")
    raise ValidationError(f"planned_trainer: train_sampling_strategy {strategy!r} groups samples by length, which "
                          "the plan's sampler (each rank's planned batch) replaces; use 'random' or 'sequential'")


def measure_trainer_overhead(profile: Profile, trainer: Any, *, steps: int = 12, warmup: int = 4) -> Profile:
    """``profile`` calibrated to the Trainer's own loop: ``planner.calibrate_overhead`` with the mean step of
    ``steps`` Trainer steps at the Trainer's own split (``per_device_train_batch_size`` on every rank).

    The profiler times the model's step in its own DDP loop; the Trainer adds host work, synchronizations and
    callbacks to every step -- 7-8 ms on 2 H100s for a 110M LM, the same at the equal and at the planned split
    (docs/PERFORMANCE.md) -- which moves every prediction and never the split.  Plans solved from the
    returned profile predict the Trainer's steps; call it on every rank (collective), before ``planner.solve``:

        profile = measure_trainer_overhead(profile, Trainer(model=scratch_model, args=args, train_dataset=data))
        plan = planner.solve(profile, global_batch=B)

    ``trainer`` is trained for ``warmup + steps`` optimizer steps (``max_steps`` is set for the call): give it a
    scratch model.  The window runs from the end of step ``warmup`` to the end of the last, synchronized at both
    ends (device and a barrier); every rank takes the slowest rank's mean.  Gradient accumulation 1.

    Raises:
        ValidationError: accumulation above 1, a world size other than the profile's, or fewer than 1 timed
            or warm-up step.  A Trainer faster than the profile's compute sets no overhead (a warning says so).
    """
    import torch.distributed as dist

    from planner.solve import calibrate_overhead

    args = trainer.args
    if steps < 1 or warmup < 1:
        raise ValidationError(f"measure_trainer_overhead: steps {steps} and warmup {warmup} must be >= 1")
    if args.gradient_accumulation_steps != 1:
        raise ValidationError("measure_trainer_overhead: use gradient_accumulation_steps 1 (the profile's step is "
                              f"one micro-batch), got {args.gradient_accumulation_steps}")
    world = dist.get_world_size() if is_distributed() else 1
    if world != profile.world_size:
        raise ValidationError(f"measure_trainer_overhead: {world} processes, the profile has {profile.world_size} ranks")
    window = step_window(args.device, warmup, warmup + steps)
    trainer.add_callback(window)
    old_max = args.max_steps
    args.max_steps = warmup + steps
    try:
        trainer.train()
    finally:
        args.max_steps = old_max
        trainer.remove_callback(window)
    step_s = max(all_gather_json(window.seconds / steps))  # one number on every rank: each solves the same plan
    per = int(args.per_device_train_batch_size)
    return calibrate_overhead(profile, [per] * world, step_s,
                              source=f"HF Trainer ({type(trainer).__name__}), {steps} steps after {warmup}")


def step_window(device: torch.device | str, first: int, last: int) -> Any:
    """A ``TrainerCallback`` timing the window from the end of optimizer step ``first`` to the end of step ``last``,
    synchronized at both ends (the device, then a barrier under torch.distributed); ``.seconds`` once trained.
    ``measure_trainer_overhead`` times the Trainer with it, and benchmarks/hf_gpu.py its runs."""
    try:
        import transformers
    except ImportError:
        raise ValidationError(f"transformers is not installed: {INSTALL_HINT}") from None
    dev = torch.device(device)

    def sync() -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if is_distributed():
            torch.distributed.barrier()
        return time.perf_counter()

    class StepWindow(transformers.TrainerCallback):  # type: ignore[misc, name-defined]
        t0 = t1 = 0.0

        @property
        def seconds(self) -> float:
            return self.t1 - self.t0

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == first:
                self.t0 = sync()
            elif state.global_step == last:
                self.t1 = sync()

    return StepWindow()
