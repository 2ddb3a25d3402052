"""The timed window of one `planner bench` strategy, and what the strategy ran with.

Every strategy is timed the same way (MLPerf's rule, torch.utils.benchmark's habit): the earlier epochs and the
first step of the last one are warm-up (allocator, cudnn autotune, loader workers, the sampler's epoch start);
the window opens after that first step (a loader-fed run: after planner.cli.steps.loader_drain_steps, once the batches
its workers built ahead are spent) and closes after the epoch's last step, and at both ends every rank
first waits for its device (``sync_device``) and then for every other rank (``barrier``) before the clock is
read.  So the window starts with every rank idle and ends when the slowest rank's last kernel is done, and no
epoch-boundary work (a sampler's shuffle, the stats gather) falls inside it -- in a bench epoch of 30 steps that
work would weigh ~60x what it weighs in a real epoch.  Throughput is the window's samples over its wall time.

It also records, from the set-up run itself, what the strategy ran: sampler, DDP wrapper, gradient weighting,
global batch, steps, epochs and each rank's emulated slowdown -- so the JSON shows that "equal" is torch's
DistributedSampler with plain DDP and that every strategy had the same steps, warm-up, batch and emulation.
"""

from __future__ import annotations

import time
from typing import Any


class TimedWindow:
    """``on_start``/``on_step`` callbacks for ``planner.cli.train.train`` (collective: every rank passes one)."""

    def __init__(self, device: Any, open_after: int = 1) -> None:
        """``open_after``: steps of the last epoch before the window opens (1: the epoch's first step; loader-fed
        runs pass planner.cli.steps.loader_drain_steps, so the workers' ready batches are spent first)."""
        if open_after < 1:
            raise ValueError(f"open_after={open_after}: the window opens after at least one step")
        self.device = device
        self.open_after = open_after
        self.marks: list[tuple[int, float, list[str], float]] = []
        """(steps done, clock, what was done before reading it) at the window's two ends."""
        self.setup: dict[str, Any] = {}
        self.last_epoch = 0
        self.last_step = 0

    def on_start(self, run: Any) -> None:
        from runtime.collectives import all_gather_json

        cfg = run.cfg
        self.last_epoch = cfg.epochs - 1
        # The epoch's length as run_epoch computes it: the same on every rank, so the barriers below match.
        length = run.hetero.num_steps if run.hetero is not None else len(run.loader)
        self.last_step = min(length, cfg.max_steps_per_epoch or length)
        self.setup = {
            "sampler": type(run.dsampler if run.dsampler is not None else run.hetero).__name__,
            "batch_sampler": type(run.batch_sampler).__name__,
            "model": type(run.ddp).__name__,
            # DDP keeps its registered comm hooks here: plain DDP has none and all-reduces in C++ by itself.
            "comm_hook": bool(getattr(run.ddp, "_comm_hooks", None)),
            "loss_scale": bool(run.scale_loss),
            "global_batch": int(sum(run.plan.batch_sizes)),
            "steps_per_epoch": self.last_step,
            "epochs": cfg.epochs,
            "amp": cfg.amp,
            "data_on_device": cfg.data_on_device,
            # one collective at the same point on every rank: each rank's own emulation, as the run applies it
            "slowdown": all_gather_json([cfg.slowdown, cfg.slowdown_late, cfg.slowdown_from_epoch]),
        }

    def on_step(self, epoch: int, done: int) -> None:
        if epoch == self.last_epoch and done in (self.open_after, self.last_step) and len(self.marks) < 2:
            self._mark(done)

    def _mark(self, done: int) -> None:
        import torch.distributed as dist

        from planner.cli.distenv import sync_device

        did = []
        sync_device(self.device)
        did.append("device_sync")
        if dist.is_available() and dist.is_initialized():
            if self.device.type == "cuda" and dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()
            did.append("barrier")
        self.marks.append((done, time.perf_counter(), did, time.time()))

    def result(self, global_batch: int) -> dict[str, Any]:
        """The window: seconds, steps, samples/s, what synchronized each end, and its ends' unix times (to line
        it up with a host monitor's samples, benchmarks/hostmon.py)."""
        if len(self.marks) != 2 or self.marks[1][0] <= self.marks[0][0]:
            raise RuntimeError(f"the timed window opens after step {self.open_after} of the last epoch and needs "
                               f"at least one more, got {self.last_step} steps")
        (s0, t0, start, u0), (s1, t1, end, u1) = self.marks
        return {"seconds": t1 - t0, "steps": s1 - s0, "samples_per_s": (s1 - s0) * global_batch / (t1 - t0),
                "start": start, "end": end, "warmup_epochs": self.last_epoch, "warmup_steps": s0,
                "unix": [round(u0, 3), round(u1, 3)]}
