"""Checkpoint and resume for the reference trainer (planner/cli/train.py): where a run continues from, an elastic restart
on another world size (same global batch, exactly-once coverage of the interrupted epoch), and the save at each
boundary.  The file format and its safety checks are planner/cli/checkpoint.py."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from planner.cli.checkpoint import CHECKPOINT_NAME, check_state_fits, load_checkpoint, save_checkpoint
from planner.cli.preflight import check_weights_fit, run_meta
from planner.errors import ValidationError
from planner.plan import Plan
from planner.runlog import ResizeRecord
from runtime.sampler import HeteroBatchSampler

if TYPE_CHECKING:
    from planner.cli.train import Run


def resume(run: Run) -> ResizeRecord | None:
    """Continue from the checkpoint in ``cfg.checkpoint_dir`` when it holds one; a resize record when the world
    size changed (an elastic restart)."""
    cfg, env = run.cfg, run.env
    if not (cfg.resume and cfg.checkpoint_dir):
        return None
    state = load_checkpoint(cfg.checkpoint_dir, env.device)
    if state is None:
        return None
    saved = Plan.from_dict(state["plan"])
    check_weights_fit(run.model.state_dict(), state["model"], cfg.checkpoint_dir)
    # Everything the model, optimizer and epoch must take exactly, before any of it is loaded or announced
    # (an epoch's steps depend only on the dataset and the global batch, which a resume keeps).
    steps = run.hetero.num_steps if run.hetero is not None else len(run.batch_sampler)
    check_state_fits(state, run.model, run.optimizer, steps_per_epoch=steps, path=cfg.checkpoint_dir)
    resize = None
    if saved.world_size != run.plan.world_size:
        run.plan = _elastic_plan(saved, run.plan, run.hetero, state)
        resize = ResizeRecord(time=time.time(), epoch=int(state["epoch"]), step=int(state["step"]),
                              old_world_size=saved.world_size, new_world_size=run.plan.world_size,
                              old_batch_sizes=saved.batch_sizes, new_batch_sizes=run.plan.batch_sizes, plan=run.plan)
    elif "plan" in cfg.resume_changes:
        # Another plan of the same global batch, allowed by the user: the position carries over as in an elastic
        # restart (global step s covers the same samples whatever the split); the re-planner starts afresh.
        run.plan = _elastic_plan(saved, run.plan, run.hetero, state)
    else:
        run.plan = saved
        if run.hetero is not None:
            run.hetero.load_state_dict(state["sampler"])
        if run.replanner is not None and state.get("replanner"):
            run.replanner.load_state_dict(state["replanner"])
    run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    if "lr" in cfg.resume_changes:  # the optimizer state carries the old rate; the user asked for this one
        for group in run.optimizer.param_groups:
            group["lr"] = cfg.lr
    run.start_epoch, run.start_step = int(state["epoch"]), int(state["step"])
    run.last_saved = (run.start_epoch, run.start_step)
    run.say(f"resumed from {cfg.checkpoint_dir} at epoch {run.start_epoch} step {run.start_step}")
    return resize


def agree_on_resume(checkpoint_dir: str | None, resume_at: tuple[int, int] | None, fingerprint: str | None) -> None:
    """Collective, the run's first: every rank resumes the same checkpoint at the same (epoch, step), or every rank
    starts fresh -- else one line naming each rank's state, on every rank, before anything is profiled or trained.

    Each rank reads its own ``--checkpoint`` folder: with node-local folders, rank 0's may hold a checkpoint and
    rank 1's none (or an older one). Unchecked, the ranks trained together from different epochs with different
    weights and optimizer states, each drawing its share of another epoch's shuffle: samples were missed and
    others seen twice, silently.  The checkpoint is compared by the digest of its file's bytes."""
    from runtime.safety import first_ranks, gather_agreement

    def cut(text: str | None) -> str:
        text = str(text)
        return text if len(text) <= 100 else text[:30] + ".." + text[-68:]  # the end tells node folders apart

    state = None if resume_at is None else {"epoch": int(resume_at[0]), "step": int(resume_at[1]),
                                            "checkpoint": fingerprint}
    by_rank = gather_agreement({"resume": state, "folder": checkpoint_dir})
    firsts = first_ranks({r: payload.get("resume") for r, payload in by_rank.items()})
    if len(firsts) == 1:
        return

    def said(r: int) -> str:
        mine, folder = by_rank[r].get("resume"), by_rank[r].get("folder")
        if not isinstance(mine, dict):
            return f"rank {r} starts fresh (no checkpoint in {cut(folder)})"
        return (f"rank {r} resumes epoch {mine.get('epoch')} step {mine.get('step')} of checkpoint "
                f"{cut(mine.get('checkpoint'))} in {cut(folder)}")

    source = next((r for r in firsts if isinstance(by_rank[r].get("resume"), dict)), 0)
    raise ValidationError(
        f"ranks would resume differently: {', '.join(said(r) for r in firsts[:3])}; every rank must "
        f"resume the same checkpoint -- point --checkpoint at a folder every rank reads, or copy rank {source}'s "
        f"{CHECKPOINT_NAME} into every rank's folder (or empty every folder to start afresh)")


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
                         min_batch=hetero.min_batch, accumulation_steps=list(plan.accumulation_steps),
                         pending_accumulation_steps=None)
    hetero.load_state_dict(sampler_state)
    return plan


def checkpoint(run: Run, epoch: int, step: int) -> None:
    """Rank 0 saves where training resumes: ``epoch`` and ``step`` are the next step to run (and records it as
    ``run.last_saved``; the epoch-end gather tells the other ranks)."""
    cfg = run.cfg
    if cfg.checkpoint_dir and run.env.is_main:
        start = run.start_plan or run.plan
        meta = run_meta(model=cfg.model, dataset=cfg.dataset, image_size=cfg.image_size, num_samples=cfg.num_samples,
                        seed=cfg.seed, lr=cfg.lr, plan=start)
        save_checkpoint(cfg.checkpoint_dir, epoch=epoch, step=step, model=run.model, optimizer=run.optimizer,
                        plan=run.plan, sampler_state=run.hetero.state_dict(step) if run.hetero else None,
                        replanner=run.replanner, run=meta,
                        profile=run.profile.to_dict() if run.profile is not None else None)
        run.last_saved = (epoch, step)
