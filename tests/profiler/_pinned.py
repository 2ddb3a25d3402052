"""A model factory that first binds its rank to one CPU core, as `srun --cpu-bind=cores` or `numactl` would.

torchrun binds CPU ranks to nothing, and a CPU hog can only slow *one* rank when the ranks sit on cores of their
own.  ``--model tests.profiler._pinned:pinned_mlp`` pins every thread of rank LOCAL_RANK to the core at that
position of $PLANNER_TEST_CORES (e.g. "0,1"), then builds a small MLP for 3x28x28 inputs.
"""

from __future__ import annotations

import os

from torch import nn


def pin_this_rank() -> int:
    cores = [int(c) for c in os.environ["PLANNER_TEST_CORES"].split(",")]
    core = cores[int(os.environ.get("LOCAL_RANK", "0")) % len(cores)]
    # Every thread, not only the caller: gloo and torch started theirs before the model was built.
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except OSError:  # a thread that ended meanwhile
            pass
    return core


def pinned_mlp(num_classes: int = 10) -> nn.Module:
    pin_this_rank()
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 28 * 28, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, num_classes))
