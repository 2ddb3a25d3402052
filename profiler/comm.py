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
