"""apps.steps.loader_drain_steps: where a loader-fed timed window may open.

A DataLoader whose loop paused (an epoch boundary, a barrier) has batches ready in every worker's prefetch queue;
the steps that take them run faster than the loader can deliver.  Session 6 (2x H200, `planner bench --data loader
--emulate-loader 1=2`): a 15-step window opened right after the epoch boundary, the 2-worker rank never waited
for data and the plan measured 21% faster than its loader allows.
"""

from __future__ import annotations

import statistics
import time

from torch.utils.data import DataLoader

from apps.steps import LOADER_PREFETCH, loader_drain_steps


class _SlowBatches:
    """Each item is a whole batch costing its worker ``cost`` seconds of sleep (no CPU)."""

    def __init__(self, n: int, cost: float) -> None:
        self.n, self.cost = n, cost

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        time.sleep(self.cost)
        return i


def test_the_rule() -> None:
    assert loader_drain_steps(0) == 1  # the loop loads itself: nothing is built ahead
    assert loader_drain_steps(2) == 2 * (LOADER_PREFETCH + 1) and loader_drain_steps(8, prefetch=2) == 24


def test_steps_after_the_drain_run_at_the_loaders_pace_and_the_first_ones_do_not() -> None:
    workers, cost = 2, 0.04
    period = cost / workers  # a batch every 20 ms in the steady state
    drain = loader_drain_steps(workers)
    loader = DataLoader(_SlowBatches(drain + 40, cost), batch_size=None, num_workers=workers,
                        prefetch_factor=LOADER_PREFETCH)
    it = iter(loader)
    time.sleep(1.0)  # the loop pauses (an epoch boundary): the workers fill their queues
    gaps, t = [], time.perf_counter()
    for _ in it:
        now = time.perf_counter()
        gaps.append(now - t)
        t = now
    early, steady = gaps[:workers * LOADER_PREFETCH], gaps[drain:]
    assert statistics.mean(early) < 0.25 * period  # taken from the queues: a window here measures the buffer
    assert 0.7 * period < statistics.mean(steady) < 1.6 * period  # after the drain: the loader's own pace
