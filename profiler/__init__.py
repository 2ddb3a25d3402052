"""Measuring each rank: compute sweep, memory, dataloader cost, all-reduce, device inventory.

Kept light on purpose: importing ``profiler`` (or ``profiler.cli``) does not import torch.  The pieces:

    profiler.specs     --model / --dataset specs -> Workload, synthetic_batch   (shared with `planner train`)
    profiler.emulate   Slowdown and --emulate-* parsing                           (shared with `planner train`)
    profiler.sweep     which batches, how many repeats, when to stop (pure; testable with fake timings)
    profiler.compute   StepRunner: timed full training steps on one device
    profiler.memory    peak bytes, capacity, largest batch that fits
    profiler.loader    seconds per sample of one loader worker, scaling over workers
    profiler.comm      gradient all-reduce time, bucketed like DDP
    profiler.inventory device / host / software facts (NVML guarded)
    profiler.run       profile_this_rank, gather_profile, profile_devices
    profiler.cli       `planner profile`
"""

from __future__ import annotations
