"""StepTimer: fake clock and fake device events for the arithmetic, one real CPU loop for sanity."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.timing import StepTimer


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def _host_step(timer: StepTimer, clock: FakeClock, *, wait: float, compute: float, tail: float) -> None:
    timer.data_start()
    clock.advance(wait)
    timer.data_end()
    timer.compute_start()
    clock.advance(compute)
    assert not timer.compute_recorded
    timer.compute_end()  # the hook's on_last_bucket
    assert timer.compute_recorded
    clock.advance(tail)  # all-reduce wait + optimizer: in the step time, not in compute
    timer.compute_end()  # the after-backward fallback is ignored once the hook fired
    timer.step_end()


def test_host_clock_means_skip_warmup() -> None:
    clock = FakeClock()
    timer = StepTimer("cpu", clock=clock, warmup_steps=2)
    # Two slow warm-up steps, then 6 steps alternating compute 0.1 / 0.3.
    _host_step(timer, clock, wait=1.0, compute=5.0, tail=0.0)
    _host_step(timer, clock, wait=1.0, compute=5.0, tail=0.0)
    for i in range(6):
        _host_step(timer, clock, wait=0.02, compute=0.1 if i % 2 == 0 else 0.3, tail=0.05)
    s = timer.epoch_summary(rank=1, epoch=3, batch_size=64, num_workers=2)
    assert (s.rank, s.epoch, s.batch_size, s.num_workers, s.num_steps) == (1, 3, 64, 2, 6)
    assert s.data_wait_s == pytest.approx(0.02)
    assert s.compute_s == pytest.approx(0.2)
    assert s.step_time_s == pytest.approx(0.02 + 0.2 + 0.05)
    assert s.compute_s_std == pytest.approx(math.sqrt(6 * 0.1**2 / 5))  # sample std
    assert timer.num_dropped == 0


def test_few_steps_keep_warmup_and_reset_forgets() -> None:
    clock = FakeClock()
    timer = StepTimer("cpu", clock=clock, warmup_steps=2)
    for _ in range(3):  # 3 <= 2 * warmup: nothing skipped
        _host_step(timer, clock, wait=0.0, compute=0.5, tail=0.0)
    s = timer.epoch_summary(rank=0, epoch=0, batch_size=8, num_workers=0)
    assert s.num_steps == 3 and s.compute_s == pytest.approx(0.5) and s.compute_s_std == 0.0
    timer.reset()
    clock.advance(1000.0)  # time between epochs (re-plan, loader restart) is not a step
    _host_step(timer, clock, wait=0.0, compute=0.25, tail=0.0)
    s = timer.epoch_summary(rank=0, epoch=1, batch_size=8, num_workers=0)
    assert s.num_steps == 1 and s.step_time_s == pytest.approx(0.25)


def test_non_finite_and_unclosed_steps_are_dropped_and_counted() -> None:
    clock = FakeClock()
    timer = StepTimer("cpu", clock=clock, warmup_steps=0)
    _host_step(timer, clock, wait=0.0, compute=0.2, tail=0.0)
    # A clock glitch: NaN data wait.
    timer.data_start()
    clock.t = math.nan
    timer.data_end()
    clock.t = 200.0
    timer.compute_start()
    timer.compute_end()
    timer.step_end()
    # A step whose compute span was never closed.
    timer.compute_start()
    clock.advance(0.1)
    timer.step_end()
    _host_step(timer, clock, wait=0.0, compute=0.4, tail=0.0)
    s = timer.epoch_summary(rank=0, epoch=0, batch_size=4, num_workers=0)
    assert timer.num_dropped == 2
    assert s.num_steps == 2 and s.compute_s == pytest.approx(0.3)
    assert all(math.isfinite(v) for v in (s.data_wait_s, s.compute_s, s.step_time_s, s.compute_s_std))


def test_no_valid_step_gives_zero_steps_not_nan() -> None:
    timer = StepTimer("cpu", clock=FakeClock())
    s = timer.epoch_summary(rank=0, epoch=0, batch_size=4, num_workers=0)
    assert s.num_steps == 0 and s.compute_s == 0.0 and s.step_time_s == 0.0


class FakeEvents:
    """Device events on a fake device timeline: an event completes once `device_t` passes its timestamp."""

    def __init__(self) -> None:
        self.device_t = 0.0
        self.next_stamp = 0.0
        self.sync_calls = 0
        self.elapsed_reads: list[tuple[float, float]] = []

    def factory(self) -> FakeEvent:
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, dev: FakeEvents) -> None:
        self.dev = dev
        self.stamp: float | None = None

    def record(self) -> None:
        self.stamp = self.dev.next_stamp

    def query(self) -> bool:
        assert self.stamp is not None
        return self.dev.device_t >= self.stamp

    def synchronize(self) -> None:
        self.dev.sync_calls += 1
        assert self.stamp is not None
        self.dev.device_t = max(self.dev.device_t, self.stamp)

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.stamp is not None and end.stamp is not None
        # A real CUDA event raises here if not complete; the timer must only read completed ones.
        assert self.query() and end.query(), "elapsed_time read before the device reached the events"
        self.dev.elapsed_reads.append((self.stamp, end.stamp))
        return (end.stamp - self.stamp) * 1000.0  # ms


def _compute_reads(dev: FakeEvents, computes: list[float]) -> int:
    """Compute spans read so far (each step after the first also reads its lead: ``lead_s``)."""
    return sum(1 for a, b in dev.elapsed_reads if any(math.isclose(b - a, c) for c in computes))


def test_device_events_read_a_step_later_never_blocking() -> None:
    dev = FakeEvents()
    clock = FakeClock()
    timer = StepTimer("cpu", clock=clock, warmup_steps=0, event_factory=dev.factory)
    assert timer.uses_device_events
    computes = [0.010, 0.030, 0.020, 0.040]
    for i, c in enumerate(computes):
        timer.compute_start()  # start event at device time next_stamp
        dev.next_stamp += c
        timer.compute_end()  # end event
        dev.next_stamp += 0.005  # optimizer, not compute
        # The host runs ahead: the device has finished only the previous step when this step ends.
        dev.device_t = dev.next_stamp - (c + 0.005) if i else 0.0
        timer.step_end()
        # Only steps before this one can have been read, and without synchronize.
        assert _compute_reads(dev, computes) <= i
    assert dev.sync_calls == 0
    assert _compute_reads(dev, computes) == 3  # steps 0..2 read one step later
    s = timer.epoch_summary(rank=0, epoch=0, batch_size=16, num_workers=1)
    assert dev.sync_calls == 2  # only the last step (its two events) is waited for, at the epoch boundary
    assert s.num_steps == 4
    assert s.compute_s == pytest.approx(sum(computes) / 4)


def test_device_events_stay_pending_while_device_lags() -> None:
    dev = FakeEvents()
    timer = StepTimer("cpu", clock=FakeClock(), warmup_steps=0, event_factory=dev.factory)
    for _ in range(5):  # the device never catches up during the epoch
        timer.compute_start()
        dev.next_stamp += 0.01
        timer.compute_end()
        timer.step_end()
    assert dev.elapsed_reads == []
    s = timer.epoch_summary(rank=0, epoch=0, batch_size=16, num_workers=1)
    assert s.num_steps == 5 and s.compute_s == pytest.approx(0.01)


def test_real_cpu_loop_summary_is_sane() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ds = torch.utils.data.TensorDataset(torch.randn(160, 32), torch.randn(160, 1))
    loader = torch.utils.data.DataLoader(ds, batch_size=16)
    timer = StepTimer(torch.device("cpu"))
    assert not timer.uses_device_events
    for x, y in timer.iter_data(loader):
        timer.compute_start()
        torch.nn.functional.mse_loss(model(x), y).backward()
        timer.compute_end()  # no DDP hook: close after backward
        opt.step()
        opt.zero_grad()
        timer.step_end()
    assert timer.num_steps == 10
    s = timer.epoch_summary(rank=0, epoch=0, batch_size=16, num_workers=0)
    assert s.num_steps == 8  # 2 warm-up steps skipped
    assert timer.num_dropped == 0
    assert 0.0 < s.compute_s <= s.step_time_s
    assert 0.0 <= s.data_wait_s <= s.step_time_s
    assert s.data_wait_s + s.compute_s <= s.step_time_s * (1 + 1e-9)
    assert s.compute_s_std >= 0.0


def test_device_lead_is_the_idle_time_between_a_steps_end_and_the_next_forward() -> None:
    """``lead_s``: from the previous step's end on the device (after its optimizer) to this step's forward start --
    what tells ranks that started a step out of step apart (on 2x H100, rank 0's compute tails came only with both a
    DataLoader and a DDP peer)."""
    dev = FakeEvents()
    timer = StepTimer("cpu", clock=FakeClock(), warmup_steps=0, event_factory=dev.factory)
    idles = [0.0, 0.012, 0.003, 0.030]  # the device waiting for each step's batch
    for idle in idles:
        dev.next_stamp += idle
        timer.compute_start()
        dev.next_stamp += 0.050
        timer.compute_end()
        dev.next_stamp += 0.005  # all-reduce and optimizer
        dev.device_t = dev.next_stamp
        timer.step_end()
    series = timer.series()
    assert series["lead_s"][0] is None  # the epoch's first step has no previous end
    assert series["lead_s"][1:] == pytest.approx(idles[1:])
    assert series["compute_s"] == pytest.approx([0.050] * 4)
    assert dev.sync_calls == 2  # the last step's start and end, as without leads: its previous end was complete
    timer.reset()  # a new epoch starts without a previous end
    timer.compute_start()
    dev.next_stamp += 0.05
    timer.compute_end()
    timer.step_end()
    assert timer.series()["lead_s"] == [None]


def test_host_lead_is_the_data_wait_and_loop_before_compute() -> None:
    clock = FakeClock()
    timer = StepTimer("cpu", clock=clock, warmup_steps=0)
    for wait in (0.5, 0.02, 0.07):
        _host_step(timer, clock, wait=wait, compute=0.1, tail=0.01)
    assert timer.series()["lead_s"] == [None, pytest.approx(0.02), pytest.approx(0.07)]


def test_host_compute_is_the_hosts_own_span_beside_the_devices() -> None:
    """``host_compute_s``: the host clock from compute_start to compute_end.  A device span as long as its host span
    was closed late by the host (the last bucket's hook), not by the device's kernels."""
    dev, clock = FakeEvents(), FakeClock()
    timer = StepTimer("cpu", clock=clock, warmup_steps=0, event_factory=dev.factory)
    for host, device in ((0.030, 0.096), (0.140, 0.140)):  # the host ahead; then the host late to the last hook
        timer.compute_start()
        clock.advance(host)
        dev.next_stamp += device
        timer.compute_end()
        clock.advance(0.01)
        timer.compute_end()  # the after-backward fallback changes nothing once the hook closed the span
        dev.next_stamp += 0.005
        dev.device_t = dev.next_stamp
        timer.step_end()
    series = timer.series()
    assert series["host_compute_s"] == pytest.approx([0.030, 0.140])
    assert series["compute_s"] == pytest.approx([0.096, 0.140])
    clock2 = FakeClock()
    host = StepTimer("cpu", clock=clock2, warmup_steps=0)
    _host_step(host, clock2, wait=0.0, compute=0.25, tail=0.01)
    assert host.series()["host_compute_s"] == host.series()["compute_s"] == [pytest.approx(0.25)]
