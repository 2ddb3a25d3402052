"""Per-step timing on one rank without extra device synchronization on the hot path.

Three numbers per step, averaged per epoch into a ``planner.StepStats`` (the re-planner's input):

* data wait -- host clock around ``next(iterator)``: how long the loop starved for its next batch;
* compute   -- forward start until the last gradient bucket is ready, i.e. this rank's own work before it
  could wait for its peers.  On CUDA two events are recorded on the current stream (one at forward start, one
  in the DDP comm hook's ``on_last_bucket`` callback) and read *a step later*: by then the device has almost
  always passed them, so ``Event.query()`` is true and ``elapsed_time`` does not block.  Events still pending
  are carried to the next step; only ``epoch_summary`` waits for the last few (once per epoch, off the hot
  path).  On CPU (and any non-CUDA device) the host clock is exact because the work is synchronous;
* step time -- host clock from one ``step_end`` to the next, synchronization with the peers included.  On CUDA
  the host runs ahead of the device, so a single step's host interval is not its device time; over an epoch the
  queue depth is bounded, so the *mean* is honest while single steps and the std are not.

And, where the DataLoader reports it (runtime.loader_timing), the seconds its workers spent building each step's
batches (``loader_batch``): the loader's own cost, which the data wait shows only when the loader falls behind.

Usage (the reference trainer wires exactly this)::

    timer = StepTimer(device)
    hook = register_weighted_hook(ddp, sampler, on_last_bucket=timer.compute_end)
    for x, y in timer.iter_data(loader):          # data_start / data_end around next()
        timer.compute_start()
        loss_fn(ddp(x), y).backward()
        timer.compute_end()                       # ignored when the hook already fired this step
        opt.step(); opt.zero_grad()
        timer.step_end()
    stats = timer.epoch_summary(rank=rank, epoch=epoch, batch_size=b, num_workers=w)
    timer.reset()

Measurements that are NaN, infinite or negative never reach a StepStats: the step is dropped and counted
(``num_dropped``), as is a step whose compute span was never closed.

Own time vs time lost to peers.  A rank's compute span can grow for reasons that are not its own: when a peer
reaches the gradient all-reduce late (it waited for data), this rank's NCCL kernels spin on the device beside its
backward and its host thread stalls, so its compute reads long exactly in the steps where a peer was late (2x H100:
a rank with a 135 ms median read a 189 ms mean, std 144 ms, while its peer waited ~0.6 s for data once every 8
steps).  Fed to the re-planner, that tail makes the *victim* look slow and moves work onto the rank that was
starving.  So ``epoch_summary`` takes the peers' per-step data waits (``step_data_waits_s``, exchanged once per
epoch by ``peer_data_waits``): a step where some peer waited for data more than ``PEER_LATE_FRAC`` of this rank's
median compute longer than this rank did -- and the step after it, which a late all-reduce can still delay -- is
left out of ``compute_s`` (this rank's own time) and the difference is reported as ``interference_s``, with
``num_peer_late`` steps counted.  The re-planner thus corrects the rank that was slow, not the one that waited.

Compile steps.  Under torch.compile a rank's first step at a shape it has not run compiles (tens of seconds on a
GPU for a 100M-parameter LM, against a 46 ms step): its first step, and the first at a new batch size after a
re-plan -- or at the epoch's partial last step; guards a first step leaves unset (the optimizer's state, grad
mode) can recompile the next one or two.  So a step among an epoch's warm-up steps and the ``COMPILE_FIRST_STEPS`` after them, or its last,
whose compute ran over ``COMPILE_FACTOR`` times the epoch's median compute and at least ``COMPILE_MIN_S`` is a
compile; the same span mid-epoch is a stall (an outlier), never a compile, because no new shape reaches a rank
there (the shape it runs is the one its first steps ran; a varying sequence length goes dynamic at its
first recompile).  A compile is left out of every mean (warm-up or not) and
counted in ``StepStats.compile_steps`` / ``compile_s`` (its time beyond the median step), so one recompile is
neither averaged into the rank's step time nor read as a slow rank.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from planner.errors import ValidationError
from planner.stats import StepStats
from runtime.collectives import all_gather_json

T = TypeVar("T")

OUTLIER_SIGMAS = 5.0
"""A step whose compute time is this many robust sigmas (1.4826 x MAD) from the epoch's median is an outlier."""
MAX_OUTLIER_FRACTION = 0.2
"""If more of an epoch's steps than this look like outliers they are not: the spread is real and all count."""
PEER_LATE_FRAC = 0.10
"""A peer that waited for data this fraction of this rank's median compute (and at least ``PEER_LATE_MIN_S``)
longer than this rank in a step made the step's compute no measure of this rank's own speed."""
PEER_LATE_MIN_S = 0.001
MIN_CLEAN_FRACTION = 0.5
"""Steps left after removing the peer-late ones must be at least this fraction of the epoch, or all count (a peer
late in most steps leaves too little to tell own compute from interference)."""

COMPILE_FACTOR = 20.0
"""A step whose compute took this many times the epoch's median compute (and ``COMPILE_MIN_S``) was a compile."""
COMPILE_FIRST_STEPS = 3
"""Steps after an epoch's warm-up in which a compile is looked for, besides the warm-up and the last step (module
docstring)."""
COMPILE_MIN_S = 0.5
"""Shortest compute span read as a compile: a recompile takes seconds (8 s for a small MLP on a 2-core CPU, about
a minute for GPT-2 on an H200); a stall of a fraction of a second is an outlier, not a compile."""

STEADY_MIN_CYCLES = 2
"""Whole worker cycles that must lie between an epoch's loader fill and drain for its steady pace to be measured."""


class DeviceEvent(Protocol):
    """The part of ``torch.cuda.Event`` the timer uses (a fake one stands in for it in CPU tests)."""

    def record(self) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    def elapsed_time(self, end_event: Any) -> float: ...


class _CudaEvent:
    """A timing CUDA event recorded on the device's *current* stream at record time.

    ``record`` runs on whatever thread calls it: the comm hook runs on the autograd thread, whose current stream
    is the one the backward kernels ran on, so the event lands right after the last bucket's gradients.
    """

    __slots__ = ("_device", "_event")

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._event = torch.cuda.Event(enable_timing=True)

    def record(self) -> None:
        self._event.record(torch.cuda.current_stream(self._device))

    def query(self) -> bool:
        return bool(self._event.query())

    def synchronize(self) -> None:
        self._event.synchronize()

    def elapsed_time(self, end_event: Any) -> float:
        return float(self._event.elapsed_time(end_event._event))


@dataclass(slots=True)
class _Step:
    """One step's raw numbers (mutable while the step is open)."""

    data_wait_s: float = 0.0
    loader_s: float | None = None
    """Seconds the loader's workers spent building this step's batches (None: not reported)."""
    compute_s: float | None = None
    step_time_s: float | None = None
    start_event: DeviceEvent | None = None
    end_event: DeviceEvent | None = None
    lead_s: float | None = None
    """Seconds from the previous step's end (after its optimizer step) to this step's forward start: on CUDA the
    device's idle time before the step (its batch's copy, the host launching late, and -- with the span opened by
    ``ComputeStart`` -- its wait for a late peer in DDP's forward-start buffer broadcast), on the host clock the
    data wait and the loop between.  None for an epoch's first step."""
    prev_end: DeviceEvent | None = None
    host_compute_s: float | None = None
    """The host clock from ``compute_start`` to ``compute_end`` (None: not closed).  With device events the host
    usually runs ahead, so this is shorter than ``compute_s``; a span whose host time reaches its device time was
    closed late by the host (the last bucket's hook waited for the CPU or the GIL), not by the device."""


def _mean_build_s(steps: Sequence[_Step], workers: int, *, need: float) -> float | None:
    """The workers' mean build seconds per step over an epoch, each worker's first batch left out (start-up);
    None when fewer than ``need`` steps report one.

    The mean, not the median: ``workers`` workers building in parallel deliver one step per ``mean / workers``
    seconds, whatever the spread, so the mean is what the loader's throughput is.  The median missed it both ways
    when the host's contention changed within an epoch (2x H100, a rank capped at 2 workers: median
    541 ms a batch, while the rank took one every 196 ms -- at most 392 ms a batch for its two workers)."""
    loads = [float(s.loader_s) for s in steps if s.loader_s is not None and _valid(s.loader_s)]
    if len(loads) > 2 * workers:
        loads = loads[workers:]
    return math.fsum(loads) / len(loads) if loads and len(loads) >= need else None


def _valid(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x >= 0.0


def worker_cycle(job_workers: Sequence[int], num_steps: int) -> int:
    """Steps in one cycle of the job's DataLoader workers: the least common multiple of the ranks' worker counts
    when ``num_steps`` holds one, else the most workers of any rank (1 without workers).

    Why: a DataLoader hands out batches round-robin, and its workers, started together at the epoch start,
    deliver them in bursts: with W workers each needing T to build a batch, W batches arrive, the GPU takes them
    at its own pace, and the next W come T later.  In that regime W consecutive steps take exactly T wherever
    they start, but a mean over some other count of steps is off by up to a burst: on 2x H100 a
    16-worker rank of 455 samples a step over a 28-step epoch measured 126.6 ms a step while its workers'
    pace was 136 ms (2.18 s a batch over 16); `planner bench`'s 20-step windows on the same split read
    2,687-3,470 samples/s in three rounds."""
    ws = [int(w) for w in job_workers if int(w) > 1]
    if not ws or num_steps < 1:
        return 1
    lcm = math.lcm(*ws)
    if lcm <= num_steps:
        return lcm
    return max(ws) if max(ws) <= num_steps else 1


class StepTimer:
    """Times data wait, local compute and step time of every step on one rank; summarizes an epoch.

    Args:
        device: the rank's training device; CUDA devices are timed with events, everything else with the host
            clock.
        warmup_steps: steps at the start of each epoch left out of the means (allocator warm-up, cudnn
            autotuning, worker start); only applied when the epoch has more than ``2 * warmup_steps`` steps.
        clock: host clock in seconds (``time.perf_counter``; tests pass a fake one).
        event_factory: makes device events; defaults to CUDA timing events on CUDA devices and None (host clock)
            elsewhere.  Tests pass fakes to exercise the deferred reads without a GPU.
    """

    def __init__(
        self,
        device: torch.device | str,
        *,
        warmup_steps: int = 2,
        clock: Callable[[], float] = time.perf_counter,
        event_factory: Callable[[], DeviceEvent] | None = None,
    ) -> None:
        if warmup_steps < 0:
            raise ValidationError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.device = torch.device(device)
        self.warmup_steps = warmup_steps
        self._clock = clock
        if event_factory is None and self.device.type == "cuda" and torch.cuda.is_available():
            dev = self.device
            event_factory = lambda: _CudaEvent(dev)  # noqa: E731
        self._event_factory = event_factory
        self.reset()

    @property
    def uses_device_events(self) -> bool:
        return self._event_factory is not None

    # -- hot path ----------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every step (call at the start of each epoch, after ``epoch_summary``)."""
        self._steps: list[_Step] = []
        self._pending: list[_Step] = []  # closed steps whose device events were not read yet
        self._cur = _Step()
        self._last_step_end: float | None = None  # None: the next step is timed from its first mark
        self._step_start: float | None = None
        self._data_t0: float | None = None
        self._compute_t0: float | None = None
        self._host_t0: float | None = None  # the host clock at this step's compute_start (``host_compute_s``)
        self._compute_closed = False
        self._end_event: DeviceEvent | None = None  # the last step's end on the device (``lead_s``)
        self.num_dropped = 0
        """Steps left out of the summary: a non-finite/negative measurement or a compute span never closed."""

    def _mark_start(self, now: float) -> None:
        if self._step_start is None:
            self._step_start = now if self._last_step_end is None else self._last_step_end

    def data_start(self) -> None:
        """Call right before ``next(iterator)``."""
        now = self._clock()
        self._mark_start(now)
        self._data_t0 = now

    def data_end(self) -> None:
        """Call right after ``next(iterator)`` returned; adds to this step's data wait."""
        if self._data_t0 is None:
            return
        self._cur.data_wait_s += self._clock() - self._data_t0
        self._data_t0 = None

    def loader_batch(self, seconds: float) -> None:
        """Add the seconds a worker spent building the batch just fetched (runtime.loader_timing.TimedLoader's
        ``on_batch``; called inside ``next()``, so it belongs to the step that consumes the batch)."""
        if _valid(seconds):
            self._cur.loader_s = (self._cur.loader_s or 0.0) + seconds

    def iter_data(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield from `iterable`, timing each ``next()`` as data wait."""
        it = iter(iterable)
        while True:
            self.data_start()
            try:
                item = next(it)
            except StopIteration:
                self._data_t0 = None  # the failed fetch belongs to no step
                return
            self.data_end()
            yield item

    def compute_start(self) -> None:
        """Call right before the forward pass.

        Only the first call of a step counts, so with gradient accumulation the span covers every micro-step
        (call the ``compute_end`` fallback only after the last one).
        """
        now = self._clock()
        self._mark_start(now)
        if self._cur.start_event is not None or self._compute_t0 is not None or self._compute_closed:
            return
        self._host_t0 = now
        if self._event_factory is not None:
            ev = self._event_factory()
            ev.record()
            self._cur.start_event, self._cur.prev_end = ev, self._end_event
        else:
            self._compute_t0 = now
            if self._last_step_end is not None:
                self._cur.lead_s = now - self._last_step_end

    def compute_end(self) -> None:
        """Close the compute span: call from ``on_last_bucket`` (before that bucket's all-reduce).

        The first call after ``compute_start`` wins and later ones are ignored, so calling it again after
        ``backward()`` is a safe fallback for runs where no comm hook fires (one rank without DDP); on a
        multi-rank run that later call would include waiting for the peers' all-reduce.  ``compute_recorded``
        tells whether the span is closed.
        """
        if self._compute_closed:
            return
        if self._event_factory is not None:
            if self._cur.start_event is None:
                return
            ev = self._event_factory()
            ev.record()
            self._cur.end_event = ev
            if self._host_t0 is not None:
                self._cur.host_compute_s = self._clock() - self._host_t0
        else:
            if self._compute_t0 is None:
                return
            self._cur.compute_s = self._cur.host_compute_s = self._clock() - self._compute_t0
            self._compute_t0 = None
        self._compute_closed = True

    @property
    def compute_recorded(self) -> bool:
        """True once this step's compute span is closed (by the hook or the after-backward fallback)."""
        return self._compute_closed

    def step_end(self) -> None:
        """Call once per step after the optimizer step; reads earlier steps' device events if they are done."""
        now = self._clock()
        self._mark_start(now)
        assert self._step_start is not None
        step = self._cur
        step.step_time_s = now - self._step_start
        self._last_step_end = now
        self._step_start = None
        self._data_t0 = None
        self._compute_t0 = self._host_t0 = None
        self._compute_closed = False
        self._cur = _Step()
        self._steps.append(step)
        if self._event_factory is not None:
            # where the device finishes this step (after the optimizer), for the next step's lead
            self._end_event = self._event_factory()
            self._end_event.record()
        if step.end_event is not None:
            # Read the previous steps' events now that this step's are recorded; never this step's own
            # (the device is usually still working on it) and never block.
            # Both events are queried: with a side stream the start need not precede the end in one queue.
            ready = [
                s for s in self._pending
                if s.start_event is not None and s.end_event is not None
                and s.end_event.query() and s.start_event.query() and (s.prev_end is None or s.prev_end.query())
            ]
            for s in ready:
                self._read_events(s)
            self._pending = [s for s in self._pending if s.compute_s is None] + [step]
        elif step.start_event is not None:
            step.start_event = None  # opened but never closed: no compute for this step

    def _read_events(self, s: _Step) -> None:
        assert s.start_event is not None and s.end_event is not None
        s.compute_s = s.start_event.elapsed_time(s.end_event) / 1000.0  # ms -> s
        if s.prev_end is not None:
            s.lead_s = s.prev_end.elapsed_time(s.start_event) / 1000.0
        s.start_event = s.end_event = s.prev_end = None

    # -- per epoch --------------------------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        """Steps ended since the last reset (valid or not)."""
        return len(self._steps)

    def _flush(self) -> None:
        """Read every outstanding device event (blocks on the last few steps: once per epoch)."""
        for s in self._pending:
            if s.start_event is not None and s.end_event is not None:
                s.start_event.synchronize()
                s.end_event.synchronize()
                if s.prev_end is not None and not s.prev_end.query():
                    s.prev_end.synchronize()
                self._read_events(s)
        self._pending = []

    def series(self) -> dict[str, list[float | None]]:
        """This epoch's raw steps so far, in step order, warm-up included (what ``epoch_summary`` condenses):
        ``data_wait_s``, ``compute_s`` (None: span never closed), ``step_time_s``, ``loader_s`` (the workers'
        build seconds of the step's batches; None: not reported), ``lead_s`` (``_Step.lead_s``: ranks whose
        leads differ in a step started it out of step) and ``host_compute_s`` (``_Step.host_compute_s``).  Reads
        the outstanding device events first."""
        self._flush()
        return {name: [getattr(s, name) for s in self._steps]
                for name in ("data_wait_s", "compute_s", "step_time_s", "loader_s", "lead_s", "host_compute_s")}

    def step_data_waits_s(self) -> list[float]:
        """This epoch's data wait of every step so far, in step order (what the peers attribute their slow steps
        by; every rank runs the same number of steps, so indices line up)."""
        return [s.data_wait_s for s in self._steps]

    def epoch_summary(self, *, rank: int, epoch: int, batch_size: int, num_workers: int,
                      peer_data_waits_s: Sequence[Sequence[float]] = (),
                      job_workers: Sequence[int] = (), fill_steps: int = 0, drain_steps: int = 0) -> StepStats:
        """Means over this epoch's valid steps (after warm-up) as a StepStats; never NaN.

        ``num_steps`` is the number of steps averaged; 0 (with zero times) when none was valid, which the
        re-planner refuses as too few.  ``peer_data_waits_s``: the other ranks' ``step_data_waits_s`` (this
        rank's own may be among them); steps where a peer was late are left out of ``compute_s`` (module
        docstring).  ``job_workers``: every rank's DataLoader workers (the plan's), when the batches come from
        DataLoaders: ``step_time_s`` and ``data_wait_s`` are then the means over the last whole worker cycles
        (``worker_cycle``), the only windows in which a loader-paced step's mean is its loader's pace.
        ``fill_steps`` / ``drain_steps``: steps at the epoch's start in which the job's DataLoaders fill their
        pipelines (every worker building its prefetch at once: planner.cli.steps.loader_drain_steps of the most
        workers), and at its end in which they drain (every remaining batch already handed to a worker, so the
        workers fall idle and the GPU runs on batches built before: the most workers x their prefetch).  When at
        least ``STEADY_MIN_CYCLES`` whole worker cycles lie between the two, the step time, data wait and build
        time are that steady middle's (its last whole cycles), and ``fill_steps`` / ``fill_excess_s`` say what
        the epoch start cost on top; otherwise the epoch has no steady middle, and the means stay over its last
        whole cycles (``fill_steps`` 0).  On 2x H100, rank 0 with 28 workers of 4 prefetched batches
        (fill 140 steps, drain 112): a 200-step epoch has no steady middle -- its first 144 steps took 26-33 s
        with up to 32-35 runnable threads on the host's 32 cores, its last 56 ran at the GPU's pace on batches
        built before, ~4 cores busy (docs/PERFORMANCE.md).  Neither is the pace of a long epoch.  An
        epoch of a loader that runs across epoch boundaries (runtime.sampler.EpochStream) fills only when its
        stream starts and drains only where it ends: pass 0 for what the epoch lacks.
        """
        self._flush()
        start = self.warmup_steps if self.warmup_steps and len(self._steps) > 2 * self.warmup_steps else 0
        late = self._peer_late(peer_data_waits_s)
        compiled, compile_s = self._compile_steps()
        indexed = [(i, s) for i, s in enumerate(self._steps) if i >= start]
        good_idx = [(i, s) for i, s in indexed
                    if _valid(s.data_wait_s) and _valid(s.compute_s) and _valid(s.step_time_s) and i not in compiled]
        good = [s for _, s in good_idx]
        self.num_dropped = len(indexed) - len(good) - len([i for i, _ in indexed if i in compiled])
        n = len(good)
        if n == 0:
            return StepStats(rank=rank, epoch=epoch, num_steps=0, batch_size=batch_size, num_workers=num_workers,
                             data_wait_s=0.0, compute_s=0.0, step_time_s=0.0, compute_s_std=0.0,
                             compile_steps=len(compiled), compile_s=compile_s)
        all_compute = [float(s.compute_s) for s in good]  # type: ignore[arg-type]
        clean = [float(s.compute_s) for i, s in good_idx if i not in late]  # type: ignore[arg-type]
        compute = clean if len(clean) >= max(1.0, MIN_CLEAN_FRACTION * n) else all_compute
        num_late = n - len(compute)
        med = statistics.median(compute)
        mad = statistics.median(abs(c - med) for c in compute)
        # Outliers: more than OUTLIER_SIGMAS robust sigmas from the median.  If that flags a large part of the
        # epoch, the "tail" is the distribution itself (e.g. alternating step sizes), and every step counts.
        limit = OUTLIER_SIGMAS * 1.4826 * mad
        inliers = [c for c in compute if abs(c - med) <= limit] if mad > 0 else compute
        if len(inliers) < (1.0 - MAX_OUTLIER_FRACTION) * len(compute):
            inliers = compute
        k = len(inliers)
        step_times = [float(s.step_time_s) for s in good]  # type: ignore[arg-type]
        waits = [float(s.data_wait_s) for s in good]  # type: ignore[arg-type]
        cycle = worker_cycle(job_workers, n)
        fill = max(0, fill_steps - start)  # fill steps left after the warm-up
        end = n - max(0, drain_steps)
        if (end - fill) // cycle < STEADY_MIN_CYCLES:
            fill, end = 0, n  # no steady middle to measure: the whole epoch is its loaders' fill and drain
        windowed = fill > 0 or end < n
        whole = ((end - fill) // cycle) * cycle  # the last whole cycles before the drain (all steps when cycle is 1)
        paced = step_times[end - whole:end]
        paced_waits = waits[end - whole:end]
        steady = math.fsum(paced) / len(paced)
        head = start + end - whole  # every step before the steady window, warm-up included
        head_times = [float(s.step_time_s) for i, s in enumerate(self._steps[:head])  # type: ignore[arg-type]
                      if _valid(s.step_time_s) and i not in compiled]
        fill_excess = max(0.0, math.fsum(head_times) - steady * len(head_times)) if fill else 0.0
        mean_c = math.fsum(inliers) / k
        # Sample std (k - 1): the re-planner turns it into a standard error, std / sqrt(n).
        std_c = math.sqrt(math.fsum((c - mean_c) ** 2 for c in inliers) / (k - 1)) if k > 1 else 0.0
        # Interference: the mean compute over every step minus this rank's own (the peer-late steps' excess).
        interference = max(0.0, math.fsum(all_compute) / n - math.fsum(compute) / len(compute)) if num_late else 0.0
        loader_s = (_mean_build_s(self._steps[head:head + whole], 0, need=max(1.0, MIN_CLEAN_FRACTION * whole))
                    if windowed else _mean_build_s(self._steps, num_workers, need=max(1.0, MIN_CLEAN_FRACTION * n)))
        return StepStats(
            rank=rank,
            epoch=epoch,
            num_steps=n,
            batch_size=batch_size,
            num_workers=num_workers,
            data_wait_s=math.fsum(paced_waits) / len(paced_waits),
            compute_s=mean_c,
            step_time_s=steady,
            compute_s_std=std_c,
            compute_s_median=med,
            compute_s_mad=mad,
            num_outliers=len(compute) - k,
            step_time_s_std=statistics.stdev(step_times) if n > 1 else 0.0,
            num_peer_late=num_late,
            interference_s=interference,
            loader_s=loader_s,
            fill_steps=head if fill else 0,
            fill_excess_s=fill_excess,
            drain_steps=min(n, max(0, drain_steps)),
            compile_steps=len(compiled),
            compile_s=compile_s,
        )

    def _compile_steps(self) -> tuple[set[int], float]:
        """(indices of the epoch's compile steps, their seconds beyond the median step): compute over
        ``COMPILE_FACTOR`` x the median compute of the epoch's valid steps and at least ``COMPILE_MIN_S``, among the
        warm-up steps, the ``COMPILE_FIRST_STEPS`` after them and the last (module docstring), warm-up steps included."""
        valid = [(i, float(s.compute_s), float(s.step_time_s)) for i, s in enumerate(self._steps)  # type: ignore[arg-type]
                 if _valid(s.compute_s) and _valid(s.step_time_s) and _valid(s.data_wait_s)]
        if len(valid) < 2:
            return set(), 0.0
        med = statistics.median(c for _, c, _ in valid)
        last = len(self._steps) - 1
        out = {i for i, c, _ in valid
               if (i < self.warmup_steps + COMPILE_FIRST_STEPS or i == last) and c >= COMPILE_MIN_S and c > COMPILE_FACTOR * med}
        if not out:
            return set(), 0.0
        med_step = statistics.median(t for i, _, t in valid if i not in out) if len(out) < len(valid) else 0.0
        return out, math.fsum(max(0.0, t - med_step) for i, _, t in valid if i in out)

    def _peer_late(self, peers: Sequence[Sequence[float]]) -> set[int]:
        """Step indices whose compute a late peer may have stretched: a peer waited for data more than the
        threshold longer than this rank in that step; the step after it is included (a late all-reduce also
        delays what this rank launches next)."""
        own = self.step_data_waits_s()
        computes = [float(s.compute_s) for s in self._steps if _valid(s.compute_s)]  # type: ignore[arg-type]
        if not peers or not computes:
            return set()
        limit = max(PEER_LATE_MIN_S, PEER_LATE_FRAC * statistics.median(computes))
        late: set[int] = set()
        for i, mine in enumerate(own):
            worst = max((p[i] for p in peers if i < len(p) and math.isfinite(p[i])), default=0.0)
            if worst - mine > limit:
                late.update((i, i + 1))
        return late


class ComputeStart:
    """Opens a timer's compute span where the model's own forward begins: after DDP's forward-start work.

    ``DistributedDataParallel`` (``broadcast_buffers=True``, its default) broadcasts the module's buffers from
    rank 0 at the start of every training forward -- a collective.  A rank that starts its step ahead of a late
    peer waits in it, so a span opened before ``ddp(x)`` counts that wait as the rank's own compute.  On
    2x H200 (the skew case, docs/PERFORMANCE.md) the rank that never waited for data had the long
    compute spans (p90 96-120 ms on a median of 83.5), 57 of its 60 long ones in steps it started ahead of its
    data-starved peer, the span tracking the head start with a correlation of 0.98-1.00.
    Under DDP this instance registers a forward pre-hook on the wrapped module; calling it arms the hook, which
    opens the span once, when DDP hands the batch to the module.  The wait moves from ``compute_s`` to the step's
    ``lead_s``.  Without DDP (one rank, FSDP2) calling it opens the span at once.  Call it right before the step's
    first forward (``compute_start``'s place)."""

    def __init__(self, model: torch.nn.Module, timer: StepTimer) -> None:
        self._timer = timer
        self._armed = False
        inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None
        self.hooked = isinstance(inner, torch.nn.Module)
        if self.hooked:
            inner.register_forward_pre_hook(self._fire)  # type: ignore[union-attr]

    def __call__(self) -> None:
        if self.hooked:
            self._armed = True
        else:
            self._timer.compute_start()

    def _fire(self, _module: Any, _args: Any) -> None:
        if self._armed:  # once a step: the emulation's extra passes call the module again
            self._armed = False
            self._timer.compute_start()


def close_compute_on_last_gradient(model: torch.nn.Module, timer: StepTimer,
                                   when: Callable[[], bool] | None = None) -> None:
    """Close the timer's compute span when backward accumulates the model's first parameter's gradient.

    The first parameter (the input layer's weight) gets its gradient last in backward, so this marks "local
    compute done" -- before DDP's final all-reduce wait, like the comm hook's ``on_last_bucket`` -- with one
    Python call per step and no comm hook. A step where it does not fire (an unused first parameter) falls back to
    the after-``backward()`` call, which includes the wait for peers.

    ``when``: with gradient accumulation, only the backward of a step's last micro-batch closes the span (the
    earlier ones accumulate locally), so the caller says when that is.
    """
    first = next((p for p in model.parameters() if p.requires_grad), None)
    if first is not None:
        first.register_post_accumulate_grad_hook(
            lambda _p: timer.compute_end() if when is None or when() else None)


def peer_data_waits(timer: StepTimer) -> list[list[float]]:
    """Collective (when torch.distributed is initialized with several ranks): every rank's per-step data waits
    of this epoch, for ``epoch_summary(peer_data_waits_s=...)``; one small JSON all-gather per epoch (4 decimals of
    a second, ~8 bytes a step).  Without a process group: this rank's own only."""
    mine = [round(x, 4) if math.isfinite(x) else -1.0 for x in timer.step_data_waits_s()]
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [mine]
    return [[float(x) for x in g] for g in all_gather_json(mine)]
