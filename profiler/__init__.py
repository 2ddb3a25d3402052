"""Measuring each rank: compute sweep, memory, dataloader cost, all-reduce, device inventory.

Kept light on purpose: importing ``profiler`` does not import torch.  What it measures comes from ``workloads``
(model/dataset specs, emulated slowdowns); `planner profile` is ``apps.cmd_profile``.  The pieces:

    profiler.sweep     which batches, how many repeats, when to stop (pure; testable with fake timings)
    profiler.compute   StepRunner: timed full training steps on one device
    profiler.memory    peak bytes, capacity, largest batch that fits
    profiler.loader    seconds per sample of one loader worker, scaling over workers
    profiler.comm      gradient all-reduce time, bucketed like DDP
    profiler.ddp       DDP's measured per-step overhead (real DDP steps minus the slowest standalone step)
    profiler.inventory device / host / software facts (NVML guarded)
    profiler.run       profile_this_rank, gather_profile, profile_devices
"""

from __future__ import annotations
