"""What synchronous data parallelism adds to a step: measured, not assumed.

The solver predicts a synchronous step as  max_i t_i(b_i) + exposed,  where t_i are the ranks' standalone steps.
``exposed`` is everything the standalone profile cannot see: the tail of the gradient all-reduce after the last
bucket, DDP's per-step CPU work (bucket copies, hooks, the BatchNorm buffer broadcast at forward start), and the
kernel launches it delays. On a launch-bound GPU this is most of the gap between prediction and measurement
(ResNet-18 at 32x32 on H200: 9.4 ms predicted, 13.9 ms measured under DDP).

We run a few real DDP steps at one batch size common to every rank and take

    exposed = t_DDP(b) - max_i t_i(b)

with t_DDP the slowest rank's mean step (every rank waits for it) and t_i(b) each rank's fitted standalone curve.
The same step code as the profiler's compute sweep (and the trainer) is used: emulated slowdowns included.

On a busy host one burst of DDP steps can catch a neighbour's job: one box read 172 ms, 29 ms and 0 ms in three
profiles.  So the steps run in rounds; the profile keeps the median round and records every round
(``meta.ddp_overhead_rounds_s``), which the quality gate (planner.quality) reads to warn when they disagree.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from planner.curves import fit_envelope
from planner.profile import RankProfile
from profiler.compute import StepRunner
from workloads.specs import Workload


def common_batch(ranks: Sequence[RankProfile]) -> int:
    """A batch every rank has measured near: the smallest of the ranks' median measured batch sizes."""
    return min(int(statistics.median_low([p.batch_size for p in r.compute])) for r in ranks)


def measure_exposed_s(workload: Workload, mine: RankProfile, ranks: Sequence[RankProfile], *,
                      group: Any = None, warmup: int = 3, repeats: int = 8) -> float:
    """Collective over `group`: the synchronization cost of one DDP step (>= 0), the same on every rank."""
    return statistics.median(measure_exposed_rounds_s(workload, mine, ranks, group=group, warmup=warmup,
                                                      rounds=1, repeats=repeats))


def measure_exposed_rounds_s(workload: Workload, mine: RankProfile, ranks: Sequence[RankProfile], *,
                             group: Any = None, warmup: int = 3, rounds: int = 3, repeats: int = 4) -> list[float]:
    """Collective over `group`: the synchronization cost of one DDP step (>= 0) in each of `rounds` rounds of
    `repeats` steps, the same list on every rank (the slowest rank's mean per round)."""
    b = common_batch(ranks)
    device = torch.device(mine.device)
    meta = mine.meta
    runner = StepRunner(workload, device, amp=meta.get("amp") == "bf16", channels_last=meta.get("channels_last"),
                        slowdown=float(meta.get("emulate_slowdown") or 1.0))
    try:
        ddp = DDP(runner.model, device_ids=[device.index] if device.type == "cuda" else None, process_group=group)
        dtype = next((q.dtype for q in runner.model.parameters() if q.is_floating_point()), None)
        from workloads.specs import synthetic_batch

        x, y = synthetic_batch(workload, b, device, dtype=dtype)
        if runner.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        autocast = (torch.autocast(device_type=device.type, dtype=torch.bfloat16) if runner.amp
                    else contextlib.nullcontext())

        def step() -> None:
            with autocast:
                loss = workload.loss_fn(ddp(x), y)
                runner.slowdown.apply(ddp, workload.loss_fn, x, y)  # where the trainer does it
            loss.backward()
            runner.optimizer.step()
            runner.optimizer.zero_grad(set_to_none=True)

        for _ in range(warmup):
            step()
        means = []
        for _ in range(rounds):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier(group=group)  # every round starts together, so no rank's wait is counted as its work
            t0 = time.perf_counter()
            for _ in range(repeats):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            means.append((time.perf_counter() - t0) / repeats)
    finally:
        runner.close()
    # The backend's own device: NCCL reduces CUDA tensors, gloo CPU ones.
    red_dev = device if str(dist.get_backend(group)) == "nccl" else torch.device("cpu")
    worst = torch.tensor(means, dtype=torch.float64, device=red_dev)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    alone = max(fit_envelope(r.compute)(b) for r in ranks)
    return [max(0.0, float(x) - alone) for x in worst.tolist()]
