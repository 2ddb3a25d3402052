"""A model factory that first binds its rank to one CPU core, as `srun --cpu-bind=cores` or `numactl` would.

torchrun binds CPU ranks to nothing, and a CPU hog can only slow *one* rank when the ranks sit on cores of their
own.  ``--model tests.profiler._pinned:pinned_mlp`` pins every thread of rank LOCAL_RANK to the core at that
position of $PLANNER_TEST_CORES (e.g. "0,1"), then builds an MLP for 3x28x28 inputs.

Its width (``WIDTH``) sets how long a rank's compute sweep lasts, and the sweep is the window over which the profile
reads the other processes' CPU use on the rank's core, which needs at least ``profiler.hoststate.MIN_WINDOW_S``
(1 s).  On 2 cores, with two hogs sharing rank 1's core, rank 1's sweep took 2.0-2.9 s at this width; at 512 it took
0.9-1.0 s, and the hogs went unmeasured.
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


WIDTH = 1536


def pinned_mlp(num_classes: int = 10) -> nn.Module:
    pin_this_rank()
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 28 * 28, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, num_classes))
