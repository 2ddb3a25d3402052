"""Membership that changes: curves an elastic restart can take from the interrupted run instead of measuring them.

An elastic torchrun job (``--nnodes MIN:MAX``) restarts every worker when a node leaves or joins, and each one runs
the script again: `planner train --auto --resume` then re-plans for the new world from the checkpoint
(planner/cli/train_resume.py keeps the global batch and continues at the saved global step).  Measuring every rank
again would cost each membership change a whole profile, although most ranks are the ones that just ran.  So the
checkpoint keeps the profile the run's plan was solved on (``state["profile"]``), and a rank of the new world takes
a rank's curves from it when both are of one kind on one host:

    same host name (profiler.inventory.host_name), same device name and type, the same mixed precision and
    emulated slowdown, the same loader-worker cap, and the same workload (the profile's ``meta.workload``)

-- what makes two ranks measure alike (the quality gate's identical-device test uses the same facts), on the host
whose cores and loader the curves were measured with.  The compute, memory, loader and optimizer-step
measurements are taken; the communication is always measured again (it belongs to the new world).  When every
rank has such a curve nothing is swept; otherwise the ranks that have one run a sweep of one batch size (the
profile's collectives need every rank) and keep their curves, and only the new ranks sweep in full.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from planner.errors import ValidationError
from planner.profile import Profile, RankProfile

if TYPE_CHECKING:
    from planner.cli.distenv import DistEnv
    from planner.cli.train_config import TrainConfig

REUSED_KEY = "curve_from_checkpoint"
"""A reused rank's meta: {"rank": the rank it was measured as, "world_size": that run's world size}."""


def saved_profile(state: Mapping[str, Any] | None) -> Profile | None:
    """The profile a checkpoint's plan was solved on; None when it holds none (a run with --plan, an older file)
    or one this version cannot read (then every rank is measured, as without one)."""
    data = state.get("profile") if state is not None else None
    if not isinstance(data, dict):
        return None
    try:
        return Profile.from_dict(data, path="checkpoint.profile")
    except ValidationError:
        return None


def rank_kind(host: str, device_name: str | None, device: str, *, amp: Any, slowdown: Any,
              loader_cap: Any) -> tuple[Any, ...]:
    """What must match for a curve measured on one rank to stand for another (see the module docstring)."""
    return (host, device_name or "", device.split(":")[0], amp or None, float(slowdown or 1.0), loader_cap)


def kind_of(r: RankProfile) -> tuple[Any, ...]:
    m = r.meta
    return rank_kind(r.host, r.device_name, r.device, amp=m.get("amp"), slowdown=m.get("emulate_slowdown"),
                     loader_cap=m.get("emulate_loader_workers"))


def reusable(saved: Profile | None, kind: tuple[Any, ...], workload: str | None, *,
             prefer_rank: int | None = None) -> RankProfile | None:
    """A rank of ``saved`` of this ``kind`` (the one numbered ``prefer_rank`` when it is one), or None; the saved
    profile must have measured the same workload."""
    if saved is None or (workload is not None and saved.meta.get("workload") not in (None, workload)):
        return None
    matches = [r for r in saved.by_rank if kind_of(r) == kind]
    if not matches:
        return None
    return next((r for r in matches if r.rank == prefer_rank), matches[0])


def as_rank(known: RankProfile, rank: int, saved_world: int, meta: Mapping[str, Any]) -> RankProfile:
    """``known``'s measurements as rank ``rank`` of this world, with this process's own facts (``meta``: where
    torchrun put it) and a note of where the curve came from."""
    extra = {REUSED_KEY: {"rank": known.rank, "world_size": saved_world}, **meta}
    return dataclasses.replace(known, rank=rank, meta={**known.meta, **extra})


def known_curve(cfg: TrainConfig, env: DistEnv, workload_name: str) -> tuple[RankProfile | None, bool]:
    """Collective: (this rank's curves from the checkpoint's profile as this rank, or None; whether every rank has
    them).  Outside a resume, or without a saved profile, (None, False) on every rank."""
    from planner.cli.checkpoint import load_checkpoint
    from profiler.inventory import device_facts, host_name, node_facts
    from runtime.collectives import all_gather_json

    known = None
    saved = None
    host = host_name()
    if cfg.resume and cfg.checkpoint_dir:
        import torch

        saved = saved_profile(load_checkpoint(cfg.checkpoint_dir, torch.device("cpu")))
    if saved is not None:
        kind = rank_kind(host, device_facts(env.device)[0], str(env.device), amp="bf16" if cfg.amp else None,
                         slowdown=cfg.slowdown if cfg.slowdown != 1.0 else None, loader_cap=cfg.loader_workers_cap)
        known = reusable(saved, kind, workload_name, prefer_rank=env.rank)
    views = all_gather_json({"host": host, "known": known is not None})
    if known is None or saved is None:
        return None, False
    ranks_on_host = sum(1 for v in views if v["host"] == host)
    facts = {"ranks_on_host": ranks_on_host, "node": node_facts()}
    mine = as_rank(known, env.rank, saved.world_size, {k: v for k, v in facts.items() if v is not None})
    return mine, all(v["known"] for v in views)
