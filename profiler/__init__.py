"""Measuring each rank: compute sweep, memory, dataloader cost, all-reduce, device inventory.

Kept light on purpose: importing ``profiler`` does not import torch.  What it measures comes from
``profiler.workloads`` (model/dataset specs, emulated slowdowns); `planner profile` is ``planner.cli.cmd_profile``.  The pieces:

    profiler.sweep     which batches, how many repeats, when to stop (pure; testable with fake timings)
    profiler.compute   TimedSteps (timed full training steps of any step on one device); StepRunner, a workload's
    profiler.memory    peak bytes, capacity, largest batch that fits
    profiler.loader    seconds per sample of one loader worker, scaling over workers
    profiler.comm      gradient all-reduce time, bucketed like DDP; NCCL groups configured as a launch setting
    profiler.ddp       DDP's cost: real DDP steps at the equal and the balanced split -> exposed time, wait factors
    profiler.comm_cost the communication part of a profile: all-reduce, DDP cost, launch variants (NCCL)
    profiler.parts     each part of a profile timed; the loader beside the GPU sweep
    profiler.inventory device / host / software facts (NVML guarded)
    profiler.run       measure_rank / gather_ranks (the one measuring path), profile_this_rank, gather_profile,
                       profile_devices
    profiler.api       profile any training step: your model, batches (any structure) and loss -> RankProfile,
                       and the gathered Profile on every rank
    profiler.lightning auto mode: profile a LightningModule's training_step, solve, hand the adapter the plan
"""

from __future__ import annotations
