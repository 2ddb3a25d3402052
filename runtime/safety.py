"""Checks that must pass before the first training collective, so a misconfigured run fails loudly, not hangs.

Ranks launched with different plans, datasets or seeds would build different sampler layouts: their batch counts
differ and some rank eventually waits in an all-reduce that never comes. One JSON all-gather up front
(``runtime.collectives.all_gather_json``: data, never pickle) compares what every rank must agree on and raises the same clear error on every rank.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from planner.errors import ValidationError
from runtime.collectives import all_gather_json

# Field name in the message -> the fix to print with it.
_FIXES = {
    "world size": "launch every rank with the same --nproc-per-node/--nnodes and a plan for that many ranks",
    "plan fingerprint": "launch every rank with the same --plan file",
    "dataset length": "every rank must see the same dataset (same files, split and filters)",
    "seed": "pass the same --seed to every rank",
}


def _short(value: Any) -> str:
    text = str(value)
    return text[:10] + ".." if len(text) > 12 else text


def check_agreement(*, plan_fingerprint: str, dataset_len: int, seed: int, world_size: int | None = None,
                    settings: Mapping[str, Any] | None = None, group: Any = None) -> None:
    """All-gather (world size, plan fingerprint, dataset length, seed) and raise on any disagreement.

    Call it as the first collective of a run, after ``init_process_group`` and before DDP's constructor (which
    already broadcasts). Every rank raises the same ``ValidationError`` naming the field, the ranks and their
    values, e.g. "ranks disagree on plan fingerprint: rank 0 has 9f1c.., rank 1 has 03ab..; launch every rank
    with the same --plan file".

    Args:
        plan_fingerprint: ``plan.fingerprint`` of the plan this rank loaded.
        dataset_len: ``len(dataset)`` on this rank.
        seed: the sampler seed on this rank.
        world_size: the world size this rank expects (e.g. ``plan.world_size``); default: the group's size.
        settings: further values every rank must share, by the flag that sets them (``{"--lr": 0.01, "--epochs":
            10, ...}``): JSON-able.  Ranks with another learning rate train drifting replicas silently; another
            epoch count leaves a rank waiting in an all-reduce its peers never start.  Every rank must pass the
            same keys.
        group: process group (default: the default group).
    """
    actual = dist.get_world_size(group)
    mine = {
        "world size": actual if world_size is None else int(world_size),
        "plan fingerprint": str(plan_fingerprint),
        "dataset length": int(dataset_len),
        "seed": int(seed),
        "settings": dict(sorted((settings or {}).items())),
    }
    by_rank = dict(enumerate(all_gather_json(mine, group)))
    for field, fix in _FIXES.items():
        values = {r: by_rank[r][field] for r in sorted(by_rank)}
        if len(set(values.values())) > 1:
            listed = ", ".join(f"rank {r} has {_short(v)}" for r, v in values.items())
            raise ValidationError(f"ranks disagree on {field}: {listed}; {fix}")
    names = sorted({k for r in by_rank for k in by_rank[r]["settings"]})
    for name in names:
        values = {r: json.dumps(by_rank[r]["settings"].get(name), sort_keys=True) for r in sorted(by_rank)}
        if len(set(values.values())) > 1:
            listed = ", ".join(f"rank {r} has {_short(v)}" for r, v in values.items())
            raise ValidationError(f"ranks disagree on {name}: {listed}; launch every rank with the same {name}")
    if mine["world size"] != actual:  # everyone agrees, but not with the group they are in
        raise ValidationError(
            f"every rank expects world size {mine['world size']} but the process group has {actual} ranks; "
            f"{_FIXES['world size']}"
        )


def check_batchnorm(model: torch.nn.Module, min_batch: int) -> int:
    """The min_batch to use for ``model``: at least 2 when it has (non-synchronized) BatchNorm layers.

    BatchNorm in training mode raises on a batch of one sample ("Expected more than 1 value per channel") and is
    noisy on tiny ones; the sampler never yields a batch below the returned value. SyncBatchNorm normalizes over
    all ranks' samples, so it needs no per-rank minimum.
    """
    plain = [name for name, m in model.named_modules()
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(m, torch.nn.SyncBatchNorm)]
    if not plain or min_batch >= 2:
        return min_batch
    warnings.warn(
        f"model has BatchNorm layers ({plain[0]}{' and more' if len(plain) > 1 else ''}): using min_batch=2 "
        f"instead of {min_batch}, since a per-rank batch of 1 breaks BatchNorm; consider "
        "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) so small per-rank batches normalize over all ranks",
        stacklevel=2,
    )
    return 2
