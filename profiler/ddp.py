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
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from planner.curves import fit_envelope
from planner.profile import RankProfile
from profiler.compute import TimedSteps


def common_batch(ranks: Sequence[RankProfile]) -> int:
    """A batch every rank has measured near: the smallest of the ranks' median measured batch sizes."""
    return min(int(statistics.median_low([p.batch_size for p in r.compute])) for r in ranks)


def measure_exposed_s(make_runner: Callable[[], TimedSteps], ranks: Sequence[RankProfile], *,
                      group: Any = None, warmup: int = 3, repeats: int = 8) -> float:
    """Collective over `group`: the synchronization cost of one DDP step (>= 0), the same on every rank."""
    return statistics.median(measure_exposed_rounds_s(make_runner, ranks, group=group, warmup=warmup, rounds=1,
                                                      repeats=repeats))


def measure_exposed_rounds_s(make_runner: Callable[[], TimedSteps], ranks: Sequence[RankProfile], *,
                             group: Any = None, warmup: int = 3, rounds: int = 3, repeats: int = 4) -> list[float]:
    """Collective over `group`: the synchronization cost of one DDP step (>= 0) in each of `rounds` rounds of
    `repeats` steps, the same list on every rank (the slowest rank's mean per round).

    ``make_runner`` builds this rank's step as profiled (profiler.compute.TimedSteps: the workload's, or a
    user's own through profiler.api); its loss runs through the DDP wrapper here.
    """
    b = common_batch(ranks)
    runner = make_runner()
    device = runner.device
    try:
        ddp = DDP(runner.model, device_ids=[device.index] if device.type == "cuda" else None, process_group=group)
        batch = runner.batch_for(b)
        for _ in range(warmup):
            runner.train_step(batch, ddp)
        means = []
        for _ in range(rounds):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier(group=group)  # every round starts together, so no rank's wait is counted as its work
            t0 = time.perf_counter()
            for _ in range(repeats):
                runner.train_step(batch, ddp)
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
