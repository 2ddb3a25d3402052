"""Own compute vs time lost to a late peer: the per-step data waits of the peers decide which steps count."""

from __future__ import annotations

import pytest

from runtime.timing import StepTimer, peer_data_waits
from tests._dist import run_distributed
from tests.runtime.test_timing import FakeClock, _host_step

OWN_S = 0.135
STEPS = 48


def _starved_waits() -> list[float]:
    # A loader-bound peer: 8 workers deliver in bursts, so it waits ~0.6 s once every 8 steps (2x H100 run).
    return [0.6 if i % 8 == 5 else 0.0002 for i in range(STEPS)]


def _victim(clock: FakeClock, waits: list[float]) -> StepTimer:
    """The compute-bound rank: 135 ms of its own, stretched in the step a peer was late and the one after."""
    timer = StepTimer("cpu", clock=clock, warmup_steps=2)
    for i in range(STEPS):
        stretch = 0.43 * (waits[i] > 0.1) + 0.12 * (i > 0 and waits[i - 1] > 0.1)
        _host_step(timer, clock, wait=0.0002, compute=OWN_S + stretch, tail=0.003)
    return timer


def test_steps_a_peer_reached_late_are_not_own_compute() -> None:
    waits = _starved_waits()
    timer = _victim(FakeClock(), waits)
    blind = timer.epoch_summary(rank=1, epoch=0, batch_size=171, num_workers=8)
    # A quarter of the steps stretched: too many to be outliers, so without the peers' waits they all count.
    assert blind.compute_s > 1.3 * OWN_S and blind.num_peer_late == 0 and blind.interference_s == 0.0
    s = timer.epoch_summary(rank=1, epoch=0, batch_size=171, num_workers=8,
                            peer_data_waits_s=[waits, timer.step_data_waits_s()])
    assert s.compute_s == pytest.approx(OWN_S) and s.compute_s_std == pytest.approx(0.0, abs=1e-9)
    assert s.num_peer_late == 12 and s.num_steps == STEPS - 2
    # The time lost to the peer is reported beside the rank's own, not hidden.
    assert s.interference_s == pytest.approx(blind.compute_s - OWN_S)


def test_the_late_rank_itself_keeps_its_steps() -> None:
    # The starving rank's own compute is not interfered with by its own data wait (no peer was later than it).
    clock, waits = FakeClock(), _starved_waits()
    timer = StepTimer("cpu", clock=clock, warmup_steps=2)
    for w in waits:
        _host_step(timer, clock, wait=w, compute=0.09, tail=0.04)
    s = timer.epoch_summary(rank=0, epoch=0, batch_size=341, num_workers=8,
                            peer_data_waits_s=[timer.step_data_waits_s(), [0.0002] * STEPS])
    assert s.num_peer_late == 0 and s.compute_s == pytest.approx(0.09)


def test_a_peer_late_in_most_steps_leaves_every_step_counted() -> None:
    clock = FakeClock()
    waits = [0.6 if i % 2 else 0.0 for i in range(STEPS)]  # late every other step: steps i and i+1 cover all
    timer = _victim(clock, waits)
    s = timer.epoch_summary(rank=1, epoch=0, batch_size=171, num_workers=8, peer_data_waits_s=[waits])
    assert s.num_peer_late == 0 and s.compute_s > OWN_S


def test_small_peer_waits_are_not_lateness() -> None:
    waits = [0.005] * STEPS  # 5 ms: under 10% of a 135 ms step
    timer = _victim(FakeClock(), [0.0] * STEPS)
    s = timer.epoch_summary(rank=1, epoch=0, batch_size=171, num_workers=8, peer_data_waits_s=[waits])
    assert s.num_peer_late == 0 and s.compute_s == pytest.approx(OWN_S)


def _exchange_worker(rank: int, world_size: int) -> None:
    clock = FakeClock()
    timer = StepTimer("cpu", clock=clock, warmup_steps=0)
    for i in range(4):
        _host_step(timer, clock, wait=0.01 * (rank + 1) * i, compute=0.1, tail=0.0)
    got = peer_data_waits(timer)
    assert got == [[round(0.01 * (r + 1) * i, 4) for i in range(4)] for r in range(world_size)]


@pytest.mark.distributed
def test_peer_data_waits_over_gloo() -> None:
    run_distributed(_exchange_worker, 2, timeout_s=120.0)
    assert peer_data_waits(StepTimer("cpu")) == [[]]  # no process group: this rank's own only


LATE_S = 0.25


def _late_peer_steps(rank: int, world_size: int, hooked: bool) -> None:
    """Rank 1 starts every step LATE_S after rank 0.  Under DDP rank 0 then waits in the forward's buffer broadcast
    (BatchNorm's running stats): inside its compute span when the span opens before ``ddp(x)``, in its lead when
    ``ComputeStart`` opens it where the module's forward begins."""
    import statistics
    import time

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from runtime.timing import ComputeStart

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))
    ddp = DDP(model)
    timer = StepTimer("cpu")
    opener = ComputeStart(ddp, timer)
    assert opener.hooked
    start = opener if hooked else timer.compute_start
    x = torch.randn(32, 8)
    for _ in range(6):
        if rank == 1:
            time.sleep(LATE_S)
        start()
        ddp(x).sum().backward()
        timer.compute_end()
        timer.step_end()
    series = timer.series()
    compute = statistics.median(c for c in series["compute_s"][1:] if c is not None)
    lead = statistics.median(v for v in series["lead_s"][1:] if v is not None)
    if rank == 0 and hooked:
        assert compute < 0.5 * LATE_S < lead, (compute, lead)  # the wait is the step's lead, not its compute
    elif rank == 0:
        assert compute > 0.8 * LATE_S, (compute, lead)  # the negative control: the wait read as compute
    else:
        assert compute < 0.5 * LATE_S < lead, (compute, lead)  # the late rank's own sleep is its lead


@pytest.mark.distributed
@pytest.mark.parametrize("hooked", [True, False])
def test_a_wait_in_ddps_buffer_broadcast_is_lead_not_compute(hooked: bool) -> None:
    run_distributed(_late_peer_steps, 2, hooked)


def test_compute_start_without_ddp_opens_the_span_at_once() -> None:
    import torch

    from runtime.timing import ComputeStart

    timer = StepTimer("cpu")
    opener = ComputeStart(torch.nn.Linear(2, 2), timer)
    assert not opener.hooked
    opener()
    timer.compute_end()
    timer.step_end()
    assert timer.series()["compute_s"][0] is not None
