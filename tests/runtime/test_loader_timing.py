"""The loader's own cost, timed in its workers (runtime.loader_timing): the batches are the plain DataLoader's,
each step gets its batches' build time, and the run log and re-planner use it where the data wait cannot show it."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, SequentialSampler

from planner.stats import StepStats
from runtime.loader_timing import TimedBatches, TimedLoader
from runtime.replan.model import RankCorrection
from runtime.timing import StepTimer


class Slow(Dataset[tuple[torch.Tensor, int]]):
    """Sample i is (a vector of i, i % 3), and takes `delay_s` to build."""

    def __init__(self, n: int, delay_s: float) -> None:
        self.n, self.delay_s = n, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.delay_s)
        return torch.full((4,), float(i)), i % 3


def _batches(workers: int, delay_s: float = 0.0) -> tuple[list[Any], list[float]]:
    ds = Slow(20, delay_s)
    seen: list[float] = []
    sampler = BatchSampler(SequentialSampler(range(20)), batch_size=6, drop_last=False)
    loader = TimedLoader(DataLoader(TimedBatches(ds), sampler=sampler, batch_size=None, num_workers=workers),
                         on_batch=seen.append)
    assert len(loader) == 4
    return list(loader), seen


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_are_the_plain_loaders_and_each_carries_its_build_time(workers: int) -> None:
    sampler = BatchSampler(SequentialSampler(range(20)), batch_size=6, drop_last=False)
    plain = list(DataLoader(Slow(20, 0.0), batch_sampler=sampler))
    timed, seconds = _batches(workers, delay_s=0.002)
    assert len(timed) == len(plain) == len(seconds) == 4
    for (x, y), (px, py) in zip(timed, plain, strict=True):
        assert torch.equal(x, px) and torch.equal(y, py)
    # 6, 6, 6, 2 samples at >= 2 ms each, timed in whichever process built the batch.
    assert all(s >= 0.002 * n for s, n in zip(seconds, (6, 6, 6, 2), strict=True)), seconds


def test_iter_starts_the_samplers_pass_at_once() -> None:
    """runtime.accumulate.micro_steps reads the sampler's start position right after iter(loader): the pass must
    have started by then, as with a plain DataLoader (a resumed epoch starts mid-pass)."""
    started: list[int] = []

    class Pass:
        def __iter__(self) -> Any:
            started.append(1)
            return iter([[0, 1], [2, 3]])

        def __len__(self) -> int:
            return 2

    loader = TimedLoader(DataLoader(TimedBatches(Slow(4, 0.0)), sampler=Pass(), batch_size=None))
    it = iter(loader)
    assert started == [1]
    assert len(list(it)) == 2


def test_the_build_time_lands_on_the_step_that_consumes_the_batch() -> None:
    clock = iter(range(1000))
    timer = StepTimer(torch.device("cpu"), clock=lambda: float(next(clock)))
    loader = TimedLoader(DataLoader(TimedBatches(Slow(8, 0.0), clock=lambda: 0.0), sampler=[[0, 1], [2, 3]],
                                    batch_size=None), on_batch=lambda s: timer.loader_batch(s + 0.25))
    for _ in timer.iter_data(loader):
        timer.compute_start()
        timer.compute_end()
        timer.step_end()
    stats = timer.epoch_summary(rank=0, epoch=0, batch_size=2, num_workers=0)
    assert stats.num_steps == 2 and stats.loader_s == pytest.approx(0.25)


def _stats(**kw: Any) -> StepStats:
    base = dict(rank=1, epoch=2, num_steps=20, batch_size=102, num_workers=2, data_wait_s=0.0002, compute_s=0.031,
                step_time_s=0.192)
    return StepStats(**{**base, **kw})  # type: ignore[arg-type]


def test_a_loader_rank_paced_by_its_peer_is_as_busy_as_its_loader() -> None:
    """2x H200, rank 1 capped at 2 workers (a recorded launch): no data wait, 31 ms of compute in a 192 ms
    step -- without the workers' time it read 84% faster than its plan."""
    unmeasured = _stats()
    assert unmeasured.busy_s == pytest.approx(0.0312)
    measured = _stats(loader_s=0.38)  # 102 samples x ~3.7 ms in each of 2 workers
    assert measured.loader_period_s == pytest.approx(0.19)
    assert measured.busy_s == pytest.approx(0.19)
    assert StepStats.from_dict(json.loads(json.dumps(measured.to_dict()))) == measured
    assert StepStats.from_dict({k: v for k, v in unmeasured.to_dict().items() if k != "loader_s"}) == unmeasured


def test_the_loader_never_makes_a_rank_busier_than_its_step() -> None:
    """A loader period above the step the rank ran cannot be its steady cost (it fed those steps)."""
    assert _stats(loader_s=0.5).busy_s == pytest.approx(0.192)


def test_the_epochs_build_time_is_the_mean_after_each_workers_first_batch() -> None:
    """Two workers, 8 steps: their first batches (start-up) are left out, then the mean -- W workers deliver a
    step per mean / W seconds, so a median would misread a loader whose contention changed in the epoch."""
    timer = StepTimer(torch.device("cpu"))
    for s in (2.0, 1.5, 0.2, 0.2, 0.2, 0.6, 0.6, 0.6):
        timer.data_start()
        timer.data_end()
        timer.loader_batch(s)
        timer.compute_start()
        timer.compute_end()
        timer.step_end()
    stats = timer.epoch_summary(rank=0, epoch=0, batch_size=2, num_workers=2)
    assert stats.loader_s == pytest.approx(0.4)  # (3 x 0.2 + 3 x 0.6) / 6; the median of all 8 would be 0.6


def test_the_replanner_moves_a_measured_loader_cost_both_ways() -> None:
    """Only a starving loader could raise the cost before; measured in the workers it also comes down."""
    start = RankCorrection(loader_sec_per_sample=0.005)
    envelope = lambda b: 0.0003 * b  # noqa: E731
    down = start.updated(_stats(loader_s=0.306), envelope, smoothing=1.0, loader_wait_frac=0.05)
    assert down.loader_sec_per_sample == pytest.approx(0.003)  # 0.306 s / 102 samples
    up = start.updated(_stats(loader_s=0.714), envelope, smoothing=0.5, loader_wait_frac=0.05)
    assert up.loader_sec_per_sample == pytest.approx(0.5 * 0.005 + 0.5 * 0.007)
    same = start.updated(_stats(), envelope, smoothing=1.0, loader_wait_frac=0.05)
    assert same.loader_sec_per_sample == 0.005  # no measurement, no wait: unchanged
    starving = start.updated(replace(_stats(loader_s=0.306), data_wait_s=0.1), envelope, smoothing=1.0,
                             loader_wait_frac=0.05)
    assert starving.loader_sec_per_sample == pytest.approx(0.192 * 2 / 102)  # the wait rule still raises it


# `planner train` logging each rank's loader time: tests/cli/test_loader_check.py's --auto run checks it.
