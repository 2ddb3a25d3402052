"""Emulated slowdown: parsing, no side effects on gradients or BatchNorm state, and the f x timing."""

from __future__ import annotations

import functools
import statistics
import time

import pytest
import torch
from torch import nn

from planner.errors import ValidationError
from profiler.compute import StepRunner
from profiler.workloads.emulate import Slowdown, SlowdownPlan, parse_rank_floats, parse_rank_ints
from profiler.workloads.specs import build_workload, synthetic_batch
from tests._dist import run_distributed


def test_parse_rank_floats_and_ints() -> None:
    assert parse_rank_floats("1=3,2=1.5") == {1: 3.0, 2: 1.5}
    assert parse_rank_floats(" 0 = 2 , ") == {0: 2.0}
    assert parse_rank_floats(None) == {} and parse_rank_floats("") == {}
    assert parse_rank_ints("1=2,3=0") == {1: 2, 3: 0}
    for bad in ("1:3", "x=3", "1=", "1=fast", "1=3,1=2"):
        with pytest.raises(ValidationError, match="--emulate-slowdown"):
            parse_rank_floats(bad)
    with pytest.raises(ValidationError, match=">= 1"):
        parse_rank_floats("1=0.5")
    with pytest.raises(ValidationError, match="integer >= 0"):
        parse_rank_ints("1=1.5")
    with pytest.raises(ValidationError, match="RANK=WORKERS"):
        parse_rank_ints("2", flag="--emulate-loader")


def test_plan_splits_factor_into_full_passes_and_a_slice() -> None:
    assert Slowdown(3.0, "block").plan(64) == SlowdownPlan(full_passes=2, slice_samples=0)
    p = Slowdown(2.25, "block").plan(64)
    assert (p.full_passes, p.slice_samples, p.at_backward) == (1, 16, ())
    # Interleave: the same passes, placed by the midpoint rule against a uniformly slower card.
    il = functools.partial(Slowdown, mode="interleave")
    assert il(3.0).plan(64) == SlowdownPlan(full_passes=2, slice_samples=0, at_backward=(0.0, 0.625))
    assert il(4.0).plan(10).at_backward == pytest.approx((0.0, 0.25, 0.75))
    assert il(2.5).plan(64) == SlowdownPlan(full_passes=1, slice_samples=32, at_backward=(0.0, 0.75))
    assert il(1.5).plan(4).at_backward == pytest.approx((0.25,))
    assert not Slowdown(1.0).enabled
    with pytest.raises(ValidationError):
        Slowdown(0.9)
    with pytest.raises(ValidationError, match="interleave, block"):
        Slowdown(2.0, "sleep")


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 4))


def test_apply_leaves_grads_and_batchnorm_state_untouched() -> None:
    net = _net()
    x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 4, (6,))
    bn = net[1]
    assert isinstance(bn, nn.BatchNorm2d)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    Slowdown(2.5).apply(net, nn.functional.cross_entropy, x, y)
    assert all(p.grad is None for p in net.parameters())
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert bn.momentum == 0.1  # restored
    # With .grad already populated by the real step, apply adds nothing to it.
    nn.functional.cross_entropy(net(x), y).backward()
    grads = [p.grad.clone() for p in net.parameters() if p.grad is not None]
    Slowdown(3.0).apply(net, nn.functional.cross_entropy, x, y)
    assert all(p.grad is not None and torch.equal(a, p.grad) for a, p in zip(grads, net.parameters(), strict=True))


def test_apply_works_under_autocast_and_for_factor_one() -> None:
    net = nn.Sequential(nn.Flatten(), nn.Linear(12, 4))
    x, y = torch.randn(5, 12), torch.randint(0, 4, (5,))
    calls = []
    net.register_forward_hook(lambda m, i, o: calls.append(o.dtype))
    Slowdown(1.0).apply(net, nn.functional.cross_entropy, x, y)
    assert calls == []  # no-op
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        Slowdown(2.5, "block").apply(net, nn.functional.cross_entropy, x, y)
    assert calls == [torch.bfloat16, torch.bfloat16]  # one full pass + one slice pass, both in bf16
    assert all(p.grad is None for p in net.parameters())


def test_interleave_runs_its_backward_share_inside_the_real_backward() -> None:
    """apply runs the passes placed before the backward; the other passes run only when the real backward reaches the
    hooked parameters, in the caller's autocast dtype, and leave the real gradients and BatchNorm state exact."""
    net = _net()
    x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 4, (6,))
    start = {k: v.clone() for k, v in net.state_dict().items()}
    seen: list[tuple[bool, int, torch.dtype]] = []
    net.register_forward_hook(lambda m, i, o: seen.append((torch.is_grad_enabled(), int(o.shape[0]), o.dtype)))

    def step(factor: float) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        net.load_state_dict(start)
        net.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(net(x), y)
            Slowdown(factor, "interleave").apply(net, nn.functional.cross_entropy, x, y)
        seen.append((False, -1, torch.float32))  # marks "backward starts"
        loss.backward()
        return [p.grad.clone() for p in net.parameters()], {k: v.clone() for k, v in net.state_dict().items()}

    grads1, state1 = step(1.0)
    seen.clear()
    grads3, state3 = step(3.0)
    # F = 3: the real forward, one whole pass at once, the other inside the backward.
    bf = torch.bfloat16
    assert seen == [(True, 6, bf), (True, 6, bf), (False, -1, torch.float32), (True, 6, bf)]
    assert all(torch.equal(a, b) for a, b in zip(grads1, grads3, strict=True))
    assert all(torch.equal(state1[k], state3[k]) for k in state1)


def test_interleave_hooks_of_an_unfinished_step_do_not_fire_later() -> None:
    """An apply whose backward never ran (e.g. a skipped step) is disarmed by the next apply: one set of slices."""
    net = _net()
    x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 4, (6,))
    slices: list[int] = []
    net.register_forward_hook(lambda m, i, o: slices.append(int(o.shape[0])) if torch.is_grad_enabled() else None)
    Slowdown(3.0, "interleave").apply(net, nn.functional.cross_entropy, x, y)  # no backward follows
    Slowdown(3.0, "interleave").apply(net, nn.functional.cross_entropy, x, y)
    slices.clear()
    nn.functional.cross_entropy(net(x), y).backward()
    assert slices == [6, 6]  # the real forward, then the pass placed inside the backward (the other ran at apply)
    slices.clear()
    net.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()  # the hooks were one-shot
    assert slices == [6]


@pytest.mark.parametrize("mode", ["interleave", "block"])
@pytest.mark.parametrize("factor", [1.5, 2.5, 3.0])
def test_emulated_step_does_factor_times_the_work(factor: float, mode: str) -> None:
    """Counted, not timed: the FLOPs of one emulated training step are factor x the real step's, in both modes."""
    from torch.utils.flop_counter import FlopCounterMode

    w = build_workload("cifar_cnn", "fake", image_size=16, num_samples=16)
    flops = {}
    for f in (1.0, factor):
        runner = StepRunner(w, "cpu", slowdown=Slowdown(f, mode))
        x, y = synthetic_batch(w, 32, "cpu")
        with FlopCounterMode(display=False) as counter:
            runner.step(x, y)
        flops[f] = counter.get_total_flops()
    assert flops[factor] / flops[1.0] == pytest.approx(factor, rel=0.02)


def _pair_ratio(real: StepRunner, slow: StepRunner, b: int, pairs: int) -> float:
    """Median over `pairs` of slow_step / mean(real step before, real step after)."""
    ratios = []
    for _ in range(pairs):
        a = real.measure(b, 0, 1).times_s[0]
        s = slow.measure(b, 0, 1).times_s[0]
        a2 = real.measure(b, 0, 1).times_s[0]
        ratios.append(s / ((a + a2) / 2))
    return float(statistics.median(ratios))


@pytest.mark.alone
@pytest.mark.parametrize(("factor", "batches", "mode"),
                         [(3.0, (16, 32), "interleave"), (2.5, (32,), "interleave"), (3.0, (32,), "block")])
def test_profiled_curve_scales_by_factor(factor: float, batches: tuple[int, ...], mode: str) -> None:
    """The emulated rank's step time is factor x the real one within 10% at each batch, in both modes (the same
    passes; interleave mode runs some from gradient hooks inside the backward).

    Why this is a fair measurement on a shared 2-core CI box: one torch thread; a conv model whose compute
    dominates the step (the optimizer, which the slowdown does not repeat, is <2% of it); each emulated step
    sits between two real ones, so the pair sees the same load, and the median of 11 pair ratios is taken; the
    timer is the thread's CPU time (time.thread_time), which excludes time the OS gave to other processes --
    wall time here swings 10x under load.  CPU time still rises when other processes evict our caches: at load
    3-4 on 2 cores one median in 12 fell ~12% low (2.65x for 3), so a batch gets up to 3 attempts.  A wrong
    emulation (say 2x for 3) fails all three; a transient neighbour does not.  Observed: 2.93-3.12x for 3,
    2.51-2.54x for 2.5.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        w = build_workload("cifar_cnn", "fake", image_size=16, num_samples=16)
        real = StepRunner(w, "cpu", timer=time.thread_time)
        slow = StepRunner(w, "cpu", slowdown=Slowdown(factor, mode), timer=time.thread_time)
        for b in batches:
            real.measure(b, 1, 0)
            slow.measure(b, 1, 0)
            seen = []
            for _ in range(3):
                seen.append(_pair_ratio(real, slow, b, 11))
                if seen[-1] == pytest.approx(factor, rel=0.10):
                    break
            assert seen[-1] == pytest.approx(factor, rel=0.10), (b, seen)
    finally:
        torch.set_num_threads(threads)


def _ddp_worker(rank: int, world_size: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    ref = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    ref.load_state_dict(net.state_dict())
    ddp, ddp_ref = DDP(net), DDP(ref)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
    # Two steps per mode: the reducer must be ready for the next step after the extra passes; in interleave mode
    # they run inside DDP's own backward, from gradient hooks.
    for mode in ("block", "interleave", "block", "interleave"):
        for model, factor in ((ddp, 3.0 if rank == 1 else 1.0), (ddp_ref, 1.0)):
            model.zero_grad(set_to_none=True)
            Slowdown(factor, mode).apply(model, nn.functional.cross_entropy, x, y)  # DDP is unwrapped inside
            nn.functional.cross_entropy(model(x), y).backward()
        for a, b in zip(ddp.parameters(), ddp_ref.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad), (
                f"{mode}: extra passes leaked into DDP's gradient")


@pytest.mark.distributed
def test_slowdown_under_ddp_leaves_the_allreduced_gradient_unchanged() -> None:
    run_distributed(_ddp_worker, 2, timeout_s=60)


def test_stall_mode_places_the_extra_time_like_a_uniformly_slower_card() -> None:
    """Stall mode on a GPU: no passes; factor - 1 real passes' worth of sleeps, a third before the backward (the
    forward's share) and the rest in 8 equal sleeps at the backward's eighths' midpoints.  On a CPU it runs
    interleave's passes."""
    p = Slowdown(3.0, "stall").plan(64, "cuda")
    assert (p.full_passes, p.slice_samples) == (0, 0)
    assert p.at_backward == pytest.approx((0.0, *((k + 0.5) / 8 for k in range(8))))
    assert sum(p.stall_shares) == pytest.approx(2.0)
    assert p.stall_shares == pytest.approx((2.0 / 3, *[1.0 / 6] * 8))
    assert Slowdown(1.5, "stall").plan(64, "cuda").stall_shares[0] == pytest.approx(0.5 / 3)
    assert Slowdown(1.0, "stall").plan(64, "cuda") == SlowdownPlan(full_passes=0, slice_samples=0)
    assert Slowdown(3.0, "stall").plan(64, "cpu") == Slowdown(3.0, "interleave").plan(64)


def test_stall_mode_on_cpu_runs_interleaves_passes_and_leaves_the_step_exact() -> None:
    net = _net()
    x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 4, (6,))
    seen: list[int] = []
    net.register_forward_hook(lambda m, i, o: seen.append(int(o.shape[0])) if torch.is_grad_enabled() else None)
    start = {k: v.clone() for k, v in net.state_dict().items()}
    nn.functional.cross_entropy(net(x), y).backward()
    ref = [p.grad.clone() for p in net.parameters()]
    net.load_state_dict(start)
    net.zero_grad(set_to_none=True)
    seen.clear()
    loss = nn.functional.cross_entropy(net(x), y)
    Slowdown(3.0, "stall").apply(net, nn.functional.cross_entropy, x, y)
    loss.backward()
    assert seen == [6, 6, 6]  # the real forward, the pass at apply, the pass inside the backward
    assert all(torch.equal(a, p.grad) for a, p in zip(ref, net.parameters(), strict=True))


def test_stall_mode_sleeps_once_at_apply_and_then_inside_the_real_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU sleeps' placement, on a CPU box: ``torch.cuda._sleep`` is recorded instead of run and the clock and
    the pass's time are given (the GPU check is ``test_stall_mode_on_a_gpu_takes_factor_times_the_step``)."""
    import profiler.workloads.emulate as emulate

    calls: list[tuple[str, int]] = []
    phase = ["apply"]
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: calls.append((phase[0], cycles)))
    monkeypatch.setattr(emulate, "_cycles_per_ms", lambda device: 1000.0)
    net = _net()
    x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 4, (6,))
    slow = Slowdown(3.0, "stall")
    slow.calibrated[emulate.calibration_key(x)] = 30.0
    params = [p for p in net.parameters() if p.requires_grad]
    loss = nn.functional.cross_entropy(net(x), y)
    slow._stall(net, nn.functional.cross_entropy, x, y, params, slow.plan(6, "cuda"))
    assert calls == [("apply", 20_000)]  # 2/3 of a pass of 30 ms at 1000 cycles a ms
    phase[0] = "backward"
    loss.backward()
    later = [c for ph, c in calls if ph == "backward"]
    # 8 sleeps of 5 ms over 6 parameters: merged where two land on one parameter, the total kept.
    assert len(later) >= 4 and sum(later) == 8 * 5_000
    calls.clear()
    net.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()
    assert calls == []  # one-shot


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machines)")
@pytest.mark.parametrize("factor", [2.0, 3.0])
def test_stall_mode_on_a_gpu_adds_factor_minus_one_passes_of_gpu_time(factor: float) -> None:
    """Stall mode's contract: each step takes (factor - 1) x the real pass's GPU time longer, less at most the
    step's time outside the pass's kernels, which the sleeps can hide (the launches of the kernels behind a sleep,
    the optimizer) as a card whose kernels alone are slower would (ResNet-18 at 224 px, 64 and 128 samples).  So
    the whole step's ratio is below factor; the profile measures it.  Measured on 2x H100: a 9.0 ms pass and an 11.7 ms step at 64
    samples, 6.8 ms added for F = 2 and 15.7 ms for F = 3 (step ratios 1.58 and 2.33): 2.2-2.3 ms hidden, within
    the 2.7 ms the step spends outside the pass."""
    w = build_workload("resnet18", "fake", image_size=224, num_samples=16)
    real = StepRunner(w, "cuda")
    slow = StepRunner(w, "cuda", slowdown=Slowdown(factor, "stall"))
    for b in (64, 128):
        real.measure(b, 2, 0)
        slow.measure(b, 2, 0)
        added, ratios = [], []
        for _ in range(7):
            a = real.measure(b, 0, 1).times_s[0]
            s = slow.measure(b, 0, 1).times_s[0]
            a2 = real.measure(b, 0, 1).times_s[0]
            added.append(s - (a + a2) / 2)
            ratios.append(s / ((a + a2) / 2))
        (pass_ms,) = [ms for key, ms in slow.slowdown.calibrated.items() if key[0][0] == b]  # key: shape first
        stall, step = (factor - 1) * pass_ms / 1e3, statistics.median(added) / (statistics.median(ratios) - 1)
        outside = max(0.0, step - pass_ms / 1e3)  # the real step's time outside the pass's kernels
        print(f"F={factor} b={b}: pass {pass_ms:.1f} ms, step {1e3 * step:.1f} ms, added "
              f"{1e3 * statistics.median(added):.1f} ms of {1e3 * stall:.1f}, step ratio {statistics.median(ratios):.2f}")
        assert stall - outside - 0.05 * stall <= statistics.median(added) <= 1.05 * stall, (b, added, stall, outside)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machines)")
def test_stall_calibration_times_the_gpu_not_the_cpus_launches() -> None:
    """A pass's GPU time does not move when the launching thread is slowed: a Python thread spinning beside it
    (taking the GIL half the time) on a launch-bound pass (ResNet-18, 64 px, 16 samples)."""
    import threading

    from profiler.workloads.emulate import gpu_pass_ms

    w = build_workload("resnet18", "fake", image_size=64, num_samples=16)
    net = w.model_fn().cuda()
    x, y = synthetic_batch(w, 16, "cuda")
    params = [p for p in net.parameters() if p.requires_grad]
    quiet = gpu_pass_ms(net, w.loss_fn, x, y, params)
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    hog = threading.Thread(target=spin, daemon=True)
    hog.start()
    try:
        t0 = time.perf_counter()
        for _ in range(5):
            w.loss_fn(net(x), y).backward()
        torch.cuda.synchronize()
        launched_ms = (time.perf_counter() - t0) / 5 * 1e3
        busy = gpu_pass_ms(net, w.loss_fn, x, y, params)
    finally:
        stop.set()
        hog.join()
    assert busy == pytest.approx(quiet, rel=0.15), (quiet, busy, launched_ms)
    assert busy < 0.8 * launched_ms, (quiet, busy, launched_ms)  # the pass is launch-bound beside the hog


def test_stall_calibration_retries_a_pass_the_gpu_reached_early_behind_a_longer_lead() -> None:
    """A pass the GPU reached while the CPU still launched it is timed again behind a longer sleep (twice the lead,
    or three times the launch time it took); only queued passes count."""
    from profiler.workloads.emulate import CALIBRATION_PASSES, pass_time_ms

    leads: list[float] = []

    def timed(lead: float) -> tuple[float, bool, float]:  # launching takes 60 ms: a lead of 50 is too short
        leads.append(lead)
        return (99.0, False, 60.0) if lead < 60 else (10.0 + len(leads), True, 60.0)

    assert pass_time_ms(timed, lead_ms=50.0) == 13.0  # the passes timed 2nd, 3rd and 4th: 12, 13, 14 ms
    assert leads == [50.0] + [180.0] * CALIBRATION_PASSES


def test_stall_calibration_waits_out_a_launch_slowed_by_the_gil() -> None:
    """A launch slowed to 300 ms by a thread holding the GIL: the next lead is sized from it, and the pass queues."""
    from profiler.workloads.emulate import pass_time_ms

    leads: list[float] = []

    def timed(lead: float) -> tuple[float, bool, float]:
        leads.append(lead)
        host = 300.0 + (50.0 if len(leads) == 2 else 0.0)  # jitter: one launch took longer than the first
        return 2.0, host < lead, host

    assert pass_time_ms(timed) == 2.0
    assert 0.0 not in leads and leads[:2] == [50.0, 900.0]


def test_stall_calibration_is_bounded_when_the_cpu_never_gets_ahead_of_the_gpu() -> None:
    """Measured on 2x H200: near the memory limit the allocator synchronizes the device inside the pass, so the
    CPU's launch lasts the whole sleep, however long; the lead doubled to 102 s and a peer's collective timed out.
    Now the passes are timed straight (lead 0, a synchronized start) once a lead sized from the launch time fails
    the same way."""
    from profiler.workloads.emulate import CALIBRATION_PASSES, pass_time_ms

    leads: list[float] = []

    def timed(lead: float) -> tuple[float, bool, float]:
        leads.append(lead)
        return (700.0 if lead == 0 else 5000.0), False, lead + 600.0  # the host waits out the sleep and the pass

    assert pass_time_ms(timed) == 700.0
    assert leads == [50.0, 1950.0] + [0.0] * CALIBRATION_PASSES
