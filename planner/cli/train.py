"""The reference trainer behind `planner train`: a plan applied to plain DDP.

Usage (every rank runs the same command)::

    torchrun --nproc-per-node 2 -m planner train --plan plan.json --epochs 2 --log-file run.jsonl
    torchrun --nproc-per-node 2 -m planner train --auto --global-batch 512 --replan

Per epoch: ``sampler.set_epoch`` -> the epoch's batches from a DataLoader over the HeteroBatchSampler (this rank's
planned batch size and workers; one iterator runs on across epochs while the plan holds, planner.cli.steps.StreamedEpochs)
-> DDP, each rank's mean loss scaled by n_i * W / n (exact global mean over uneven batches; or the
weighted comm hook with ``weighting='hook'``) -> StepTimer stats -> optionally the Replanner, whose new plan the
sampler adopts at the next epoch start.  The first collective is the agreement check (world size, plan
fingerprint, dataset length, seed): ranks launched inconsistently fail with one clear error instead of hanging.

The pieces: ``TrainConfig`` (what the user asked, checked on construction; planner/cli/train_config.py), ``Run``
(everything one run holds: model, optimizer, sampler, loader, timer, re-planner, log), ``setup`` builds it,
``run_epoch`` trains one epoch, ``end_epoch`` re-plans, logs and checkpoints, ``train`` loops; what a step needs
around the model (precision, memory format, gradient sync per micro-batch, FSDP2, the loader, the process group
of a measured launch setting) is planner/cli/steps.py, checkpoint and resume (elastic restarts included) is
planner/cli/train_resume.py.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from planner.cli.distenv import DistEnv, sync_device
from planner.cli.divergence import DivergenceWatch, divergence_error
from planner.cli.progress import Progress, no_progress
from planner.cli.steps import (
    DeviceCopy,
    GcPauses,
    StreamedEpochs,
    autocast_for,
    channels_last_for,
    fully_shard_blocks,
    launch_group,
    loader_fill_drain,
    make_loader,
    pinned_pool_stats,
    short_epoch_warning,
    shutdown_loader,
    stream_drain_note,
    sync_only_if,
)
from planner.cli.train_config import EpochResult, TrainConfig
from planner.cli.train_resume import checkpoint, resume
from planner.errors import ValidationError
from planner.paths import open_for_append, write_all, write_error
from planner.plan import Plan
from planner.profile import Profile
from planner.runlog import INTERRUPTED, EndRecord, RunLogWriter
from profiler.devstate import DeviceStateSampler
from profiler.workloads.emulate import Slowdown
from profiler.workloads.specs import Workload, build_workload
from runtime.accumulate import MicroStep, micro_steps
from runtime.collectives import decide_on_rank0
from runtime.compress import stock_compress_hook
from runtime.ddp_settings import ddp_kwargs
from runtime.replan import Replanner
from runtime.run import PlannedRun
from runtime.safety import check_batchnorm
from runtime.sampler import HeteroBatchSampler
from runtime.timing import ComputeStart, StepTimer, close_compute_on_last_gradient
from runtime.weighting import loss_scale, register_weighted_hook, step_weights


@dataclass(slots=True)
class _MicroFlag:
    last: bool = True


@dataclass(kw_only=True, slots=True)
class Run:
    """Everything one training run holds; ``setup`` makes it, the epoch functions advance it."""

    cfg: TrainConfig
    env: DistEnv
    workload: Workload
    planned: PlannedRun
    """The runtime protocol this loop is a client of (runtime.run): sampler, timer, Replanner, run log, the
    epoch-end exchange and its decision -- the same object own loops and the framework adapters run on."""
    model: torch.nn.Module
    """The bare module (checkpoints, emulated extra work)."""
    ddp: torch.nn.Module
    """What the step calls: DDP-wrapped under a process group, else the bare module."""
    optimizer: torch.optim.Optimizer
    scale_loss: bool
    channels_last: bool
    to_device: DeviceCopy
    """Each batch's host-to-device copy, on a side stream (CUDA), with the channels_last conversion."""
    open_compute: Callable[[], None]
    """Opens the step's compute span (runtime.timing.ComputeStart: under DDP, after its buffer broadcast)."""
    loader: Any = None
    trace: IO[str] | None = None
    device_state: DeviceStateSampler | None = None
    """Samples this rank's device and host once per epoch end, never per step (``planned.device_state``)."""
    gc_pauses: GcPauses | None = None
    """Python's garbage collections, timed for the step log (--step-log only)."""
    step_log: int | None = None
    """The step log's descriptor, opened once for the run (planner.paths.open_for_append)."""
    save_error: ValidationError | None = None
    """Rank 0's failed mid-epoch save under several ranks (a full disk), raised by every rank at the epoch end: the
    peers are inside the step's collectives, so rank 0 leaving at once ended them in tracebacks."""
    start_epoch: int = 0
    start_step: int = 0
    start_plan: Plan | None = None
    """The plan this invocation was started with (recorded in checkpoints; a resume compares it)."""
    last_saved: tuple[int, int] | None = None
    """(epoch, step) of the newest checkpoint of this run: the last finite state when the loss diverges."""
    micro: _MicroFlag = field(default_factory=lambda: _MicroFlag())
    """Whether the micro-batch being run is its step's last (the compute-span hook reads it)."""
    progress: Progress = field(default_factory=no_progress)
    """Step lines during an epoch (rank 0, not quiet): steps/s and ETA at least every few seconds."""
    on_step: Callable[[int, int], None] | None = None
    """Called after each optimizer step with (epoch, steps done this epoch): `planner bench`'s timed window."""
    profile: Profile | None = None
    """The profile the plan was solved on (kept in checkpoints: an elastic restart reuses its ranks' curves)."""

    # What the runtime object holds, by the names the trainer's modules (checkpoint, resume, bench) use.
    @property
    def plan(self) -> Plan:
        return self.planned.plan

    @plan.setter
    def plan(self, plan: Plan) -> None:
        self.planned.plan = plan

    @property
    def timer(self) -> StepTimer:
        assert self.planned.timer is not None, "set up by PlannedRun.sampler_for"
        return self.planned.timer

    @property
    def hetero(self) -> HeteroBatchSampler | None:
        """The planned sampler (strategy 'plan'); None under 'equal'."""
        return self.planned.sampler

    @property
    def batch_sampler(self) -> Any:
        return self.planned.batch_sampler

    @property
    def dsampler(self) -> DistributedSampler[int] | None:
        return self.planned.dsampler

    @property
    def replanner(self) -> Replanner | None:
        return self.planned.replanner

    @property
    def log(self) -> RunLogWriter:
        return self.planned.log

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return self.planned.batch_sizes

    def say(self, text: str) -> None:
        if self.env.is_main and not self.cfg.quiet:
            print(text, flush=True)

    def rank_say(self, text: str) -> None:
        """A note or warning about this rank's own set-up (its loader), from every rank, on stderr."""
        print(f"rank {self.env.rank}: {text}", file=sys.stderr, flush=True)


# -- set-up -------------------------------------------------------------------------------------------------
def setup(cfg: TrainConfig, env: DistEnv, plan: Plan, profile: Profile | None, workload: Workload) -> Run:
    """Model, sampler, DDP, weighting, optimizer and re-planner for this rank (collective: the agreement check)."""
    device = env.device
    torch.manual_seed(cfg.seed)  # same initial weights on every rank (DDP also broadcasts them)
    model = workload.model_fn().to(device)
    cl = channels_last_for(workload, device, cfg.mixed_devices)
    if cl:
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    if plan.world_size != env.world_size:
        raise ValidationError(
            f"the plan is for {plan.world_size} rank(s) but {env.world_size} were launched; re-plan for this world "
            "size (planner plan, or planner train --auto)"
        )
    dataset_len = len(workload.dataset)  # type: ignore[arg-type]
    ddp_kw = ddp_kwargs(plan)  # measured DDP settings the plan records (meta is not fingerprinted)
    if ddp_kw and env.distributed and not cfg.fsdp and env.is_main and not cfg.quiet:
        print(f"DDP settings from the plan: {', '.join(f'{k}={v}' for k, v in sorted(ddp_kw.items()))}", flush=True)
    min_batch = check_batchnorm(model, plan.min_batch)
    if min(plan.batch_sizes) < min_batch:
        raise ValidationError(
            f"the model has BatchNorm but the plan gives rank {plan.batch_sizes.index(min(plan.batch_sizes))} a batch "
            f"of {min(plan.batch_sizes)}; re-plan with --min-batch 2 (or convert to SyncBatchNorm)"
        )
    # The runtime object every loop runs on (runtime.run): its agreement check is the run's first collective.
    # Every re-plan solves under the plan's own options (headroom, worker limits...): the Replanner's default.
    planned = PlannedRun(plan, profile=profile, replan=cfg.replan and profile is not None,
                         replan_threshold=cfg.replan_threshold, replan_smoothing=cfg.replan_smoothing, seed=cfg.seed,
                         compress=cfg.grad_compress, quiet=cfg.quiet, strategy=cfg.strategy,
                         # planner train refused a plan or profile made for another workload itself (check_workload,
                         # unless --allow-workload-mismatch): here the devices and hosts are compared, and warned.
                         allow_workload_mismatch=True)
    planned.follows_workers = True  # rank_loader rebuilds the loader with the plan's workers
    planned.sampler_for(dataset_len, device, min_batch=min_batch, settings=cfg.agreed_settings(), open_log=False)
    hetero = planned.sampler
    timer = planned.timer
    assert timer is not None
    if workload.weight_fn is not None and hetero is not None:  # token-mean loss of variable-length text
        if cfg.weighting == "hook" or cfg.grad_compress != "none" or max(hetero.accumulation_steps) > 1:
            raise ValidationError("variable-length text is weighted by tokens through the loss scale, one optimizer "
                                  "step per batch: use --weighting loss-scale and a plan without accumulation")
    ddp: torch.nn.Module = model
    scale_loss = False
    micro = _MicroFlag()
    if cfg.fsdp:
        ddp = fully_shard_blocks(model, env)
        scale_loss = hetero is not None  # n_ij * W / n: exact under FSDP2's division by W (runtime/accumulate.py)
    elif env.distributed:
        group = launch_group(plan, env)
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, process_group=group, **ddp_kw)
        if hetero is not None and (cfg.weighting == "hook" or cfg.grad_compress != "none"):
            # compression runs in the weighting hook: scale by n_i / n first, then cast (runtime/compress.py)
            register_weighted_hook(ddp, hetero, on_last_bucket=timer.compute_end,  # type: ignore[arg-type]
                                   process_group=group, compress=cfg.grad_compress)
        elif hetero is None and cfg.grad_compress != "none":  # the stock twin: torch's own hook, cast then average
            ddp.register_comm_hook(group, stock_compress_hook(cfg.grad_compress))  # type: ignore[arg-type]
        elif hetero is not None:
            scale_loss = True
            close_compute_on_last_gradient(model, timer, when=lambda: micro.last)
    return Run(cfg=cfg, env=env, workload=workload, planned=planned, model=model, ddp=ddp,
               optimizer=torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9), scale_loss=scale_loss,
               channels_last=cl, to_device=DeviceCopy(device, cl, workload.normalize),
               start_plan=plan, micro=micro, open_compute=ComputeStart(ddp, timer), profile=profile)


def rank_loader(run: Run) -> Any:
    """This rank's batches under the plan in effect: ``StreamedEpochs`` (one DataLoader across epochs) for the
    planned sampler with a DataLoader, unless ``restart_loader_each_epoch``; else the loader itself."""
    cfg, env = run.cfg, run.env

    def build(batch_sampler: Any) -> Any:
        mine = run.plan.ranks[env.rank]
        return make_loader(cfg, run.workload, batch_sampler, mine.num_workers, env.device,
                           on_batch=run.timer.loader_batch, batch_size=mine.batch_size, say=run.rank_say)

    if run.hetero is None or cfg.data_on_device or cfg.restart_loader_each_epoch:
        return build(run.batch_sampler)
    return StreamedEpochs(build, last_epoch=cfg.epochs, max_steps=cfg.max_steps_per_epoch)


# -- one epoch ----------------------------------------------------------------------------------------------
def _loader_steps(run: Run) -> int:
    """Optimizer steps in a whole epoch of this rank's loader (before ``max_steps_per_epoch``)."""
    return run.hetero.num_steps if run.hetero is not None else len(run.loader)


def total_steps(run: Run) -> int:
    """Optimizer steps an epoch runs from its start: the loader's, cut at ``max_steps_per_epoch``."""
    steps = _loader_steps(run)
    return steps if run.cfg.max_steps_per_epoch is None else min(steps, run.cfg.max_steps_per_epoch)


def run_epoch(run: Run, epoch: int, first_step: int, slowdown: Slowdown, tracer: Iterator[Any] | None) -> EpochResult:
    """Train one epoch from global step ``first_step``; collective (every rank's stats are gathered at the end)."""
    cfg, env, device = run.cfg, run.env, run.env.device
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    watch = DivergenceWatch(device)  # planner/cli/divergence.py: no per-step synchronization
    n_sum = 0
    step = first_step
    batch_sizes = run.batch_sizes
    total = _loader_steps(run) - first_step
    if cfg.max_steps_per_epoch is not None:
        total = min(total, cfg.max_steps_per_epoch)
    run.progress(f"epoch {epoch}: {total} steps of {sum(batch_sizes)} samples")
    t_start = time.perf_counter()
    # micro_steps starts the loader itself (the sampler's pass, hence its start position, begins there); the timer
    # times each next() around it.
    streamed = isinstance(run.loader, StreamedEpochs)
    source, fresh = run.loader.epoch(run.hetero) if streamed else (run.loader, True)
    batches: Iterator[tuple[Any, MicroStep | None]] = (
        run.timer.iter_data(micro_steps(source, run.hetero)) if run.hetero is not None
        else ((b, None) for b in run.timer.iter_data(source)))
    for (x, y), micro in batches:
        first_micro = micro is None or micro.index == 0
        last = micro is None or micro.is_last
        if first_micro and cfg.max_steps_per_epoch is not None and step - first_step >= cfg.max_steps_per_epoch:
            break
        x, y = run.to_device(x, y)  # on a side stream: overlaps the previous step's compute (planner.cli.steps.DeviceCopy)
        if run.trace is not None:
            idx = next(tracer) if tracer is not None else []
            rec: dict[str, Any] = {"epoch": epoch, "step": step, "rank": env.rank, "world_size": env.world_size,
                                   "indices": idx}
            if micro is not None and micro.count > 1:
                rec["micro"] = micro.index
            run.trace.write(json.dumps(rec) + "\n")
            run.trace.flush()  # a kill -9 must not lose lines of steps the checkpoint already covers
        # Variable-length text: the step's token count all-reduced before the compute span opens (the ranks are
        # aligned by the last step's gradient all-reduce, so nobody waits here for a slow peer's forward).
        token_scale = (step_weights(run.workload.weight_fn(y)).loss_scale()
                       if run.scale_loss and run.workload.weight_fn is not None else None)
        if first_micro:
            run.open_compute()
        run.micro.last = last
        with sync_only_if(run.ddp, last):
            with autocast_for(cfg, device):
                loss = run.workload.loss_fn(run.ddp(x), y)
                # Emulated extra work goes between the real forward and backward: inside the measured compute span,
                # and after DDP's forward-start buffer broadcast, which would otherwise make the peers wait for it.
                slowdown.apply(run.ddp, run.workload.loss_fn, x, y)
            if token_scale is not None:
                (loss * token_scale).backward()
            elif run.scale_loss:  # exact sample-weighted gradient through DDP's (or FSDP2's) averaging
                scale = micro.loss_scale if micro is not None else loss_scale(run.hetero, step)  # type: ignore[arg-type]
                (loss * scale).backward()
            elif micro is not None and micro.count > 1:  # the hook weights the step; the loss, its micro-batches
                (loss * micro.accumulation_weight).backward()
            else:
                loss.backward()
        loss_sum += loss.detach().double() * x.shape[0]
        watch.observe(loss, step)
        n_sum += int(x.shape[0])
        if not last:
            continue
        run.timer.compute_end()  # ignored when the hook already closed the span (DDP with several ranks)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.timer.step_end()
        step += 1
        done = step - first_step
        if run.on_step is not None:
            run.on_step(epoch, done)
        rate = done / max(time.perf_counter() - t_start, 1e-9)
        run.progress.update(f"epoch {epoch}: step {done}/{total}, {rate:.2f} steps/s, "
                            f"ETA {_eta((total - done) / rate)}")
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            # Never save a diverged state over the last finite one. Only rank 0 saves, so only its view counts:
            # a peer's NaN reaches rank 0's weights through the gradient all-reduce.
            if run.env.is_main and run.save_error is None and watch.clean(run.model):
                try:
                    checkpoint(run, epoch, step)
                except ValidationError as e:
                    if not run.env.distributed:
                        raise
                    run.save_error = e
    sync_device(device)
    wall_s = time.perf_counter() - t_start
    job_workers = [] if cfg.data_on_device else [r.num_workers for r in run.plan.ranks]
    fill, drain = loader_fill_drain(max(job_workers)) if job_workers else (0, 0)  # the busiest loader's
    if streamed:  # it fills when its stream starts, and drains in the stream's last steps, whichever epochs hold them
        after = (cfg.epochs - epoch - 1) * total_steps(run)
        fill, drain = fill if fresh else 0, max(0, drain - after)
    if cfg.step_log_path and run.step_log is not None:
        _write_step_log(run.step_log, cfg.step_log_path, epoch, env.rank, t_start, run.timer.series(),
                        pinned_pool_stats(device),
                        run.gc_pauses.take(t_start) if run.gc_pauses is not None else None)
    first_bad = watch.at_epoch_end(run.model, first_step, step)
    loss_value = float(loss_sum.item())
    # The runtime object's epoch-end exchange (runtime.run.PlannedRun.gather): every rank's stats over the loaders'
    # steady middle, loss, samples, wall time and device state, with what only the trainer exchanges beside them.
    end = run.planned.gather(epoch, loss_sum=loss_value, samples=n_sum, wall_s=wall_s, job_workers=job_workers,
                             fill_steps=fill, drain_steps=drain, streamed=streamed, fresh=fresh,
                             extra=[first_bad, run.last_saved])
    saved = end.extras[0][1]  # rank 0 saves: its record is the one every rank names if the loss diverged
    run.last_saved = None if saved is None else (int(saved[0]), int(saved[1]))
    bad = [x[0] for x in end.extras if x[0] >= 0]
    return EpochResult(epoch=epoch, samples_per_s=end.samples_per_s or 0.0, step_time_s=end.step_time_s or 0.0,
                       loss=end.loss if end.loss is not None else float("nan"), batch_sizes=end.batch_sizes,
                       stats=[st.to_dict() for st in end.stats],
                       device_states=[None if d is None else d.to_dict() for d in end.device_states],
                       predicted_step_time_s=run.plan.predicted.step_time_s, wall_s=end.wall_s,
                       samples=end.samples or 0, diverged_step=min(bad) if bad else None, unsteady=end.unsteady,
                       end=end)


def _write_step_log(fd: int, path: str, epoch: int, rank: int, t_start: float,
                    series: dict[str, list[float | None]], pinned: dict[str, float] | None = None,
                    gc_pauses: dict[str, Any] | None = None) -> None:
    """One JSON line: this rank's steps of the epoch in milliseconds (``--step-log``); ``start_unix`` is when the
    epoch's loop began, to line the steps up with other logs; ``pinned``: the pinned-host pool's counters at the
    epoch's end (planner.cli.steps.pinned_pool_stats), cumulative since the process started; ``gc``: the garbage
    collections since the last epoch's line (planner.cli.steps.GcPauses: count per generation, and each pause of 5 ms or
    more as [ms after the loop began, ms long, generation])."""
    start_unix = time.time() - (time.perf_counter() - t_start)
    rec = {"epoch": epoch, "rank": rank, "start_unix": round(start_unix, 3),
           **{k[:-2] + "_ms": [None if v is None else round(1e3 * v, 3) for v in vals]
              for k, vals in series.items()}}
    if pinned is not None:
        rec["pinned"] = pinned
    if gc_pauses is not None:
        rec["gc"] = gc_pauses
    try:
        write_all(fd, (json.dumps(rec) + "\n").encode("utf-8"))  # one write: lines of ranks sharing a file stay whole
    except OSError as e:
        raise write_error(path, e) from None


def end_epoch(run: Run, res: EpochResult, epoch_plan: Plan) -> None:
    """Re-plan and log the epoch (the runtime object's ``conclude``: collective), checkpoint it, say it; the next
    epoch runs ``run.plan``."""
    cfg, env = run.cfg, run.env
    assert res.end is not None
    # The epoch's log records are written once its checkpoint is saved: a log write that fails (a full disk)
    # then never loses the trained epoch, and a log never records an epoch no checkpoint holds.
    with run.log.deferred():
        end = run.planned.conclude(res.end, last=res.epoch + 1 >= cfg.epochs, announce=False)
        decision = end.decision
        if decision is not None:
            res.replan = decision.to_record().to_dict()
            if decision.adopted and decision.new_plan is not None:
                if isinstance(run.loader, StreamedEpochs):
                    run.loader.restart()  # the running stream has the old sizes: the next epoch starts a new one
                elif run.plan.ranks[env.rank].num_workers != epoch_plan.ranks[env.rank].num_workers:
                    run.loader = rank_loader(run)
        elif end.note is not None:
            res.replan = {"reason": end.note}
        # Rank 0 saves while the others wait for its word: its error (a full disk) is every rank's one line, exit 2,
        # instead of a peer's traceback from a collective it was left alone in.
        decide_on_rank0(lambda: _save_epoch_end(run, res.epoch + 1))
    fill = max(res.stats, key=lambda s: s.get("fill_excess_s", 0.0))
    wall = (f"  wall {res.wall_s:.1f} s = {res.samples / res.wall_s:.1f} samples/s"
            if res.wall_s and res.samples and not cfg.data_on_device else "")
    run.say(f"epoch {res.epoch}: {res.samples_per_s:9.1f} samples/s  step {1000 * res.step_time_s:7.2f} ms  "
            f"loss {res.loss:.4f}  batches {list(res.batch_sizes)}{wall}"
            + (f"  (steady pace between the loaders' fill and drain; the {fill['fill_steps']}-step fill took "
               f"{fill['fill_excess_s']:.1f} s more)" if fill.get("fill_steps") else ""))
    run.planned.announce_decision(end)  # the same one line as every loop on the runtime object


def _save_epoch_end(run: Run, next_epoch: int) -> None:
    if run.save_error is not None:
        raise run.save_error
    checkpoint(run, next_epoch, 0)


def stop_diverged(run: Run, res: EpochResult, epoch_plan: Plan, epochs_done: int) -> ValidationError:
    """Log the diverged epoch (loss null) and an end record that says why; the error every rank raises
    (planner/cli/divergence.py). The epoch-end checkpoint is not made: the folder keeps the last finite state."""
    reason = f"loss diverged at epoch {res.epoch} step {res.diverged_step}"
    assert res.end is not None
    run.planned.conclude(res.end, last=True, announce=False)  # the epoch record only: no re-plan on a diverged run
    run.log.write(EndRecord(time=time.time(), epochs=epochs_done, reason=reason))
    return divergence_error(reason, lr=run.cfg.lr, checkpoint_dir=run.cfg.checkpoint_dir, last_saved=run.last_saved)
def _eta(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


# -- the loop -----------------------------------------------------------------------------------------------
def wire_format_warning(profile: Profile | None, grad_compress: str) -> str | None:
    """A warning when the run sends its gradients in another format than the profile's DDP steps did
    (``CommProfile.grad_compress``): the plan's printed step holds the profile's communication, not this run's."""
    comm = profile.comm if profile is not None and profile.world_size > 1 else None
    if comm is None or comm.exposed_s is None:
        return None
    measured = comm.grad_compress or "none"
    if measured == grad_compress:
        return None
    return (f"warning: the profile's DDP steps sent gradients as {measured}, this run sends {grad_compress}: the "
            f"plan's printed step does not include that change; for a prediction that does, profile with "
            f"`planner profile --grad-compress {grad_compress}` (or train --auto --grad-compress {grad_compress})")


def train(cfg: TrainConfig, env: DistEnv, plan: Plan, profile: Profile | None,
          workload: Workload | None = None, on_epoch: Callable[[EpochResult], None] | None = None,
          progress: Progress | None = None, on_start: Callable[[Run], None] | None = None,
          on_step: Callable[[int, int], None] | None = None) -> list[EpochResult]:
    """Train `cfg.epochs` epochs on this rank with `plan`; collective (every rank calls it).

    ``progress``: where step lines go (default: stderr on rank 0 unless ``cfg.quiet``); `planner bench` passes
    its own, which prefixes the strategy.  ``on_start(run)``: called on every rank once the run is set up (model,
    sampler, DDP, loader), before the first epoch; ``on_step(epoch, steps_done)`` after each optimizer step.
    `planner bench` records what each strategy runs with the first and opens/closes its timed window with the
    second (planner/cli/bench_window.py).
    """
    workload = workload or build_workload(cfg.model, cfg.dataset, image_size=cfg.image_size,
                                          num_samples=cfg.num_samples, gpu_normalize=cfg.gpu_normalize)
    if progress is None:
        with Progress("train", enabled=env.is_main and not cfg.quiet) as own:
            return train(cfg, env, plan, profile, workload, on_epoch, own, on_start, on_step)
    run = setup(cfg, env, plan, profile, workload)
    run.progress = progress
    run.on_step = on_step
    resize = resume(run)
    # Opened only once the checkpoint has loaded: a refused resume leaves no new log file behind.
    run.planned.open_log(cfg.log_path, write_start=run.start_epoch == 0 and run.start_step == 0)
    if resize is not None:
        run.log.write(resize)
        run.say(f"world size {resize.old_world_size} -> {resize.new_world_size}: continuing epoch {run.start_epoch} "
                f"at global step {run.start_step} with batches {list(run.plan.batch_sizes)}")
    run.trace = open(cfg.trace_path, "a", encoding="utf-8") if cfg.trace_path else None
    early, late = Slowdown(cfg.slowdown), Slowdown(cfg.slowdown_late or cfg.slowdown)
    run.loader = rank_loader(run)
    run.device_state = run.planned.device_state = DeviceStateSampler(env.device)
    run.gc_pauses = GcPauses() if cfg.step_log_path else None
    if cfg.step_log_path:
        run.step_log = open_for_append(cfg.step_log_path, "--step-log")  # written through this descriptor only
    if env.is_main and not cfg.data_on_device:
        steps, workers = total_steps(run), [r.num_workers for r in run.plan.ranks]
        streamed = isinstance(run.loader, StreamedEpochs)
        for line in (short_epoch_warning(steps, workers, streamed=streamed),
                     stream_drain_note(steps, cfg.epochs - run.start_epoch, workers) if streamed else None,
                     wire_format_warning(profile, cfg.grad_compress)):
            if line is not None:
                print(line, file=sys.stderr, flush=True)
    if on_start is not None:
        on_start(run)
    results: list[EpochResult] = []
    done = run.start_epoch  # epochs completed, for an end record written on the way out
    try:
        for epoch in range(run.start_epoch, cfg.epochs):
            run.planned.epoch_start(epoch)  # the epoch's shuffle and split, the timer reset
            tracer = None
            if run.trace is not None and run.hetero is not None:
                tracer = iter(copy.deepcopy(run.hetero))  # same layout, not run ahead by the DataLoader's prefetch
            epoch_plan = run.plan
            res = run_epoch(run, epoch, run.start_step if epoch == run.start_epoch else 0,
                            late if epoch >= cfg.slowdown_from_epoch else early, tracer)
            if res.diverged_step is not None:  # every rank saw the same gathered steps: all stop here together
                error = stop_diverged(run, res, epoch_plan, epochs_done=epoch)
                done = -1  # its end record is written
                raise error
            end_epoch(run, res, epoch_plan)
            done = epoch + 1
            results.append(res)
            if on_epoch is not None:
                on_epoch(res)
        run.log.write(EndRecord(time=time.time(), epochs=cfg.epochs))
    except BaseException as e:
        # Any other way out (a peer died, Ctrl-C, a full disk) still ends the log with why: the report and
        # `planner validate` then tell a stopped run from one still going.
        if done >= 0:
            _end_on_error(run, done, e)
        raise
    finally:
        shutdown_loader(run.loader)
        run.log.close()
        run.device_state.close()
        if run.gc_pauses is not None:
            run.gc_pauses.close()
        if run.trace is not None:
            run.trace.close()
        if run.step_log is not None:
            os.close(run.step_log)
    return results


def _end_on_error(run: Run, epochs_done: int, error: BaseException) -> None:
    text = (str(error).strip().splitlines() or [""])[0][:200]
    reason = INTERRUPTED if isinstance(error, KeyboardInterrupt) else f"stopped: {type(error).__name__}: {text}"
    try:
        run.log.write(EndRecord(time=time.time(), epochs=epochs_done, reason=reason))
    except (OSError, ValueError):  # the log itself may be what failed (a full disk, a closed file)
        pass
