"""What the profiler and the programs run: model/dataset specs and emulated heterogeneity.

    workloads.specs    --model / --dataset specs -> Workload (model factory, dataset, loss), synthetic_batch
    workloads.emulate  Slowdown (rank runs F x its compute) and --emulate-* parsing

Shared by ``profiler`` (what it measures) and ``apps`` (what the trainer and bench run), so both apply the same
emulation in profiling and in training (DESIGN.md section 7).  Importing ``workloads`` does not import torch.
"""

from __future__ import annotations
