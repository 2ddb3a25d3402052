"""All-reduce time of the model's gradient, bucketed like DDP, on the job's real backend.

DDP all-reduces the gradient in buckets of ``bucket_cap_mb`` (25 MiB) as backward produces them.  We time the
same traffic: ceil(grad_bytes / 25 MiB) float32 buckets, launched asynchronously back to back and waited for
together (as DDP's reducer does), on CUDA tensors for NCCL and CPU tensors for gloo.  Each repeat starts behind a
barrier so no rank's lateness is counted as communication; the median repeat per rank is taken and the slowest
rank's median is reported (every rank waits for it).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

from planner.profile import CommProfile

DDP_BUCKET_BYTES = 25 * 1024 * 1024


def bucket_sizes(grad_bytes: int, bucket_bytes: int = DDP_BUCKET_BYTES, elem_bytes: int = 4) -> list[int]:
    """Element counts of the buckets DDP would form for `grad_bytes` of gradient."""
    total = max(1, grad_bytes // elem_bytes)
    per = max(1, bucket_bytes // elem_bytes)
    sizes = [per] * (total // per)
    if total % per:
        sizes.append(total % per)
    return sizes


def measure_allreduce(grad_bytes: int, *, repeats: int = 10, warmup: int = 2,
                      group: dist.ProcessGroup | None = None) -> CommProfile:
    """Collective: every rank of `group` calls it.  Returns CommProfile(backend, allreduce_s) on every rank."""
    backend = str(dist.get_backend(group))
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    buckets = [torch.ones(n, dtype=torch.float32, device=device) for n in bucket_sizes(grad_bytes)]

    def once() -> float:
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        works = [dist.all_reduce(b, group=group, async_op=True) for b in buckets]
        for w in works:
            assert w is not None
            w.wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    for _ in range(warmup):  # connection set-up, NCCL communicator init
        once()
    mine = statistics.median(once() for _ in range(repeats))
    worst = torch.tensor([mine], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return CommProfile(backend=backend, allreduce_s=float(worst.item()))


NCCL_CTA_VARIANTS: tuple[dict[str, str], ...] = ({"NCCL_MIN_CTAS": "2", "NCCL_MAX_CTAS": "2"},)
"""Launch settings the profile tries beside NCCL's default (two channels took F = 3 on 2 H200s from
1.84x to 1.94x equal).  Each costs one more set of DDP rounds, so the list stays short."""

_CTA_FIELDS = {"NCCL_MIN_CTAS": "min_ctas", "NCCL_MAX_CTAS": "max_ctas"}


def nccl_group_for(env: Mapping[str, str]) -> dist.ProcessGroup | None:
    """Collective: a new NCCL group over every rank configured as `env` would configure a communicator at
    launch (NCCL_MIN_CTAS / NCCL_MAX_CTAS are the environment's names for ncclConfig_t's minCTAs / maxCTAs),
    or None when `env` names something else or this torch/NCCL build cannot set it per communicator.

    NCCL reads its environment once per process, so a setting is compared in-process through the
    communicator's config; a launched job gets the same through the environment (planner/cli/cmd_train.py).
    """
    if set(env) - set(_CTA_FIELDS) or not dist.is_nccl_available():
        return None
    try:
        opts = dist.ProcessGroupNCCL.Options()
        for name, value in env.items():
            setattr(opts.config, _CTA_FIELDS[name], int(value))
    except (AttributeError, ValueError):  # built without NCCL_HAS_COMM_CTA_CGA: no per-communicator CTAs
        return None
    group = dist.new_group(backend="nccl", pg_options=opts)
    assert isinstance(group, dist.ProcessGroup)  # every rank is a member
    return group
