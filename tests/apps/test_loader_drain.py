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


def test_a_split_drains_for_the_ranks_near_their_loaders_pace_only() -> None:
    """apps.bench.window_drain_steps: the 2x H100 loader-skew split of session 7 -- equal [256, 256] with 15 and 2
    workers, the 2-worker rank's loader at 558 of a 718 ms step, the 15-worker one's at 91 ms -- drains for the
    2-worker rank alone; a split without a loader-paced rank opens after the first step."""
    from types import SimpleNamespace as NS

    from apps.bench import window_drain_steps

    def plan(step: float, ranks: list[tuple[int, float]]) -> NS:
        return NS(predicted=NS(step_time_s=step),
                  ranks=[NS(num_workers=w, predicted_loader_s=lo) for w, lo in ranks])

    assert window_drain_steps(plan(0.718, [(15, 0.091), (2, 0.558)])) == loader_drain_steps(2)
    assert window_drain_steps(plan(0.162, [(16, 0.155), (2, 0.124)])) == loader_drain_steps(16)
    assert window_drain_steps(plan(0.100, [(8, 0.01), (8, 0.02)])) == 1
    assert window_drain_steps(plan(0.100, [(0, 0.09), (0, 0.09)])) == 1  # the loop loads itself


def test_an_epoch_without_a_steady_middle_is_said_out_loud() -> None:
    """apps.steps.short_epoch_warning: 16 workers need 80 fill + 64 drain + 2 x 16 = 176 steps; #18's command (50
    steps of 512), session 8's 30-step and sessions 9-10's 100-step epochs have none, and session 10's 200-step
    epochs at 28 workers (140 + 112 + 56 = 308) neither; loader_gpu.sh's 320-step epochs do."""
    from apps.steps import short_epoch_warning

    line = short_epoch_warning(50, [16, 2])
    assert line is not None and line.startswith("warning: an epoch of 50 steps has no steady middle")
    assert "rank 0's loader (16 workers: 80 steps filling their prefetch of 4 at the start, 64 draining" in line
    assert "= 176 steps" in line and "at least 176 steps" in line
    assert short_epoch_warning(30, [2, 16]) is not None and "rank 1's" in short_epoch_warning(30, [2, 16])  # type: ignore[operator]
    assert short_epoch_warning(100, [16, 2]) is not None and short_epoch_warning(176, [16, 2]) is None
    assert short_epoch_warning(200, [28, 2]) is not None and short_epoch_warning(320, [28, 2]) is None
    assert short_epoch_warning(3, [1, 1]) is None and short_epoch_warning(3, [0, 0]) is None  # no bursts to fill
