"""Loader-paced steps are timed over whole cycles of the DataLoader workers (runtime.timing.worker_cycle).

Workers started together at an epoch start deliver their batches in bursts: W batches, then none for a build
time T, then W more.  W consecutive steps take T wherever they start; a mean over another count of steps is off by
up to a burst.  Measured on 2x H100: a 16-worker rank of 455 samples over a 28-step epoch measured 126.6 ms a step
while its workers needed 2.18 s a batch (136 ms a step); `planner bench`'s 20-step windows of one split read
2,687-3,470 samples/s in three rounds.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import statistics
import time
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
from torch.utils.data import DataLoader

from planner.cli.bench import window_steps
from runtime.timing import StepTimer, worker_cycle
from tests.cli.test_loader_drain import _SlowBatches
from tests.runtime.test_timing import FakeClock, _host_step


def test_the_cycle_rule() -> None:
    assert worker_cycle([16, 2], 28) == 16  # the least common multiple, when the epoch holds it
    assert worker_cycle([15, 2], 28) == 15  # 30 does not fit: the most workers
    assert worker_cycle([15, 2], 30) == 30
    assert worker_cycle([16], 10) == 1  # not even one cycle: every step counts
    assert worker_cycle([1, 1, 0], 50) == 1 and worker_cycle([], 50) == 1  # one worker or none: no bursts


def _bursty_epoch(workers: int, build_s: float, gpu_s: float, steps: int) -> list[tuple[float, float]]:
    """(data wait, compute) of each step of a rank whose ``workers`` workers, started together, each take
    ``build_s`` a batch (round-robin, prefetch never full) while its GPU takes ``gpu_s`` a step."""
    out, now = [], 0.0
    for i in range(steps):
        ready = (i // workers + 1) * build_s  # batch i is its worker's (i // workers + 1)-th
        wait = max(0.0, ready - now)
        out.append((wait, gpu_s))
        now += wait + gpu_s
    return out


def test_a_loader_paced_epoch_is_timed_over_whole_worker_cycles() -> None:
    """The measured numbers above: 16 workers at 2.18 s a batch of 455, a 110 ms GPU step, 28 steps an epoch."""
    workers, build, gpu = 16, 2.18, 0.110
    clock = FakeClock()
    timer = StepTimer("cpu", clock=clock, warmup_steps=2)
    for wait, compute in _bursty_epoch(workers, build, gpu, 28):
        _host_step(timer, clock, wait=wait, compute=compute, tail=0.0)
    blind = timer.epoch_summary(rank=0, epoch=0, batch_size=455, num_workers=workers)
    s = timer.epoch_summary(rank=0, epoch=0, batch_size=455, num_workers=workers, job_workers=[workers, 2])
    pace = build / workers
    assert blind.step_time_s < 0.95 * pace  # 26 steps hold one and a half bursts: the mean reads fast
    assert s.step_time_s == pytest.approx(pace, rel=1e-9)  # the last 16 steps: one whole cycle
    assert s.num_steps == blind.num_steps == 26 and s.compute_s == blind.compute_s  # only the pace moved
    assert s.data_wait_s == pytest.approx(pace - gpu, rel=1e-9)


def test_whole_cycles_change_nothing_for_a_steady_step() -> None:
    clock = FakeClock()
    timer = StepTimer("cpu", clock=clock, warmup_steps=2)
    for _ in range(30):
        _host_step(timer, clock, wait=0.001, compute=0.1, tail=0.01)
    a = timer.epoch_summary(rank=0, epoch=0, batch_size=64, num_workers=8)
    b = timer.epoch_summary(rank=0, epoch=0, batch_size=64, num_workers=8, job_workers=[8, 8])
    assert b.step_time_s == pytest.approx(a.step_time_s) and b.data_wait_s == pytest.approx(a.data_wait_s)


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_a_real_dataloader_delivers_in_bursts_and_whole_cycles_read_its_pace() -> None:
    """4 sleeping workers at 0.2 s a batch (a batch every 50 ms), started together (a barrier: as at an epoch's
    start, and no fork stagger on a loaded host), a loop that takes them at once, 12 steps an epoch: the mean gap
    after the first batch reads ~27% fast, the last two whole cycles read the pace.  What the clock reads is the
    workers' sleeps, not this host's speed: 50 ms a gap against a tolerance of 5 ms a gap."""
    workers, cost, steps = 4, 0.2, 12
    barrier = multiprocessing.get_context("fork").Barrier(workers)
    loader = DataLoader(_SlowBatches(steps, cost), batch_size=None, num_workers=workers, prefetch_factor=4,
                        worker_init_fn=lambda _: barrier.wait(timeout=60),
                        multiprocessing_context=multiprocessing.get_context("fork"))
    gaps, t = [], None
    for _ in loader:
        now = time.perf_counter()
        if t is not None:
            gaps.append(now - t)
        t = now
    pace = cost / workers
    cycle = worker_cycle([workers], len(gaps))
    whole = gaps[len(gaps) - (len(gaps) // cycle) * cycle:]
    assert cycle == workers and len(whole) == 8
    assert statistics.mean(gaps) < 0.85 * pace  # 0.4 s over 11 gaps
    assert math.isclose(statistics.mean(whole), pace, rel_tol=0.1)


def test_a_bench_window_is_whole_cycles_of_the_ranks_near_their_loaders_pace() -> None:
    """Loader-skew splits measured on 2x H100: the plan [455, 57] (16 and 2 workers, both loaders near the
    step) runs 32 steps for 20; the equal split (only the 2-worker rank near its loader) keeps 20."""

    def plan(step: float, ranks: list[tuple[int, float]]) -> NS:
        return NS(predicted=NS(step_time_s=step), ranks=[NS(num_workers=w, predicted_loader_s=lo) for w, lo in ranks])

    assert window_steps(plan(0.142, [(16, 0.1395), (2, 0.1398)]), 20) == 32
    assert window_steps(plan(0.630, [(15, 0.084), (2, 0.628)]), 20) == 20
    assert window_steps(plan(0.100, [(8, 0.01), (8, 0.02)]), 20) == 20  # no loader near the step
    assert window_steps(plan(0.100, [(15, 0.09), (16, 0.09)]), 20) == 32  # lcm 240 > 80: the most workers


def test_an_adapters_planned_run_times_its_epochs_over_whole_cycles_of_the_loader_it_built(tmp_path: Path) -> None:
    """runtime.adapters.run.PlannedRun: the Lightning, Accelerate and HF adapters record the workers of the loader
    they build (``loader_workers``); once every rank's is known, the run log's epoch step is over whole cycles."""
    import json as _json

    import planner
    from runtime.adapters.run import PlannedRun
    from tests.planner._profiles import linear_profile

    plan = planner.evaluate(linear_profile([1e-3]), [455], num_workers=[16])

    def epoch_step(loader_workers: int | None) -> float:
        log = tmp_path / f"run{loader_workers}.jsonl"
        run = PlannedRun(plan, log_file=log)
        run.sampler_for(455 * 40, "cpu")
        clock = FakeClock()
        run.timer = StepTimer("cpu", clock=clock, warmup_steps=2)
        run.loader_workers = loader_workers
        for wait, compute in _bursty_epoch(16, 2.18, 0.110, 28):
            _host_step(run.timer, clock, wait=wait, compute=compute, tail=0.0)
        run.epoch_end(0, last=True)
        run.finish(1)
        rec = next(_json.loads(x) for x in log.read_text().splitlines() if '"epoch"' in x and '"ranks"' in x)
        return float(rec["ranks"][0]["step_time_s"])

    assert epoch_step(16) == pytest.approx(2.18 / 16, rel=1e-9)
    assert epoch_step(None) < 0.95 * 2.18 / 16  # the user's own loader: workers unknown, every step counts



def _filling_epoch(steps: int, fill: int, drain: int, first_wait: float, gpu_s: float, fill_slow_s: float,
                   stall_at: int, stall_s: float, steady_slow_s: float) -> list[tuple[float, float]]:
    """A recorded epoch's shape (2x H100, 28 workers, `--step-log`): step 0 waits for the first batch, the fill's
    steps run ``fill_slow_s`` slower with one cycle-boundary data stall, the middle ``steady_slow_s`` slower
    than the GPU (the workers building as fast as the GPU consumes), and the drain's at the GPU's pace."""
    out = []
    for i in range(steps):
        wait = first_wait if i == 0 else (stall_s if i == stall_at else 0.0)
        extra = fill_slow_s if i < fill else (0.0 if i >= steps - drain else steady_slow_s)
        out.append((wait, gpu_s + extra))
    return out


KW = {"rank": 0, "epoch": 2, "batch_size": 471, "num_workers": 28, "job_workers": [28, 2]}


def _timed(epoch: list[tuple[float, float]], timed: tuple[StepTimer, FakeClock] | None = None) -> StepTimer:
    """A step timer (2 warm-up steps) that timed ``epoch``'s (data wait, compute) steps; ``timed``: a timer and
    its clock to time them on instead (after a ``reset``, the next epoch)."""
    clock = FakeClock() if timed is None else timed[1]
    timer = StepTimer("cpu", clock=clock, warmup_steps=2) if timed is None else timed[0]
    for wait, compute in epoch:
        _host_step(timer, clock, wait=wait, compute=compute, tail=0.0)
    return timer


def test_the_steady_pace_is_timed_between_the_loaders_fill_and_drain() -> None:
    """A 400-step epoch: fill 140 steps (28 x (4 + 1)), drain 112 (28 x 4), whole cycles of 28 between them."""
    gpu, slow = 0.116, 0.020
    timer = _timed(_filling_epoch(400, 140, 112, 4.9, gpu, 0.050, 28, 0.66, slow))
    s = timer.epoch_summary(**KW, fill_steps=140, drain_steps=112)  # type: ignore[arg-type]
    assert s.step_time_s == pytest.approx(gpu + slow, rel=1e-9) and s.data_wait_s == 0.0  # neither fill nor drain
    assert s.fill_steps == 400 - 112 - 5 * 28  # the window: the last 5 whole cycles before the drain
    assert s.fill_excess_s == pytest.approx(4.9 + 0.66 + 140 * (0.050 - slow), rel=1e-9)
    blind = timer.epoch_summary(**KW)  # type: ignore[arg-type]
    assert blind.fill_steps == 0 and blind.fill_excess_s == 0.0 and blind.step_time_s != s.step_time_s


def test_an_epoch_without_a_steady_middle_keeps_the_whole_cycle_means() -> None:
    """200 steps, 28 workers: the fill (140) and drain (112) overlap -- as in recorded 200-step epochs, whose last 56
    steps ran at the GPU's pace on batches built before (the drain), not at a pace the loaders sustain."""
    timer = _timed(_filling_epoch(200, 140, 56, 4.9, 0.116, 0.050, 28, 0.66, 0.0))
    with_fill = timer.epoch_summary(**KW, fill_steps=140, drain_steps=112)  # type: ignore[arg-type]
    assert dataclasses.replace(with_fill, drain_steps=0) == timer.epoch_summary(**KW)  # type: ignore[arg-type]
    assert with_fill.fill_steps == 0 and with_fill.step_time_s > 0.116 + 0.030  # the fill's cost stays in
    assert with_fill.drain_steps == 112  # recorded: the means cover it


def test_a_streamed_epoch_leaves_out_the_runs_drain_and_says_when_it_is_all_drain() -> None:
    """A loader that runs across epochs (planner.cli.steps.StreamedEpochs) has no fill after its first epoch, and its
    drain is the run's last 112 steps: in a 320-step last epoch they are cut; a 50-step epoch inside them is
    wholly drain, its means the GPU's pace, and the stats say so."""
    gpu, slow = 0.116, 0.020
    clock = FakeClock()
    timer = _timed(_filling_epoch(320, 0, 112, 0.0, gpu, 0.0, 28, 0.0, slow),
                   (StepTimer("cpu", clock=clock, warmup_steps=2), clock))
    s = timer.epoch_summary(**KW, fill_steps=0, drain_steps=112)  # type: ignore[arg-type]
    assert s.step_time_s == pytest.approx(gpu + slow, rel=1e-9) and s.drain_steps == 112 and s.fill_steps == 0
    timer.reset()
    _timed(_filling_epoch(50, 0, 50, 0.0, gpu, 0.0, 28, 0.0, slow), (timer, clock))
    drained = timer.epoch_summary(**KW, fill_steps=0, drain_steps=112)  # type: ignore[arg-type]
    assert drained.step_time_s == pytest.approx(gpu, rel=1e-9) and drained.drain_steps >= drained.num_steps
