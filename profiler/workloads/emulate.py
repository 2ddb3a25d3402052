"""Emulated heterogeneity: one module used identically by `planner profile` and `planner train`.

Our machines have identical cards, so compute skew is produced on purpose (docs/DESIGN.md,
Heterogeneity we can produce):

``Slowdown(factor)`` makes a rank's training step take about ``factor`` times its real compute by repeating
real work, ``factor - 1`` extra forward+backward passes' worth per step.  Every extra pass runs on the
*unwrapped* module and takes its gradients with ``torch.autograd.grad(loss, params)``, so nothing reaches
``.grad`` nor DDP's reducer (DDP only sees the real pass).  BatchNorm running statistics are left untouched
(momentum set to 0 during the extra passes, ``num_batches_tracked`` restored), so an emulated rank trains exactly
like a real one.  The passes run in the autocast state of the ``apply`` call, so bf16/fp16 steps are slowed by the
same kind of work.

Where the extra work goes (``mode``):

  * ``"interleave"`` (default) -- the same passes, placed through the step the way a slower card's extra time
    is spread: ``apply`` runs the passes that belong before the backward and arms one-shot gradient hooks that run
    the others when the *real* backward reaches a given fraction of the parameters (``place_passes``: F = 2 runs
    its pass a quarter into the backward; F = 3 one pass at once and one 5/8 into the backward).  So the slow
    rank's gradient buckets become ready spread over its step, closer to where a uniformly slower GPU's would.
    (A hooked parameter the real backward does not reach -- unused in that step -- leaves its pass undone for the
    step; FSDP2's sharded parameters fall back to block mode.)  Measured against block mode in the same launch on 2x H100 (docs/PERFORMANCE.md): the same curve
    (rank 1 / rank 0 = 3.00-3.01 at b = 128-256 in both), and the plan's measured step within +0.9% of its
    prediction at F = 3 (block: +5.7%) and +0.6% at F = 4 (block: +5.9%).  Passes are whole: cutting them into
    small slices costs a GPU in its flat, launch-bound region nearly a full pass per slice (F = 3
    gave 4.2-4.7x at b = 48-96 on H200).
  * ``"block"`` -- all the extra work at once inside ``apply``: ``floor(factor - 1)`` passes on the whole batch and
    one on the first ``round(frac * b)`` samples.  Its flaw: the slow rank's whole backward -- and so every gradient bucket -- comes in the last ``1/factor`` of its
    step, while a fast peer's buckets are ready from a third of the way through its own; the fast rank's NCCL
    all-reduce kernels are launched early and spin on SMs while its backward still runs, and at a balanced split
    (the plan's) that costs the step 5-9% the model does not know of (the fast rank measured 7-9% slower
    beside the "slow" one; proportional splits, which leave the fast rank slack, hid it).  A real slower card
    spreads its extra time over the whole step, so the emulation, not the cluster, produced most of that cost.

  * ``"stall"`` -- no extra passes in the step: GPU-side sleeps (``torch.cuda._sleep``, a kernel that spins for
    a number of clock cycles on the compute stream) of ``factor - 1`` times the rank's real forward+backward time
    at this batch shape, the forward's share before the backward and the rest in 8 equal sleeps evenly through it
    (``place_stalls``).  The real pass's GPU time is measured the first time a batch shape comes (3 passes, each
    queued behind a GPU sleep so the CPU's launch pace stays out of it, median; ``gpu_pass_ms``), with the clock's
    cycles per ms.  So the emulated card is a GPU F x slower beside the same CPU: where the step is bound by the
    CPU's launches (small batches) it is slowed by less than F, as a real slower card would be, and the profile
    measures that (F = 3, ResNet-50 bf16 on H100, three profiles: 2.94-2.99x at 128-384 samples,
    1.94-2.98x at 64-96, 0.84-1.78x at 8-24, where the CPU's launches hide most of the slower GPU).  Why: the
    passes of the modes above are launched by the CPU, and in ResNet-50's launch-bound region (rank 1 at 85-120
    samples, F = 3 on H100) three passes' launches under 30 loader workers' CPU load made the emulated rank's
    compute swing from 90 to 138 ms (p10-p90) around a 113 ms median (docs/PERFORMANCE.md):
    a jitter a slower card does not have, since it launches each kernel once and only runs them longer.  Measured
    on 2x H100 (3 launches each way): the skew case's clean epochs at 0.930 of the prediction
    against 0.815, the emulated rank's own time flat (p90 within 3% of the median).  A sleep
    holds the stream like longer kernels and shows in CUDA-event timing, but does not load the SMs (the kernel is one
    thread), where a slower card's kernels would.  On a CPU device stall mode runs interleave's passes (no GPU to
    stall).  Each new batch shape costs 4 passes and the sleeps before them, once: with variable-length text (a new
    sequence length in most steps) that is most steps, so emulate such workloads with interleave.

Why interleave and block repeat work rather than sleep on the host: a host sleep releases the device and the CPU, so it neither
loads the GPU like a slower card nor shows up in CUDA-event timing of backward; repeated passes do, scale with
the batch size like the real step (t(b) -> f * t(b) where t is linear in b), and need no calibration that could
drift.  A slice pass in the GPU's flat region (tiny batches) costs nearly a full one, so slices over-slow there;
the profiler measures the emulated rank as it trains, so the plan sees what the emulation really costs.  Measured
on H100 (ResNet-50, bf16, block mode): factor 3 gave 3.01-3.03x the rank's own fwd+bwd time at batch 48-432; on
CPU see tests/profiler/test_emulate.py.  The optimizer step is not repeated, so a full step is slowed by
slightly less than ``factor`` (by the optimizer's share of the step).

``--emulate-loader RANK=W`` caps a rank's dataloader workers; the trainer applies the cap and the profiler
records it (``RankProfile.meta["emulate_loader_workers"]``) and measures loader scaling only up to it.
"""

from __future__ import annotations

import math
import os
import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from planner.errors import ValidationError

if TYPE_CHECKING:
    import torch


def _parse_rank_pairs(text: str, flag: str, value_form: str) -> dict[int, str]:
    out: dict[int, str] = {}
    form = f"expected RANK={value_form}[,RANK={value_form}..], e.g. {flag} 1=3,2=1.5"
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, val = part.partition("=")
        if not sep or not key.strip().isdigit() or not val.strip():
            raise ValidationError(f"{flag}: cannot read {part!r}; {form}")
        rank = int(key)
        if rank in out:
            raise ValidationError(f"{flag}: rank {rank} given twice in {text!r}; {form}")
        out[rank] = val.strip()
    return out


def parse_rank_floats(text: str | None, *, flag: str = "--emulate-slowdown") -> dict[int, float]:
    """Parse ``"1=3,2=1.5"`` into ``{1: 3.0, 2: 1.5}``; every factor must be >= 1.

    Raises:
        ValidationError: malformed text or a factor below 1, with the expected form.
    """
    if not text:
        return {}
    out: dict[int, float] = {}
    for rank, val in _parse_rank_pairs(text, flag, "FACTOR").items():
        try:
            f = float(val)
        except ValueError:
            raise ValidationError(f"{flag}: factor {val!r} for rank {rank} is not a number; e.g. {flag} 1=3") from None
        if not math.isfinite(f) or f < 1.0:
            raise ValidationError(f"{flag}: factor for rank {rank} must be >= 1 (1 = real speed), got {val}")
        out[rank] = f
    return out


def parse_rank_gib(text: str | None, *, flag: str = "--emulate-memory") -> dict[int, float]:
    """Parse ``"0=20,1=40"`` into ``{0: 20.0, 1: 40.0}`` GiB of device memory per rank (each > 0).

    Raises:
        ValidationError: malformed text or a size that is not a positive number.
    """
    if not text:
        return {}
    out: dict[int, float] = {}
    for rank, val in _parse_rank_pairs(text, flag, "GIB").items():
        try:
            gib = float(val)
        except ValueError:
            raise ValidationError(f"{flag}: {val!r} for rank {rank} is not a number of GiB; e.g. {flag} 0=20") from None
        if not math.isfinite(gib) or gib <= 0:
            raise ValidationError(f"{flag}: memory for rank {rank} must be > 0 GiB, got {val}")
        out[rank] = gib
    return out


def cap_device_memory(device: torch.device, gib: float | None, *, flag: str = "--emulate-memory") -> float | None:
    """Emulate a smaller GPU: let this process allocate at most ``gib`` GiB on ``device``
    (``torch.cuda.set_per_process_memory_fraction``), so a batch that does not fit raises a real out-of-memory
    error in the profiler's sweep and in training alike.  Returns the fraction set (None when ``gib`` is None).
    """
    import torch

    if gib is None:
        return None
    if device.type != "cuda":
        raise ValidationError(f"{flag}: emulated memory needs a CUDA device, this rank runs on {device}")
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = gib * 2**30 / total
    if not 0 < fraction < 1:
        raise ValidationError(f"{flag}: {gib:g} GiB is not below this GPU's {total / 2**30:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def parse_rank_ints(text: str | None, *, flag: str = "--emulate-loader") -> dict[int, int]:
    """Parse ``"1=2,3=0"`` into ``{1: 2, 3: 0}`` (worker counts, each >= 0).

    Raises:
        ValidationError: malformed text or a negative count, with the expected form.
    """
    if not text:
        return {}
    out: dict[int, int] = {}
    for rank, val in _parse_rank_pairs(text, flag, "WORKERS").items():
        if not val.isdigit():
            raise ValidationError(f"{flag}: worker count {val!r} for rank {rank} must be an integer >= 0; e.g. {flag} 1=2")
        out[rank] = int(val)
    return out


MODES = ("interleave", "block", "stall")
MODE_ENV = "PLANNER_EMULATE_MODE"
BACKWARD_SHARE = 2.0 / 3.0
"""The backward's share of a forward+backward pass (backward ~ 2 x forward), used to place interleave mode's passes."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SlowdownPlan:
    """How a factor is turned into work: ``full_passes`` forward+backward passes on the batch plus one on
    ``slice_samples`` samples (the fractional part), and -- interleave mode -- where each pass runs."""

    full_passes: int
    slice_samples: int
    """Samples in the fractional pass (0: none)."""
    at_backward: tuple[float, ...] = ()
    """Interleave mode, one per pass (full passes first, then the slice): the fraction of the real backward (by
    parameters, in backward order) reached when the pass runs; 0 = at ``apply``, before the backward.  Stall mode:
    where each stall runs."""
    stall_shares: tuple[float, ...] = ()
    """Stall mode, one per entry of ``at_backward``: that stall's length in real passes (they sum to factor - 1)."""


STALL_PIECES = 8
"""Stall mode: the backward's share of the stall is cut into this many equal stalls, evenly through the backward."""


def place_stalls(extra: float, pieces: int = STALL_PIECES) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Stall mode's (positions, lengths in real passes) for ``extra`` = factor - 1 passes' worth: a uniformly
    slower card spends the forward's share of its extra time before the backward (one stall at 0) and the rest
    evenly through it (``pieces`` stalls at the midpoints u = (k + 1/2) / pieces).  A stall costs no launches, so
    unlike passes it can be cut as finely as wanted."""
    if extra <= 0:
        return (), ()
    back = extra * BACKWARD_SHARE / pieces
    return (0.0, *((k + 0.5) / pieces for k in range(pieces))), (extra * (1 - BACKWARD_SHARE), *([back] * pieces))


def place_passes(work: list[float]) -> tuple[float, ...]:
    """Where interleave mode runs passes of relative sizes ``work``: the midpoint rule against a uniformly
    slower card.  A card ``factor`` x slower has done ``(factor - 1) * (F + u * B)`` extra work when its backward
    is a fraction ``u`` through, F and B the real forward and backward (``BACKWARD_SHARE`` = B / (F + B)); pass j
    runs where that line crosses the middle of pass j.  F = 3: one pass before the backward, one at u = 5/8."""
    total = sum(work)
    out, before = [], 0.0
    for w in work:
        mid = (before + w / 2) / total  # share of the extra work done at pass j's middle
        out.append(min(1.0, max(0.0, (mid - (1 - BACKWARD_SHARE)) / BACKWARD_SHARE)))
        before += w
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Slowdown:
    """Run about ``factor`` times the real forward+backward work per step (see the module docstring).

    Call ``apply(module, loss_fn, x, y)`` once per training step (per micro-batch), inside the same autocast
    context as the real forward and before its backward.  ``factor == 1`` is a no-op.
    """

    factor: float = 1.0
    """Target step-time multiplier (>= 1)."""
    mode: str = field(default_factory=lambda: os.environ.get(MODE_ENV, "interleave") or "interleave")
    """``"interleave"`` (extra work spread over forward and backward, like a slower card), ``"block"`` or
    ``"stall"`` (GPU sleeps sized from the real pass, spread like a slower card's extra time); the
    default comes from the environment variable ``PLANNER_EMULATE_MODE`` (so every process of a launch -- profile,
    train, bench -- emulates alike), else interleave."""

    calibrated: dict[Any, float] = field(default_factory=dict, init=False, repr=False, compare=False)
    """Stall mode: the real pass's ms by batch shape and autocast state (``_pass_ms``)."""

    def __post_init__(self) -> None:
        if not math.isfinite(self.factor) or self.factor < 1.0:
            raise ValidationError(f"slowdown factor must be >= 1 (1 = real speed), got {self.factor}")
        if self.mode not in MODES:
            raise ValidationError(f"slowdown mode must be one of {', '.join(MODES)} (set by {MODE_ENV}), "
                                  f"got {self.mode!r}")

    @property
    def enabled(self) -> bool:
        return self.factor > 1.0

    def plan(self, batch_size: int, device_type: str = "cuda") -> SlowdownPlan:
        """The work behind the factor at ``batch_size``: passes, or stalls (stall mode on a CUDA device; stall
        mode elsewhere runs interleave's passes, having no GPU to stall)."""
        extra = self.factor - 1.0
        if self.mode == "stall" and device_type == "cuda":
            at, shares = place_stalls(extra)
            return SlowdownPlan(full_passes=0, slice_samples=0, at_backward=at, stall_shares=shares)
        full = math.floor(extra + 1e-9)
        frac = max(0.0, extra - full)
        piece = min(batch_size, round(frac * batch_size))
        placed: tuple[float, ...] = ()
        if self.mode in ("interleave", "stall"):
            placed = place_passes([1.0] * full + ([piece / batch_size] if piece else []))
        return SlowdownPlan(full_passes=full, slice_samples=piece, at_backward=placed)

    def apply(self, module: torch.nn.Module, loss_fn: Callable[..., Any], x: torch.Tensor, y: torch.Tensor) -> None:
        """Run the extra passes placed before the backward -- all of them in block mode -- and arm one-shot hooks
        that run the others inside the real backward (interleave mode).

        Gradients of extra passes are computed and dropped; model state is left as it was.
        """
        inner = getattr(module, "module", module) if _is_ddp(module) else module
        _disarm(inner)  # hooks of an earlier apply whose backward never ran must not fire in this one
        if not self.enabled:
            return
        # DDP's forward would touch its reducer; the wrapped module never does.
        params = [p for p in inner.parameters() if p.requires_grad]
        work = self.plan(int(x.shape[0]), x.device.type)
        if work.stall_shares:
            self._stall(inner, loss_fn, x, y, params, work)
            return
        passes = [(x, y)] * work.full_passes + ([(x[: work.slice_samples], y[: work.slice_samples])]
                                                 if work.slice_samples > 0 else [])
        at = work.at_backward if params and not _is_sharded(params) else ()  # empty in block mode
        now = [xy for i, xy in enumerate(passes) if not at or at[i] <= 0.0]
        with _frozen_batchnorm(inner):
            for xs, ys in now:
                _extra_pass(inner, loss_fn, xs, ys, params)
        later = [(at[i], xy) for i, xy in enumerate(passes) if at and at[i] > 0.0]
        if later:
            _arm(inner, loss_fn, params, later)

    def _stall(self, inner: Any, loss_fn: Callable[..., Any], x: Any, y: Any, params: list[Any],
               work: SlowdownPlan) -> None:
        """Stall mode: GPU sleeps of ``work.stall_shares`` real passes each, the first at once and the others
        from one-shot gradient hooks through the real backward (all at once for sharded parameters)."""
        import torch

        per_pass = self._pass_ms(inner, loss_fn, x, y, params) * _cycles_per_ms(x.device)
        cycles = [int(share * per_pass) for share in work.stall_shares]
        spread = bool(params) and not _is_sharded(params)
        now = sum(c for u, c in zip(work.at_backward, cycles, strict=True) if u <= 0.0 or not spread)
        if now > 0:
            torch.cuda._sleep(now)
        later = [(u, c) for u, c in zip(work.at_backward, cycles, strict=True) if spread and u > 0.0 and c > 0]
        if later:
            _arm_stalls(inner, params, later)

    def _pass_ms(self, inner: Any, loss_fn: Callable[..., Any], x: Any, y: Any, params: list[Any]) -> float:
        """The real forward+backward's GPU time on this batch shape, in ms (``gpu_pass_ms``), measured the first
        time a shape comes (in the caller's autocast state) and kept."""
        key = calibration_key(x)
        if key not in self.calibrated:
            self.calibrated[key] = gpu_pass_ms(inner, loss_fn, x, y, params)
        return self.calibrated[key]


def calibration_key(x: Any) -> tuple[Any, ...]:
    """What a real pass's time depends on besides the model: the batch's shape and dtype, and autocast."""
    amp_on, amp_dtype = _autocast_state("cuda")
    return tuple(x.shape), str(x.dtype), amp_on, str(amp_dtype)


CALIBRATION_PASSES = 3
"""Stall mode: real passes timed (after one warm-up) to size the stalls of a new batch shape; the median is kept."""


def gpu_pass_ms(inner: Any, loss_fn: Callable[..., Any], x: Any, y: Any, params: list[Any],
                lead_ms: float = 50.0) -> float:
    """The GPU's own time for one forward+backward of ``inner`` on (x, y), in ms, whatever the CPU's pace: each
    timed pass is queued behind a GPU sleep of ``lead_ms``, so its kernels are all launched before the GPU reaches
    them; a pass the GPU reached while the CPU was still launching it (its start event already passed) is timed
    again behind a longer sleep (``pass_time_ms`` has the policy and its bound).  Timing passes launched straight
    away would measure the CPU's launch pace instead: on 2x H100 with 30 loader workers starting, one shape
    measured 3.3x its profiled time that way (docs/PERFORMANCE.md)."""
    import torch

    with _frozen_batchnorm(inner):
        _extra_pass(inner, loss_fn, x, y, params)  # warm-up: allocator, cudnn autotuning, clocks up
        per_ms = _cycles_per_ms(x.device, fresh=True)

        def timed(lead: float) -> tuple[float, bool, float]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if lead > 0:
                torch.cuda._sleep(int(lead * per_ms))
            else:
                torch.cuda.synchronize(x.device)
            t0 = time.perf_counter()
            start.record()
            _extra_pass(inner, loss_fn, x, y, params)
            end.record()
            host_ms = (time.perf_counter() - t0) * 1e3
            queued = lead > 0 and not start.query()  # the GPU was still asleep when the pass's last kernel launched
            end.synchronize()
            return start.elapsed_time(end), queued, host_ms

        return pass_time_ms(timed, lead_ms)


MAX_LEAD_MS = 10_000.0
"""The longest GPU sleep a stall-mode calibration queues a pass behind (``pass_time_ms``)."""


def pass_time_ms(timed: Callable[[float], tuple[float, bool, float]], lead_ms: float = 50.0,
                 max_lead_ms: float = MAX_LEAD_MS) -> float:
    """Median of ``CALIBRATION_PASSES`` pass times from ``timed(lead_ms) -> (ms, queued, host_ms)``, where
    ``host_ms`` is the CPU's time to launch the pass behind the lead's sleep.

    A pass the GPU reached before the CPU had launched it all is timed again behind a longer sleep: twice the lead,
    or three times the launch time it just took (a launch slowed by a thread holding the GIL takes hundreds of ms;
    the GPU tests' ResNet-18 beside a spinning thread).  When the CPU cannot get ahead even of a sleep sized from its
    own launch time -- its launch lasted the whole sleep again, so the device itself blocks it: near the memory
    limit the caching allocator frees and synchronizes inside the pass -- no sleep helps, and the passes are timed
    straight after a device synchronize (lead 0): such a pass is long, so the CPU's launch pace is hidden in it
    anyway.  Without this bound, on 2x H200 the profiler's largest batch (3072 samples) doubled its lead to 102 s
    and rank 0's next collective timed out after 120 s."""
    times: list[float] = []
    retried, straight = False, False
    while len(times) < CALIBRATION_PASSES:
        if straight:
            times.append(timed(0.0)[0])
            continue
        ms, queued, host_ms = timed(lead_ms)
        if queued:
            times.append(ms)
            continue
        straight = (retried and host_ms >= lead_ms) or 2 * lead_ms > max_lead_ms
        lead_ms, retried = min(max_lead_ms, max(2 * lead_ms, 3 * host_ms)), True
    return float(statistics.median(times))


_CYCLES_PER_MS: dict[int, float] = {}


def _cycles_per_ms(device: Any, fresh: bool = False) -> float:
    """GPU clock cycles per ms of ``torch.cuda._sleep`` on ``device``: the median of 3 timed sleeps, kept (taken
    again with ``fresh``: each calibration measures it with the GPU just busy, at its working clock)."""
    import torch

    idx = device.index if device.index is not None else torch.cuda.current_device()
    if fresh or idx not in _CYCLES_PER_MS:
        rates, cycles = [], 20_000_000
        with torch.cuda.device(idx):
            for _ in range(3):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                torch.cuda._sleep(cycles)
                end.record()
                end.synchronize()
                rates.append(cycles / start.elapsed_time(end))
        _CYCLES_PER_MS[idx] = statistics.median(rates)
    return _CYCLES_PER_MS[idx]


def _arm_stalls(inner: Any, params: list[Any], later: list[tuple[float, int]]) -> None:
    """One-shot hooks: a GPU sleep of the given cycles when the real backward reaches the parameter a fraction u
    through ``params`` in backward order (on the backward's stream, as a slower card's kernels would take longer
    there)."""
    import torch

    groups: dict[int, int] = {}
    for u, c in later:
        i = _param_at(len(params), u)
        groups[i] = groups.get(i, 0) + c

    def make_hook(cycles: int) -> Callable[[Any], None]:
        fired = [False]

        def hook(_grad: Any) -> None:
            if not fired[0]:  # one-shot
                fired[0] = True
                torch.cuda._sleep(cycles)

        return hook

    _ARMED[inner] = [params[i].register_hook(make_hook(c)) for i, c in groups.items()]


_ARMED: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


def _disarm(inner: Any) -> None:
    for handle in _ARMED.pop(inner, []):
        handle.remove()


def _arm(inner: Any, loss_fn: Callable[..., Any], params: list[Any], later: list[tuple[float, Any]]) -> None:
    """One-shot hooks: the pass placed at backward fraction u runs from the gradient hook of the parameter a
    fraction u through ``params`` in backward (reverse registration) order, in the caller's autocast state, on the
    autograd thread while the real backward waits.  Passes placed at one parameter run in order."""
    import torch

    dev = later[0][1][0].device.type
    amp_on, amp_dtype = _autocast_state(dev)
    state: dict[str, Any] = {"busy": False}
    groups: dict[int, list[Any]] = {}
    for u, xy in later:
        groups.setdefault(_param_at(len(params), u), []).append(xy)

    def make_hook(work: list[Any]) -> Callable[[Any], None]:
        def hook(_grad: Any) -> None:
            if not work or state["busy"]:  # one-shot; and silent inside our own extra passes
                return
            state["busy"] = True
            try:
                with torch.enable_grad(), torch.autocast(dev, dtype=amp_dtype, enabled=amp_on), \
                        _frozen_batchnorm(inner):
                    while work:  # popped, so the batch is not held after the step
                        xs, ys = work.pop(0)
                        _extra_pass(inner, loss_fn, xs, ys, params)
            finally:
                state["busy"] = False

        return hook

    _ARMED[inner] = [params[i].register_hook(make_hook(work)) for i, work in groups.items()]


def _param_at(n: int, u: float) -> int:
    """The index, in registration order, of the parameter whose gradient the backward reaches a fraction ``u``
    through ``n`` parameters (the backward runs them in reverse)."""
    return max(0, min(n - 1, round((n - 1) * (1.0 - u))))


def _autocast_state(device_type: str) -> tuple[bool, Any]:
    import torch

    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _is_sharded(params: list[Any]) -> bool:
    """FSDP2 (DTensor) parameters: its own hooks run per forward; keep the extra work in one block there."""
    return any(type(p).__name__ == "DTensor" for p in params)


def _extra_pass(module: Any, loss_fn: Callable[..., Any], x: Any, y: Any, params: list[Any]) -> None:
    import torch

    loss = loss_fn(module(x), y)
    # allow_unused: a parameter outside this forward (e.g. an unused head) must not raise.
    torch.autograd.grad(loss, params, allow_unused=True)


def _is_ddp(module: Any) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(module, DistributedDataParallel)


class _frozen_batchnorm:
    """Context: BatchNorm layers normalize with batch statistics but do not update running stats."""

    def __init__(self, module: Any) -> None:
        from torch.nn.modules.batchnorm import _BatchNorm

        self._saved: list[tuple[Any, Any, Any]] = []
        for m in module.modules():
            if isinstance(m, _BatchNorm) and m.training and m.track_running_stats:
                nbt = None if m.num_batches_tracked is None else m.num_batches_tracked.clone()
                self._saved.append((m, m.momentum, nbt))

    def __enter__(self) -> None:
        # momentum 0: running = (1 - 0) * running + 0 * batch_stat, i.e. unchanged.
        for m, _, _ in self._saved:
            m.momentum = 0.0

    def __exit__(self, *exc: object) -> None:
        for m, momentum, nbt in self._saved:
            m.momentum = momentum
            if nbt is not None:
                m.num_batches_tracked.copy_(nbt)
