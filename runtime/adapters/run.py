"""What a framework adapter adds to a training run, free of any framework: ``PlannedRun``.

Both adapters (runtime.adapters.lightning, runtime.adapters.accelerate) are thin: they find the framework's
extension points and call this object, which holds the exactness and the bookkeeping --

  * the planned sampler: ``HeteroBatchSampler`` over the plan, built once the dataset length and the rank are
    known, after the agreement check (world size, plan fingerprint, dataset length, seed: a mismatch is one
    error on every rank instead of a hang);
  * the exact loss scale: ``loss_scale(step, K)`` = n_i * W / n over the step's accumulation window, the factor
    that makes DDP's averaging all-reduce give the sample-weighted mean gradient (runtime.weighting);
  * the StepTimer (data wait, local compute closed on the first parameter's gradient, step time);
  * the DDP constructor keywords the plan records (``ddp_kwargs()``: runtime.ddp_settings) and, in an own loop,
    the exact weighting hook with the run's opt-in gradient compression (``register_weighting``: runtime.compress);
  * at each epoch end (collective): the epoch's stats, the Replanner's decision (adopted batch sizes take effect
    at the next epoch start) and the run log -- StartRecord, ReplanRecord, EpochRecord, EndRecord -- written by
    rank 0 only (planner.runlog).

Re-planned worker counts are recorded in the plan but not applied (the framework owns the DataLoader); the
batch sizes are.  The global batch never changes, so every epoch still covers each sample exactly once.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from planner.errors import ValidationError
from planner.plan import Plan
from planner.profile import Profile
from planner.runlog import EndRecord, EpochRecord, RunLogWriter, StartRecord, predicted_step_times
from planner.stats import StepStats
from runtime.collectives import all_gather_json
from runtime.compress import check_compress
from runtime.ddp_settings import ddp_kwargs
from runtime.replan import ReplanDecision, Replanner
from runtime.safety import check_agreement, check_batchnorm, note_weighting
from runtime.sampler import HeteroBatchSampler
from runtime.timing import StepTimer, close_compute_on_last_gradient, peer_data_waits
from runtime.weighting import WeightedHookState, loss_scale, register_weighted_hook

T = TypeVar("T")


def _load_plan(plan: Plan | str | os.PathLike[str]) -> Plan:
    return plan if isinstance(plan, Plan) else Plan.load(plan)


class PlannedRun:
    """A plan applied to one rank's training run: sampler, loss scale, timing, re-planning, run log.

    Args:
        plan: the Plan, or the path of a plan JSON (the same on every rank).
        profile: the Profile the plan was solved from (a path or a Profile); needed by ``replan``.
        replan: re-plan between epochs from measured step times (runtime.Replanner).
        replan_threshold: adopt a new split only when it is predicted this much faster (0.05 = 5%).
        log_file: JSON-lines run log (rank 0 writes it; `planner report --log` reads it).
        seed: shuffle seed, the same on every rank (epoch e shuffles with seed + e, as DistributedSampler).
        shuffle, drop_last: as DistributedSampler's.
        warmup_steps: steps at each epoch start left out of the timing means.
        compress: gradient compression of the weighting hook that ``register_weighting`` registers: "none" (the
            default: the exact fp32 all-reduce), "bf16" or "fp16" (each bucket scaled by n_i / n in fp32, then cast
            and SUM-all-reduced: runtime.compress). It changes numerics, so it is on only when asked; the run log's
            start record names it.

    The plan's DDP settings (``plan.meta["ddp"]``) are checked here: a bad one is refused before any collective.
    """

    def __init__(self, plan: Plan | str | os.PathLike[str], *, profile: Profile | str | os.PathLike[str] | None = None,
                 replan: bool = False, replan_threshold: float = 0.05, log_file: str | os.PathLike[str] | None = None,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False, warmup_steps: int = 2,
                 compress: str = "none") -> None:
        self.plan = _load_plan(plan)
        self.compress = check_compress(compress)
        self._ddp_kwargs = ddp_kwargs(self.plan)  # of the plan DDP is built with; a re-plan changes only batch sizes
        self._weighting: WeightedHookState | None = None
        self.profile = profile if isinstance(profile, Profile) or profile is None else Profile.load(profile)
        if replan and self.profile is None:
            raise ValidationError("replan=True needs the profile the plan came from (profile=...)")
        if self.profile is not None and self.profile.world_size != self.plan.world_size:
            raise ValidationError(f"the plan has {self.plan.world_size} ranks but the profile "
                                  f"{self.profile.world_size}; re-plan on this profile")
        self.replan = replan
        self.replan_threshold = replan_threshold
        self.log_file = log_file
        self.seed, self.shuffle, self.drop_last = int(seed), shuffle, drop_last
        self.warmup_steps = warmup_steps
        self.sampler: HeteroBatchSampler | None = None
        self.timer: StepTimer | None = None
        self.replanner: Replanner | None = None
        self.rank = 0
        self.log = RunLogWriter(None)
        self.decisions: list[ReplanDecision] = []
        """Every re-plan decision so far (the same on every rank)."""
        self.loader_workers: int | None = None
        """This rank's training DataLoader workers, set by the adapter that built the loader (None: not known).
        When every rank's is known, an epoch's step time is its last whole cycles of the job's workers
        (runtime.timing.worker_cycle), as in `planner train`."""
        self._watched: set[int] = set()
        self._finished = False
        self._warned = False
        self._warned_compress = False

    # -- set-up (once the framework knows the rank and the dataset) ---------------------------------------------
    def sampler_for(self, dataset_len: int, device: torch.device | str) -> HeteroBatchSampler:
        """This rank's planned batch sampler (built on the first call; collective under torch.distributed).

        Checks the plan against the launched world size and, across ranks, the plan fingerprint, dataset
        length and seed; opens the run log and writes its start record on rank 0.
        """
        if self.sampler is not None:
            if self.sampler.dataset_len != dataset_len:
                raise ValidationError(f"the training dataset changed length ({self.sampler.dataset_len} -> "
                                      f"{dataset_len}); a planned run keeps one dataset")
            return self.sampler
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if distributed else 1
        self.rank = dist.get_rank() if distributed else 0
        if world != self.plan.world_size:
            raise ValidationError(
                f"the plan is for {self.plan.world_size} rank(s) but {world} were launched; re-plan for this world "
                "size (planner plan, or the adapter's auto mode)")
        if distributed:
            check_agreement(plan_fingerprint=self.plan.fingerprint, dataset_len=dataset_len, seed=self.seed,
                            world_size=world,
                            settings={"compress": self.compress, "plan.meta.ddp": self._ddp_kwargs})
        self.sampler = HeteroBatchSampler.from_plan(self.plan, self.rank, dataset_len, seed=self.seed,
                                                    shuffle=self.shuffle, drop_last=self.drop_last)
        self.sampler._first_pass_checked = True  # check_agreement above compared what it would
        note_weighting("PlannedRun")  # the adapters scale the loss; an own loop registers the weighted hook
        self.timer = StepTimer(device, warmup_steps=self.warmup_steps)
        if self.replan:
            assert self.profile is not None
            self.replanner = Replanner(self.profile, self.plan, threshold=self.replan_threshold)
        self.log = RunLogWriter(self.log_file, enabled=self.rank == 0)
        self.log.write(StartRecord(time=time.time(), world_size=world, global_batch=self.plan.global_batch,
                                   strategy="plan", plan=self.plan, grad_compress=self.compress))
        return self.sampler

    def ddp_kwargs(self) -> dict[str, Any]:
        """The DDP constructor keywords the plan records, checked ({} when none): build the model's wrapper as
        ``DistributedDataParallel(model, device_ids=..., **run.ddp_kwargs())``.

        benchmarks/comm_breakdown.py --choose measures them (``bucket_cap_mb``, ``gradient_as_bucket_view``,
        ``static_graph``) and writes them to ``plan.meta["ddp"]``; none changes the update
        (runtime.ddp_settings).  A fresh dict on every call: add your own keywords to it freely.
        """
        return dict(self._ddp_kwargs)

    def register_weighting(self, ddp_model: torch.nn.parallel.DistributedDataParallel,
                           **kwargs: Any) -> WeightedHookState:
        """Register the exact weighting hook on ``ddp_model`` with the run's compression:
        ``register_weighted_hook(ddp_model, run.sampler, compress=run.compress, **kwargs)`` (after ``sampler_for``).

        ``register_weighted_hook(ddp_model, sampler)`` stays valid for an uncompressed run; with ``compress`` other
        than "none" call this instead, so the hook compresses as the run log says.
        """
        if self.sampler is None:
            raise ValidationError("run.register_weighting: build the sampler with run.sampler_for(len(dataset), "
                                  "device) first")
        if "compress" in kwargs:
            raise ValidationError("run.register_weighting: the compression is the run's (PlannedRun(compress=...))")
        self._weighting = register_weighted_hook(ddp_model, self.sampler, compress=self.compress, **kwargs)
        return self._weighting

    def num_workers(self, default: int) -> int:
        """This rank's planned loader workers (``default`` before the sampler exists)."""
        return self.plan.ranks[self.rank].num_workers if self.sampler is not None else default

    def watch(self, model: torch.nn.Module) -> None:
        """Check the plan against ``model`` and close each step's compute span when backward reaches its first
        parameter (once per model).

        A BatchNorm model needs every rank at >= 2 samples (runtime.safety.check_batchnorm): a plan giving a rank 1
        is refused here, with the fix, instead of failing inside the forward.
        """
        if id(model) in self._watched:
            return
        self._watched.add(id(model))
        min_batch = check_batchnorm(model, self.plan.min_batch)
        low = min(self.plan.batch_sizes)
        if low < min_batch:
            raise ValidationError(
                f"the model has BatchNorm but the plan gives rank {self.plan.batch_sizes.index(low)} a batch of {low}; "
                "re-plan with min_batch=2 (planner plan --min-batch 2) or convert to SyncBatchNorm")
        if self.timer is not None:
            close_compute_on_last_gradient(model, self.timer)

    # -- per step -------------------------------------------------------------------------------------------------
    def loss_scale(self, step: int, accumulation_steps: int = 1) -> float:
        """n_i * W / n for sampler step ``step`` (n: all ranks' samples in its accumulation window).

        Multiply the mean loss by it before DDP's averaging backward; with gradient accumulation over K
        micro-batches the factor already holds the 1/K (runtime.weighting.loss_scale).
        """
        if self.sampler is None:
            raise ValidationError("loss_scale: the planned sampler is not built yet (no training batch was drawn)")
        return loss_scale(self.sampler, step, accumulation_steps=accumulation_steps)

    # -- per epoch (collective) -------------------------------------------------------------------------------------
    def epoch_start(self, epoch: int) -> None:
        """Select the epoch's shuffle (and a re-plan adopted at the last epoch end); reset the timer."""
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)
        if self.timer is not None:
            self.timer.reset()

    def epoch_end(self, epoch: int, *, last: bool = False, loss: float | None = None) -> ReplanDecision | None:
        """Collective: gather the epoch's stats, re-plan (unless ``last``), write the run log.

        Returns the re-plan decision (None without re-planning); an adopted plan's batch sizes apply from the next
        ``epoch_start``.
        """
        if self.sampler is None or self.timer is None:
            return None
        if self.compress != "none" and self._weighting is None and not self._warned_compress:
            self._warned_compress = True
            warnings.warn(f"PlannedRun(compress={self.compress!r}) compresses only through "
                          "run.register_weighting(ddp_model); no hook was registered that way, so the run log's "
                          "grad_compress may not describe this run", stacklevel=2)
        sizes = self.sampler.batch_sizes
        plan = self.plan
        known = all_gather_json(self.loader_workers)
        stats = self.timer.epoch_summary(rank=self.rank, epoch=epoch, batch_size=sizes[self.rank],
                                         num_workers=plan.ranks[self.rank].num_workers,
                                         peer_data_waits_s=peer_data_waits(self.timer),
                                         job_workers=[int(w) for w in known] if None not in known else ())
        all_stats = [StepStats.from_dict(s) for s in all_gather_json(stats.to_dict())]
        decision = None
        if self.replanner is not None and not last:
            decision = self.replanner.step(stats, epoch)
            self.decisions.append(decision)
            self.log.write(decision.to_record())
            if decision.adopted and decision.new_plan is not None:
                self.plan = decision.new_plan
                self.sampler.set_batch_sizes(self.plan.batch_sizes, self.plan.accumulation_steps)
                if self.plan.ranks[self.rank].num_workers != plan.ranks[self.rank].num_workers and not self._warned:
                    self._warned = True  # once per run: the same holds for every later re-plan
                    warnings.warn("the re-plan changed this rank's loader workers; the framework owns the DataLoader, "
                                  "so the new batch sizes apply and the worker count stays", stacklevel=2)
            elif decision.repredicted is not None:  # the same split, its prediction re-made (runtime.replan)
                self.plan = decision.repredicted
        # The synchronous step is as slow as its slowest rank's step-to-step interval.
        step_s = max((s.step_time_s for s in all_stats if s.num_steps > 0), default=math.nan)
        sps = sum(sizes) / step_s if math.isfinite(step_s) and step_s > 0 else None
        self.log.write(EpochRecord(epoch=epoch, plan_fingerprint=plan.fingerprint, samples_per_s=sps,
                                   step_time_s=step_s if math.isfinite(step_s) else None, loss=loss,
                                   batch_sizes=tuple(sizes), ranks=tuple(all_stats),
                                   predicted_step_time_s=predicted_step_times(plan)))
        return decision

    def epoch(self, epoch: int, loader: Iterable[T], *, last: bool = False,
              loss: Callable[[], float | None] | None = None) -> Iterator[T]:
        """Your own loop's epoch: ``for batch in run.epoch(epoch, loader, last=...)`` instead of
        ``sampler.set_epoch(epoch); for batch in loader``.

        Selects the epoch's shuffle (and the split a re-plan adopted at the last epoch end), times each step --
        the wait for the batch, the compute from hand-over to the first parameter's gradient (``watch``), the step
        from one hand-over to the next -- and when the loader is exhausted runs ``epoch_end``: the stats of every
        rank, the Replanner's decision and the run log's records (collective: every rank runs the whole epoch).
        ``last`` marks the final epoch (no re-plan; the run log's end record follows).  ``loss`` is called at the
        epoch end for the epoch's loss to log (e.g. ``lambda: loss.item()``).

        The body of the loop is one training step (forward, backward, optimizer step); a DataLoader over
        ``sampler_for``'s sampler re-reads the batch sizes at every epoch, so an adopted split needs nothing more.
        """
        if self.sampler is None or self.timer is None:
            raise ValidationError("run.epoch: build the loader on run.sampler_for(len(dataset), device) first")
        self.epoch_start(epoch)
        yield from self.timed(loader)
        self.epoch_end(epoch, last=last, loss=loss() if loss is not None else None)
        if last:
            self.finish(epoch + 1)

    def timed(self, batches: Iterable[T]) -> Iterator[T]:
        """Yield ``batches``, timing each step: the wait for the batch, the compute from hand-over (the body of the
        consumer's loop) to the first parameter's gradient (``watch``) or the loop's next turn, and the step."""
        timer = self.timer
        assert timer is not None, "the planned sampler is not built yet (sampler_for)"
        for batch in timer.iter_data(batches):
            timer.compute_start()  # the batch is handed over: the forward starts now
            yield batch
            timer.compute_end()  # ignored when backward reached the watched model's first parameter
            timer.step_end()

    def finish(self, epochs: int) -> None:
        """Write the run log's end record and close it (idempotent)."""
        if self._finished:
            return
        self._finished = True
        self.log.write(EndRecord(time=time.time(), epochs=epochs))
        self.log.close()

    def state(self) -> dict[str, Any]:
        """For logs and tests: the batch sizes in force and the decisions' outcomes."""
        return {"batch_sizes": list(self.sampler.batch_sizes) if self.sampler else list(self.plan.batch_sizes),
                "adopted": [d.epoch for d in self.decisions if d.adopted]}
