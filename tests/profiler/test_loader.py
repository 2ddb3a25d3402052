"""Loader profiling: a low quantile of the timed chunks, and one answer per host and dataset."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch

from planner.profile import LoaderPoint, LoaderProfile
from profiler.loader import (
    LoaderOptions,
    host_consensus,
    loader_to_json,
    low_quartile,
    measure_sample_cost,
    measure_scaling,
)
from tests._dist import run_distributed


class _FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Stalled:
    """Samples costing 1 ms each on ``clock``, every fourth run of 8 stalled 10x (another process took the core)."""

    def __init__(self, n: int, clock: _FakeClock) -> None:
        self.n, self.clock = n, clock
        self.calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.calls += 1
        self.clock.now += 0.01 if (self.calls // 8) % 4 == 3 else 0.001
        return i


class _WorkerClock:
    """``time`` for profiler.loader: in a DataLoader worker (a fork of this process) ``perf_counter`` is the sum of
    the seconds its samples declared (``_Sleepy``: 5 ms each), so the workers' build times are exact however
    loaded the host is; this process keeps the real clock (the scan's length, the GIL hog's stalls)."""

    def __init__(self) -> None:
        self.parent = os.getpid()
        self.worker_s = 0.0

    def perf_counter(self) -> float:
        return time.perf_counter() if os.getpid() == self.parent else self.worker_s

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


class _Sleepy:
    """Samples costing 5 ms of a worker's time each, no CPU (declared on ``clock``, slept for real as well):
    w workers make w x 200 samples/s."""

    def __init__(self, clock: _WorkerClock) -> None:
        self.clock = clock

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i: int) -> int:
        time.sleep(0.005)
        self.clock.worker_s += 0.005
        return i


@pytest.mark.slow
def test_scaling_is_timed_in_the_workers_and_survives_a_stalled_main_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # The profile measures the loader in a thread beside the compute sweep; a sweep step that holds the GIL (cuDNN
    # autotune, the memory search) stalled the drawing of batches and once "measured" 4 workers at 15 samples/s
    # beside 564 for 2.  Here a thread holds the GIL in long C calls throughout the scaling run.  The workers'
    # clock counts the 5 ms each sample declares, so the rates are exact; timed by this process's drawing (real
    # clock, GIL hog) they would not be.
    import profiler.loader as pl

    clock = _WorkerClock()
    monkeypatch.setattr(pl, "time", clock)
    stop = threading.Event()

    def hog() -> None:
        while not stop.is_set():
            sum(range(5_000_000))  # one C call: the GIL is held for its whole duration (~0.05-0.2 s)

    t = threading.Thread(target=hog, daemon=True)
    t.start()
    try:
        pts = measure_scaling(_Sleepy(clock), [1, 2], batch_size=4, seconds=0.3, collate_fn=lambda xs: xs)
    finally:
        stop.set()
        t.join()
    rates = {p.num_workers: p.samples_per_s for p in pts}
    assert set(rates) == {1, 2}
    assert rates[1] == pytest.approx(200.0) and rates[2] == pytest.approx(400.0)  # 1 / 5 ms per worker


def test_low_quartile() -> None:
    assert low_quartile([3.0]) == 3.0 and low_quartile([5.0, 2.0]) == 2.0
    assert low_quartile([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(2.0)


def test_a_stalled_chunk_does_not_raise_the_cost() -> None:
    clock = _FakeClock()
    cost = measure_sample_cost(_Stalled(64, clock), LoaderOptions(num_samples=64, chunk=8, budget_s=5.0),
                               clock=clock, collate_fn=lambda xs: xs)
    # Unstalled samples take 1 ms; the stalled quarter would lift a mean to ~3 ms.
    assert cost.sec_per_sample == pytest.approx(0.001)
    assert cost.spread > 3  # the stall is recorded, not hidden


def _loader(spp: float, rates: dict[int, float], cap: int | None = None) -> LoaderProfile:
    return LoaderProfile(sec_per_sample=spp, max_workers=cap,
                         scaling=tuple(LoaderPoint(num_workers=w, samples_per_s=r) for w, r in rates.items()))


def test_ranks_of_a_host_agree_on_the_best_reading() -> None:
    # Four identical ranks, one disturbed while it measured (5.6 ms vs 3.6-3.7 ms, as seen on a real host).
    readings = [_loader(0.0037, {1: 270, 8: 2100}), _loader(0.0056, {1: 180, 8: 1400}),
                _loader(0.0036, {1: 275, 8: 2000}), _loader(0.0037, {1: 268, 8: 2150})]
    peers = [loader_to_json(lp) for lp in readings]
    out = [host_consensus(lp, peers) for lp in readings]
    assert len({o[0] for o in out}) == 1  # every rank the same profile
    shared, meta = out[1]
    assert shared.sec_per_sample == 0.0036
    assert [(p.num_workers, p.samples_per_s) for p in shared.scaling] == [(1, 275), (8, 2150)]
    assert meta["loader_own_sec_per_sample"] == 0.0056 and meta["loader_host_ranks"] == 4
    assert meta["loader_host_spread"] == pytest.approx(0.0056 / 0.0036 - 1, abs=1e-4)


def test_a_capped_rank_gets_the_host_curve_and_keeps_its_cap() -> None:
    capped, full = _loader(0.0031, {1: 290, 2: 600}, cap=2), _loader(0.0030, {1: 300, 2: 610, 8: 2300})
    shared, _ = host_consensus(capped, [loader_to_json(capped), loader_to_json(full)])
    assert shared.max_workers == 2 and [p.num_workers for p in shared.scaling] == [1, 2, 8]


def test_the_host_shares_the_fastest_hand_over_reading() -> None:
    """The pinning thread's rate, read at full worker load: the host's ranks keep the fastest (a slower one
    waited for the GIL beside the compute sweep), a rank without CUDA (no reading) takes its peers'."""
    from dataclasses import replace

    a = replace(_loader(0.003, {1: 300}), sample_bytes=602_112, handover_bytes_per_s=2.2e9)
    b = replace(_loader(0.003, {1: 300}), sample_bytes=602_112, handover_bytes_per_s=2.9e9)
    none = _loader(0.003, {1: 300})
    shared, _ = host_consensus(none, [loader_to_json(x) for x in (a, b, none)])
    assert shared.handover_bytes_per_s == 2.9e9 and shared.sample_bytes == 602_112
    alone, _ = host_consensus(none, [loader_to_json(none)])
    assert alone.handover_bytes_per_s is None and alone.sample_bytes is None


def test_the_hand_over_is_timed_only_where_batches_can_be_pinned() -> None:
    """On a host without CUDA nothing is pinned: the profile records no hand-over and the planner adds no floor."""
    import torch

    from profiler.loader import _tensors, profile_loader

    batch = {"x": torch.zeros(4, 3), "y": [torch.zeros(4), "label"]}
    assert sum(t.numel() for t in _tensors(batch)) == 16
    if torch.cuda.is_available():
        pytest.skip("a CUDA host pins")
    lp, meta = profile_loader(list(range(64)), LoaderOptions(num_samples=16, chunk=8, scaling_s=0.05, max_workers=1))
    assert lp.handover_bytes_per_s is None and lp.sample_bytes is None and "loader_handover_readings" not in meta


def _share_worker(rank: int, world_size: int) -> None:
    from profiler.run import share_on_host

    mine = _loader(0.004 + 0.002 * rank, {1: 250.0 - 50 * rank})
    shared, meta = share_on_host(mine, "fake")
    assert shared.sec_per_sample == 0.004 and shared.scaling[0].samples_per_s == 250.0
    assert meta["loader_host_ranks"] == 2
    own, none = share_on_host(mine, None)  # no dataset named: every rank keeps its own reading
    assert own == mine and none == {}


@pytest.mark.distributed
def test_share_on_host_over_gloo() -> None:
    run_distributed(_share_worker, 2, timeout_s=120.0)


def test_the_hand_over_reading_times_the_pin_it_is_given() -> None:
    """LoaderOptions.pin (the programs pass runtime.pinning.pin_tree): the reading times that copy of the batch."""
    from profiler.loader import _pin_rate

    seen: list[Any] = []
    batch = (torch.zeros(4, 3, 8, 8), torch.zeros(4, dtype=torch.long))
    rate = _pin_rate(batch, pin=seen.append)
    assert rate is not None and rate[1] == 4 * 3 * 8 * 8 * 4 + 4 * 8 and rate[0] > 0
    assert seen == [batch]
    assert _pin_rate((torch.zeros(0),), pin=seen.append) is None and len(seen) == 1  # no bytes: nothing timed


def test_the_hand_over_reading_pins_big_batches_while_the_last_scan_point_loads_the_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The reading pins fresh shared-memory batches of HANDOVER_BYTES (training-sized: the former 19 MB scan
    batches partly fit the CPU caches and read 1.3-1.5x fast) beside the last worker count, which runs on until
    it has its readings.  A stand-in for the pin (a copy): a CPU-only torch cannot pin."""
    import profiler.loader as pl

    monkeypatch.setattr(pl, "HANDOVER_BYTES", 20 << 20)
    monkeypatch.setattr(pl, "_shm_free", lambda: None)
    readings: list[tuple[float, int]] = []
    points = measure_scaling(_Slow(), [1, 2], batch_size=4, seconds=0.05, handover=readings,
                             pin=lambda x: x.clone())
    assert [p.num_workers for p in points] == [1, 2]
    assert len(readings) >= pl.HANDOVER_MIN_READINGS  # the last point ran on until the reading had them
    assert all(n == 20 << 20 and r > 0 for r, n in readings)


class _Slow:
    """A long dataset whose samples take a millisecond each: a scan that does not run out."""

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> int:
        time.sleep(0.001)
        return i


def test_no_hand_over_reading_where_shared_memory_is_small(monkeypatch: pytest.MonkeyPatch) -> None:
    import profiler.loader as pl

    monkeypatch.setattr(pl, "_shm_free", lambda: 100 << 20)  # a tenth is under 16 MiB: not worth a reading
    readers: list[pl._HandoverReader] = []

    class Reader(pl._HandoverReader):
        def __init__(self, *a: Any) -> None:
            super().__init__(*a)
            readers.append(self)

    monkeypatch.setattr(pl, "_HandoverReader", Reader)
    readings: list[tuple[float, int]] = []
    measure_scaling(list(range(64)), [1], batch_size=4, seconds=0.05, handover=readings, pin=lambda x: x)
    assert readings == [] and len(readers) == 1
    # and the scan not lengthened: no reading thread, so the last point may stop at once
    assert readers[0].thread is None and readers[0].done(0.0)
