"""What the profiler and the programs run: model/dataset specs and emulated heterogeneity.

    profiler.workloads.specs    --model / --dataset specs -> Workload (model factory, dataset, loss), synthetic_batch
    profiler.workloads.lm       tiny_lm, a causal LM in plain torch, and its token data
    profiler.workloads.emulate  Slowdown (rank runs F x its compute) and --emulate-* parsing

Shared by the profiler (what it measures) and ``planner.cli`` (what the trainer and bench run), so both apply the
same emulation in profiling and in training.  Importing ``profiler.workloads`` does not import torch.
"""

from __future__ import annotations
