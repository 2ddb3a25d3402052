"""The reference trainer behind `planner train`: a plan applied to plain DDP.

Usage (every rank runs the same command)::

    torchrun --nproc-per-node 2 -m planner train --plan plan.json --epochs 2 --log-file run.jsonl
    torchrun --nproc-per-node 2 -m planner train --auto --global-batch 512 --replan

Per epoch: ``sampler.set_epoch`` -> a DataLoader over the HeteroBatchSampler (this rank's planned batch size and
workers) -> DDP, each rank's mean loss scaled by n_i * W / n (exact global mean over uneven batches; or the
weighted comm hook with ``weighting='hook'``) -> StepTimer stats ->
optionally the Replanner, whose new plan the sampler adopts at the next epoch start.  The first collective is
the agreement check (world size, plan fingerprint, dataset length, seed): ranks launched inconsistently fail
with one clear error instead of hanging.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

import planner
from apps.checkpoint import load_checkpoint, save_checkpoint
from apps.distenv import DistEnv, all_gather_object, broadcast_object, sync_device
from planner.errors import ValidationError
from planner.plan import Plan
from planner.profile import Profile
from profiler.compute import use_channels_last
from runtime.replan import Replanner
from runtime.safety import check_agreement, check_batchnorm
from runtime.sampler import HeteroBatchSampler
from runtime.timing import StepTimer
from runtime.weighting import loss_scale, register_weighted_hook
from workloads.emulate import Slowdown
from workloads.specs import Workload, build_workload


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    model: str = "mlp"
    dataset: str = "fake"
    image_size: int | None = None
    num_samples: int | None = None
    """Length of the fake dataset (default: the spec's)."""
    epochs: int = 2
    max_steps_per_epoch: int | None = None
    """Stop each epoch after this many steps (benchmarks; breaks exactly-once coverage on purpose)."""
    lr: float = 0.01
    amp: bool = False
    seed: int = 0
    replan: bool = False
    replan_threshold: float = 0.05
    replan_smoothing: float = 0.8
    strategy: str = "plan"
    """'plan' (HeteroBatchSampler + exact weighting) or 'equal' (torch DistributedSampler + plain DDP)."""
    weighting: str = "loss_scale"
    """How 'plan' weights uneven batches exactly: 'loss_scale' (the mean loss times n_i * W / n through DDP's own
    C++ all-reduce; also exact with SyncBatchNorm) or 'hook' (``register_weighted_hook``, a Python comm hook).
    Same parameters to 1e-10 (tests/runtime/test_train_weighting.py); cost in docs/BENCHMARKS.md section 9."""
    data_on_device: bool = False
    """Skip the DataLoader: synthetic inputs made on the device (isolates compute skew; the loader is not run)."""
    slowdown: float = 1.0
    """Emulated compute factor of this rank (workloads.emulate.Slowdown), applied from the first epoch."""
    slowdown_late: float | None = None
    """If set, the factor used from epoch `slowdown_from_epoch` on (a mid-run slowdown)."""
    slowdown_from_epoch: int = 0
    loader_workers_cap: int | None = None
    log_path: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    """Also checkpoint every N steps inside an epoch (0: only at epoch ends)."""
    resume: bool = False
    quiet: bool = False
    mixed_devices: bool = False
    """Some ranks are CPU and some CUDA (gloo): keep one memory format everywhere (no channels_last)."""
    trace_path: str | None = None
    """Write every (epoch, step, rank, indices) to this file (tests of resume; one file per rank)."""


@dataclass(kw_only=True, slots=True)
class EpochResult:
    epoch: int
    samples_per_s: float
    step_time_s: float
    loss: float
    batch_sizes: tuple[int, ...]
    stats: list[dict[str, Any]] = field(default_factory=list)
    predicted_step_time_s: float = 0.0
    replan: dict[str, Any] | None = None


class RunLog:
    """JSON-lines run log written by rank 0 (the report reads it); a no-op elsewhere."""

    def __init__(self, path: str | None, enabled: bool) -> None:
        self._f = open(path, "a", encoding="utf-8") if path and enabled else None

    def write(self, record: dict[str, Any]) -> None:
        if self._f is not None:
            self._f.write(json.dumps(record, allow_nan=False, default=str) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


def _autocast(cfg: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if not cfg.amp:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def channels_last_for(workload: Workload, device: torch.device, mixed: bool = False) -> bool:
    """The profiler's choice (channels_last for image models on CUDA) -- unless CPU ranks train beside CUDA
    ones: DDP requires every rank's parameters to have the same strides."""
    return use_channels_last(workload, device, False if mixed else None)


class _DeviceBatches:
    """Synthetic batches on the device, indexed like the sampler's batches (the loader is not run)."""

    def __init__(self, batch_sampler: Any, workload: Workload, device: torch.device, channels_last: bool) -> None:
        self.batch_sampler = batch_sampler
        self.workload, self.device, self.cl = workload, device, channels_last
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        from workloads.specs import synthetic_batch

        for idx in self.batch_sampler:
            n = len(idx)
            if n not in self._cache:
                x, y = synthetic_batch(self.workload, n, self.device)
                if self.cl:
                    x = x.contiguous(memory_format=torch.channels_last)
                self._cache[n] = (x, y)
            yield self._cache[n]


def make_loader(cfg: TrainConfig, workload: Workload, batch_sampler: Any, num_workers: int,
                device: torch.device) -> Any:
    if cfg.data_on_device:
        return _DeviceBatches(batch_sampler, workload, device, channels_last_for(workload, device, cfg.mixed_devices))
    if cfg.loader_workers_cap is not None:
        num_workers = min(num_workers, cfg.loader_workers_cap)
    return DataLoader(
        workload.dataset,
        batch_sampler=batch_sampler,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
        persistent_workers=num_workers > 0,
        prefetch_factor=4 if num_workers > 0 else None,
    )


def train(cfg: TrainConfig, env: DistEnv, plan: Plan, profile: Profile | None,
          workload: Workload | None = None, on_epoch: Callable[[EpochResult], None] | None = None) -> list[EpochResult]:
    """Train `cfg.epochs` epochs on this rank with `plan`; collective (every rank calls it)."""
    workload = workload or build_workload(cfg.model, cfg.dataset, image_size=cfg.image_size,
                                          num_samples=cfg.num_samples)
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
    if env.distributed:
        check_agreement(plan_fingerprint=plan.fingerprint, dataset_len=dataset_len, seed=cfg.seed,
                        world_size=env.world_size)
    min_batch = check_batchnorm(model, plan.min_batch)
    if min(plan.batch_sizes) < min_batch:
        raise ValidationError(
            f"the model has BatchNorm but the plan gives rank {plan.batch_sizes.index(min(plan.batch_sizes))} a batch "
            f"of {min(plan.batch_sizes)}; re-plan with --min-batch 2 (or convert to SyncBatchNorm)"
        )
    if cfg.strategy == "equal":
        if len(set(plan.batch_sizes)) != 1:
            raise ValidationError(f"strategy 'equal' needs an equal split, got {list(plan.batch_sizes)}")
        indices: Any = range(dataset_len)  # DistributedSampler only needs len()
        dsampler: DistributedSampler[int] = DistributedSampler(indices, num_replicas=env.world_size, rank=env.rank,
                                                               shuffle=True, seed=cfg.seed, drop_last=False)
        batch_sampler: Any = BatchSampler(dsampler, plan.batch_sizes[env.rank], drop_last=False)
        hetero: HeteroBatchSampler | None = None
    else:
        hetero = HeteroBatchSampler.from_plan(plan, env.rank, dataset_len, seed=cfg.seed, min_batch=min_batch)
        batch_sampler = hetero
    ddp: torch.nn.Module = model
    timer = StepTimer(device)
    if cfg.weighting not in ("loss_scale", "hook"):
        raise ValidationError(f"weighting must be 'loss_scale' or 'hook', got {cfg.weighting!r}")
    scale_loss = False
    if env.distributed:
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        if hetero is not None and cfg.weighting == "hook":
            register_weighted_hook(ddp, hetero, on_last_bucket=timer.compute_end)  # type: ignore[arg-type]
        elif hetero is not None:
            scale_loss = True
            close_compute_on_last_gradient(model, timer)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    replanner = None
    if cfg.replan and hetero is not None and profile is not None:
        # The plan's own solve options (headroom, worker limits...) apply to every re-plan too.
        opts = {k: v for k, v in dict(plan.solver.get("options") or {}).items() if k != "min_batch"}
        replanner = Replanner(profile, plan, threshold=cfg.replan_threshold, smoothing=cfg.replan_smoothing,
                              solve_kwargs=opts or None)
    start_epoch, start_step = 0, 0
    resize_event: dict[str, Any] | None = None
    if cfg.resume and cfg.checkpoint_dir:
        state = load_checkpoint(cfg.checkpoint_dir, device)
        if state is not None:
            saved = Plan.from_dict(state["plan"])
            resized = saved.world_size != plan.world_size
            if resized:
                plan = _elastic_plan(saved, plan, hetero, state)
                resize_event = {"event": "resize", "epoch": int(state["epoch"]), "step": int(state["step"]),
                                "old_world_size": saved.world_size, "new_world_size": plan.world_size,
                                "old_batch_sizes": list(saved.batch_sizes), "new_batch_sizes": list(plan.batch_sizes)}
            else:
                plan = saved
                if hetero is not None:
                    hetero.load_state_dict(state["sampler"])
                if replanner is not None and state.get("replanner"):
                    replanner.load_state_dict(state["replanner"])
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start_epoch, start_step = int(state["epoch"]), int(state["step"])
            if env.is_main and not cfg.quiet:
                print(f"resumed from {cfg.checkpoint_dir} at epoch {start_epoch} step {start_step}", flush=True)
    # Opened only once the checkpoint has loaded: a refused resume leaves no new log file behind.
    log = RunLog(cfg.log_path, env.is_main)
    if start_step == 0 and start_epoch == 0:
        log.write({"event": "start", "time": time.time(), "world_size": env.world_size,
                   "global_batch": plan.global_batch, "strategy": cfg.strategy, "plan": plan.to_dict()})
    if resize_event is not None:
        log.write({**resize_event, "time": time.time(), "plan": plan.to_dict()})
        if env.is_main and not cfg.quiet:
            print(f"world size {resize_event['old_world_size']} -> {resize_event['new_world_size']}: continuing "
                  f"epoch {start_epoch} at global step {start_step} with batches {list(plan.batch_sizes)}", flush=True)
    trace = open(cfg.trace_path, "a", encoding="utf-8") if cfg.trace_path else None
    early, late = Slowdown(cfg.slowdown), Slowdown(cfg.slowdown_late or cfg.slowdown)
    results: list[EpochResult] = []
    num_workers = plan.ranks[env.rank].num_workers
    loader = make_loader(cfg, workload, batch_sampler, num_workers, device)
    try:
        for epoch in range(start_epoch, cfg.epochs):
            if hetero is not None:
                hetero.set_epoch(epoch)
            else:
                dsampler.set_epoch(epoch)
            active_slowdown = late if epoch >= cfg.slowdown_from_epoch else early
            first = start_step if epoch == start_epoch else 0
            tracer = None
            if trace is not None and hetero is not None:
                tracer = iter(copy.deepcopy(hetero))  # same layout, not run ahead by the DataLoader's prefetch
            epoch_plan = plan
            res = _run_epoch(cfg, env, epoch, first, plan, ddp, model, optimizer, loader, hetero, timer,
                             workload, active_slowdown, (trace, tracer), replanner, scale_loss)
            if replanner is not None and epoch + 1 < cfg.epochs:
                decision = replanner.step(planner.StepStats.from_dict(res.stats[env.rank]), epoch)
                res.replan = decision.to_log()
                log.write(decision.to_log())
                if decision.adopted and decision.new_plan is not None:
                    old_workers = plan.ranks[env.rank].num_workers
                    plan = decision.new_plan
                    assert hetero is not None
                    hetero.set_batch_sizes(plan.batch_sizes)
                    if plan.ranks[env.rank].num_workers != old_workers:
                        loader = make_loader(cfg, workload, batch_sampler, plan.ranks[env.rank].num_workers, device)
            log.write({"event": "epoch", "epoch": epoch, "plan_fingerprint": epoch_plan.fingerprint,
                       "samples_per_s": res.samples_per_s, "step_time_s": res.step_time_s, "loss": res.loss,
                       "batch_sizes": list(res.batch_sizes), "ranks": res.stats,
                       "predicted_step_time_s": [r.predicted_step_time_s for r in epoch_plan.ranks]})
            if cfg.checkpoint_dir and env.is_main:
                save_checkpoint(cfg.checkpoint_dir, epoch=epoch + 1, step=0, model=model, optimizer=optimizer,
                                plan=plan, sampler_state=hetero.state_dict(hetero.num_steps) if hetero else None,
                                replanner=replanner)
            if env.distributed:
                dist.barrier()
            if env.is_main and not cfg.quiet:
                print(f"epoch {epoch}: {res.samples_per_s:9.1f} samples/s  step {1000 * res.step_time_s:7.2f} ms  "
                      f"loss {res.loss:.4f}  batches {list(res.batch_sizes)}"
                      + (f"  re-plan: {res.replan['reason']}" if res.replan else ""), flush=True)
            results.append(res)
            if on_epoch is not None:
                on_epoch(res)
        log.write({"event": "end", "time": time.time(), "epochs": cfg.epochs})
    finally:
        log.close()
        if trace is not None:
            trace.close()
    return results


def _elastic_plan(saved: Plan, plan: Plan, hetero: HeteroBatchSampler | None, state: dict[str, Any]) -> Plan:
    """Resume a checkpoint taken with another world size: keep the global batch, use this run's split.

    Coverage of the interrupted epoch stays exactly-once: global step s always covers P[s*B:(s+1)*B] of the
    epoch's permutation whatever the split, so continuing at the saved global step with the new ranks processes
    exactly the samples the old ranks had left (split differently).  The re-planner starts afresh (its
    corrections were per old rank).
    """
    if saved.global_batch != plan.global_batch:
        raise ValidationError(
            f"the checkpoint was trained with global batch {saved.global_batch} on {saved.world_size} rank(s); this "
            f"run's plan has global batch {plan.global_batch} for {plan.world_size}: an elastic restart keeps the "
            f"global batch -- re-plan with --global-batch {saved.global_batch}"
        )
    if hetero is None:
        raise ValidationError("an elastic restart needs the planned sampler (strategy 'plan')")
    sampler_state = dict(state["sampler"])
    sampler_state.update(world_size=plan.world_size, batch_sizes=list(plan.batch_sizes), pending_batch_sizes=None,
                         min_batch=hetero.min_batch)
    hetero.load_state_dict(sampler_state)
    return plan


def close_compute_on_last_gradient(model: torch.nn.Module, timer: StepTimer) -> None:
    """Close the timer's compute span when backward accumulates the model's first parameter's gradient.

    The first parameter (the input layer's weight) gets its gradient last in backward, so this marks "local
    compute done" -- before DDP's final all-reduce wait, like the comm hook's ``on_last_bucket`` -- with one
    Python call per step and no comm hook. A step where it does not fire (an unused first parameter) falls back to
    the after-``backward()`` call, which includes the wait for peers.
    """
    first = next((p for p in model.parameters() if p.requires_grad), None)
    if first is not None:
        first.register_post_accumulate_grad_hook(lambda _p: timer.compute_end())


def _run_epoch(cfg: TrainConfig, env: DistEnv, epoch: int, first_step: int, plan: Plan, ddp: torch.nn.Module,
               model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: Any,
               hetero: HeteroBatchSampler | None, timer: StepTimer, workload: Workload, slowdown: Slowdown,
               trace: tuple[Any, Any], replanner: Replanner | None, scale_loss: bool = False) -> EpochResult:
    device = env.device
    cl = channels_last_for(workload, device, cfg.mixed_devices)
    timer.reset()
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    n_sum = 0
    step = first_step
    batch_sizes = hetero.batch_sizes if hetero is not None else plan.batch_sizes
    for x, y in timer.iter_data(loader):
        if cfg.max_steps_per_epoch is not None and step - first_step >= cfg.max_steps_per_epoch:
            break
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        if cl and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        if trace[0] is not None:
            idx = next(trace[1]) if trace[1] is not None else []
            trace[0].write(json.dumps({"epoch": epoch, "step": step, "rank": env.rank, "indices": idx}) + "\n")
            trace[0].flush()  # a kill -9 must not lose lines of steps the checkpoint already covers
        timer.compute_start()
        with _autocast(cfg, device):
            loss = workload.loss_fn(ddp(x), y)
            # Emulated extra work goes between the real forward and backward: inside the measured compute span,
            # and after DDP's forward-start buffer broadcast, which would otherwise make the peers wait for it.
            slowdown.apply(ddp, workload.loss_fn, x, y)
        if scale_loss:  # exact sample-weighted gradient through DDP's averaging all-reduce
            (loss * loss_scale(hetero, step)).backward()  # type: ignore[arg-type]
        else:
            loss.backward()
        timer.compute_end()  # ignored when the hook already closed the span (DDP with several ranks)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.detach().double() * x.shape[0]
        n_sum += int(x.shape[0])
        timer.step_end()
        step += 1
        if cfg.checkpoint_dir and cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and env.is_main:
            save_checkpoint(cfg.checkpoint_dir, epoch=epoch, step=step, model=model, optimizer=optimizer,
                            plan=plan, sampler_state=hetero.state_dict(step) if hetero else None,
                            replanner=replanner)
    sync_device(device)
    w = plan.ranks[env.rank].num_workers
    stats = timer.epoch_summary(rank=env.rank, epoch=epoch, batch_size=batch_sizes[env.rank], num_workers=w)
    local = (stats.to_dict(), float(loss_sum.item()), n_sum)
    gathered = all_gather_object(local, env)
    all_stats = [g[0] for g in gathered]
    loss_total = sum(g[1] for g in gathered)
    n_total = sum(g[2] for g in gathered)
    # The synchronous step is as slow as its slowest rank's step-to-step interval.
    step_s = max((s["step_time_s"] for s in all_stats if s["num_steps"] > 0), default=float("nan"))
    B = sum(batch_sizes)
    sps = B / step_s if step_s and math.isfinite(step_s) and step_s > 0 else 0.0
    return EpochResult(epoch=epoch, samples_per_s=sps, step_time_s=step_s if math.isfinite(step_s) else 0.0,
                       loss=loss_total / max(n_total, 1), batch_sizes=tuple(batch_sizes), stats=all_stats,
                       predicted_step_time_s=plan.predicted.step_time_s)


def auto_plan(cfg: TrainConfig, env: DistEnv, *, global_batch: int, quick: bool, workload: Workload,
              plan_out: str | None, profile_out: str | None, min_batch: int = 1) -> tuple[Plan, Profile | None]:
    """Profile every rank in-process, solve on rank 0, broadcast the plan (collective)."""
    from profiler.run import gather_profile, profile_this_rank

    rank_profile = profile_this_rank(workload, env.device, quick=quick, slowdown=cfg.slowdown,
                                     loader_workers_cap=cfg.loader_workers_cap, amp=cfg.amp, rank=env.rank,
                                     channels_last=channels_last_for(workload, env.device, cfg.mixed_devices))
    profile = gather_profile(rank_profile, workload=workload)
    payload: Any = None
    if env.is_main:
        assert profile is not None
        if workload.has_batchnorm:
            min_batch = max(min_batch, 2)
        try:
            plan = planner.solve(profile, global_batch=global_batch, min_batch=min_batch)
            payload = ("ok", plan.to_dict(), profile.to_dict())
            if plan_out:
                plan.save(plan_out)
            if profile_out:
                profile.save(profile_out)
        except ValueError as e:
            payload = ("error", str(e), None)
    payload = broadcast_object(payload, env)
    if payload[0] == "error":
        raise planner.PlanError(payload[1])
    return Plan.from_dict(payload[1]), Profile.from_dict(payload[2])


def env_summary() -> dict[str, Any]:
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "pid": os.getpid()}
