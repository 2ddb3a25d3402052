"""The auto-plan pipeline of `planner train --auto` and `planner bench`: profile every rank -> the quality gate ->
solve -> the loader check, one function both call (collective: every rank calls it at once).

    auto = auto_plan(cfg, env, workload, AutoPlanOptions(global_batch=512), progress=progress)
    train(cfg, env, auto.plan, auto.profile, workload)

0. Every rank's options that decide the profile's collectives or the plan agree (``auto_settings``, through
   runtime.safety.check_settings): one line naming the option and each rank's value, before any profile step.
1. Every rank profiles itself in-process as it will train (``cfg``: precision, memory format, emulated slowdown
   and worker cap); the DataLoader only when the run has one (``cfg.data_on_device`` off), once per host.
2. Rank 0 gathers the profile, prints its quality warnings (stderr) and solves under the quality gate
   (planner.quality.solve_within_noise: the equal split when the optimum's gain is inside the profile's noise),
   in the run's mode (FSDP2: the same micro-step count on every rank).  Plan and profile reach every rank.
3. The loader check (planner.cli.loader_check): every rank runs its plan's DataLoader at once; a loader cost that
   moved scales the profile's curves, and the split moves only for a predicted gain of ``cfg.replan_threshold`` --
   the threshold of the Replanner that will run the plan, so no split is taken before the first step that the
   Replanner would not move to after it.

The solve runs on rank 0 and its result is shared, so every rank trains the same plan even where two solves of one
profile could differ.  ``profiler.lightning.auto_plan`` (which cannot import this layer) solves through the same
gate; its DataLoader is the user's own, and it has no loader check.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from planner.cli.distenv import DistEnv
from planner.cli.progress import Progress
from planner.cli.train_config import TrainConfig
from planner.errors import ValidationError
from planner.options import SolveOptions
from planner.plan import Plan
from planner.profile import Profile
from planner.quality import ProfileQuality, check_profile, solve_within_noise
from planner.solve import with_subset
from profiler.workloads.specs import Workload


@dataclass(frozen=True, kw_only=True, slots=True)
class AutoPlanOptions:
    """What to plan for, beyond what the run trains with (``TrainConfig``)."""

    global_batch: int
    """Samples per optimizer step over all ranks."""
    min_batch: int = 1
    """Smallest local batch; a BatchNorm model gets at least 2."""
    quick: bool = False
    """A CI-sized profile (and a 1 s loader check unless ``cfg.loader_check_s`` says otherwise)."""
    max_workers_per_rank: int | None = None
    """Most loader workers the plan gives one rank (None: SolveOptions' default, no cap of its own)."""
    plan_out: str | None = None
    """Where rank 0 writes the plan, after each solve (None: not written)."""
    profile_out: str | None = None
    """Where rank 0 writes the profile the plan was solved on, after each solve (None: not written)."""
    written_by: str | None = None
    """``plan.meta["written_by"]``: `planner train --auto` marks the plan files it may overwrite later."""

    def __post_init__(self) -> None:
        for name in ("global_batch", "min_batch", "max_workers_per_rank"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValidationError(f"{name} must be an integer >= 1, got {value!r}")

    def solve_options(self, cfg: TrainConfig, workload: Workload) -> SolveOptions:
        cap = {} if self.max_workers_per_rank is None else {"max_workers_per_rank": self.max_workers_per_rank}
        return SolveOptions(min_batch=max(self.min_batch, workload.min_batch),
                            mode="fsdp" if cfg.fsdp else "ddp", **cap)  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True, slots=True)
class AutoPlan:
    """What ``auto_plan`` gives every rank."""

    plan: Plan
    profile: Profile
    """The profile the plan was solved on (the loader-checked one when the check moved it)."""
    quality: ProfileQuality
    """The quality gate's findings on the profile as measured (the check moves loader curves only)."""
    profile_s: float
    """Seconds the profile took, gathering included."""
    loader_check: dict[str, Any] | None
    """What the loader check measured and did (None: it did not run)."""


def auto_settings(cfg: TrainConfig, options: AutoPlanOptions) -> dict[str, Any]:
    """What every rank must share before ``auto_plan`` profiles, by flag: the auto options (the loader check's
    seconds as it will run: ``--quick`` shortens the default), then the run's agreed settings (precision, loader or
    none, FSDP2... decide the profile's own collectives)."""
    from planner.cli.loader_check import check_seconds

    return {"--quick": options.quick, "--global-batch": options.global_batch, "--min-batch": options.min_batch,
            "--max-workers-per-rank": options.max_workers_per_rank,
            "--loader-check-s": check_seconds(cfg.loader_check_s, options.quick), **cfg.agreed_settings()}


def _on_stdout(line: str) -> None:
    print(line, flush=True)


def auto_plan(cfg: TrainConfig, env: DistEnv, workload: Workload, options: AutoPlanOptions, *,
              progress: Progress | None = None, say: Callable[[str], None] = _on_stdout) -> AutoPlan:
    """Profile every rank, solve on rank 0 under the quality gate, check the plan's loaders (collective; a
    PlanError reaches every rank).  ``say``: where rank 0's notes on the loader check go (`planner bench` keeps its
    stdout for the results table and passes stderr)."""
    from planner.cli.elastic import known_curve
    from planner.cli.loader_check import check_seconds
    from planner.cli.steps import channels_last_for
    from profiler.run import gather_profile, profile_this_rank
    from runtime.collectives import decide_on_rank0
    from runtime.safety import check_settings

    # The first collective: every option that decides the profile's collectives or the plan, alike on every rank
    # (a --loader-check-s of its own left a rank in a collective its peers never joined; another --min-batch or
    # --quick was silently rank 0's). One line naming the option and each rank's value, on every rank.
    check_settings(auto_settings(cfg, options))
    t0 = time.perf_counter()
    # An elastic restart (--resume into another world): ranks of a kind the checkpoint's profile measured on their
    # host keep those curves (planner/cli/elastic.py); none is swept when every rank has one.
    known, all_known = known_curve(cfg, env, workload.name)
    if all_known:
        assert known is not None
        if progress is not None:
            progress(f"every rank's curves from the checkpoint's profile ({env.world_size} ranks): no sweep")
        rank_profile = known
    else:
        rank_profile = profile_this_rank(
            workload, env.device, quick=options.quick, slowdown=cfg.slowdown,
            loader_workers_cap=cfg.loader_workers_cap, amp=cfg.amp, rank=env.rank,
            measure_loader=not cfg.data_on_device,
            channels_last=channels_last_for(workload, env.device, cfg.mixed_devices),
            # a rank with a known curve sweeps one batch size: the collectives need it, the curve does not
            batch_sizes=None if known is None else [min(p.batch_size for p in known.compute)],
            progress=progress, loader_per_host=True,  # every rank: the same dataset
            max_batch=options.global_batch)  # no plan gives a rank more
        if known is not None:
            rank_profile = dataclasses.replace(known, loader=rank_profile.loader or known.loader,
                                               device_state=rank_profile.device_state)
    # rank 0's; None elsewhere.  The DDP steps send the gradients as the run will (--grad-compress).
    gathered = gather_profile(rank_profile, workload=workload, progress=progress,
                              grad_compress=cfg.grad_compress)
    profile_s = time.perf_counter() - t0
    solve_options = options.solve_options(cfg, workload)

    def first() -> dict[str, Any]:
        assert gathered is not None
        quality = check_profile(gathered)
        for line in quality.warning_lines():
            print(line, file=sys.stderr, flush=True)
        plan = solve_within_noise(gathered, global_batch=options.global_batch, options=solve_options,
                                  quality=quality)
        # ranks whose all-reduce costs more than their samples give: named in the plan (its summary prints it)
        plan = with_subset(gathered, plan, lambda p: solve_within_noise(p, global_batch=options.global_batch,
                                                                         options=solve_options))
        return _decided(plan, gathered, options)

    shared = decide_on_rank0(first)
    plan, profile = Plan.from_dict(shared["plan"]), Profile.from_dict(shared["profile"])
    quality = check_profile(profile)
    seconds = check_seconds(cfg.loader_check_s, options.quick)
    if seconds <= 0 or cfg.data_on_device or not profile.has_loader:
        return AutoPlan(plan=plan, profile=profile, quality=quality, profile_s=profile_s, loader_check=None)
    plan, profile, record = _check_loaders(cfg, env, workload, options, plan, profile, seconds, progress, say)
    return AutoPlan(plan=plan, profile=profile, quality=quality, profile_s=profile_s, loader_check=record)


def _check_loaders(cfg: TrainConfig, env: DistEnv, workload: Workload, options: AutoPlanOptions, plan: Plan,
                   profile: Profile, seconds: float, progress: Progress | None,
                   say: Callable[[str], None]) -> tuple[Plan, Profile, dict[str, Any]]:
    """The plan's loaders, every rank's at once at its own batches and workers (planner.cli.loader_check); the
    split solved again on the checked profile only for a gain of ``cfg.replan_threshold``."""
    from planner.cli.loader_check import MIN_CHANGE, after_check, checked_profile, measure_plan_loaders, measured_line
    from runtime.collectives import decide_on_rank0

    if progress is not None:
        progress(f"loader check: the plan's DataLoaders, {seconds:g} s on every rank")
    measured = measure_plan_loaders(env.rank, workload.dataset, plan, seconds, cfg.loader_workers_cap)
    checked = checked_profile(profile, plan, plan.options, measured, seconds)
    if checked is None:
        if env.is_main:
            say(f"loader check: the plan's loaders ran as modelled (within {MIN_CHANGE:.0%}); plan kept")
        return plan, profile, {"seconds": seconds, "measured_s_per_sample": measured, "changed": False}
    if env.is_main:
        say(measured_line(checked))

    def again() -> dict[str, Any]:
        assert checked is not None
        new, done = after_check(checked, plan, plan.options, cfg.replan_threshold)
        say(f"loader check: {done}")
        return {**_decided(new, checked, options), "done": done}

    shared = decide_on_rank0(again)
    record = {**checked.meta["loader_check"], "changed": True, "done": shared["done"]}
    return Plan.from_dict(shared["plan"]), Profile.from_dict(shared["profile"]), record


def _decided(plan: Plan, profile: Profile, options: AutoPlanOptions) -> dict[str, Any]:
    """Rank 0: the plan marked with its workload (and writer), both files written; what every rank receives."""
    from planner.cli.cmd_plan import record_workload

    plan = record_workload(plan, profile)
    if options.written_by is not None:
        plan = dataclasses.replace(plan, meta={**plan.meta, "written_by": options.written_by})
    if options.plan_out:
        plan.save(options.plan_out)
    if options.profile_out:
        profile.save(options.profile_out)
    return {"plan": plan.to_dict(), "profile": profile.to_dict()}
