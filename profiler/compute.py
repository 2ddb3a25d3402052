"""Timing full training steps (forward, backward, SGD step) of one rank alone, no communication.

``StepRunner`` owns a fresh model and optimizer on the device and implements the sweep's ``measure`` callable
(profiler.sweep decides which batches and how many repeats).  Inputs come from ``synthetic_batch`` and are created
on the device once per batch size, so the loader never enters compute timing.

Synchronization: on CUDA each timed step is bracketed by ``torch.cuda.synchronize()`` and timed with the host's
``perf_counter`` -- the launch queue is empty when the timer starts and the last kernel done when it stops;
at >= 1 ms per step the microseconds the sync itself costs are noise.  On CPU the ops are synchronous.

Running out of memory raises ``torch.cuda.OutOfMemoryError``; the runner frees what the failed step held
(grads, ``gc.collect()``, ``torch.cuda.empty_cache()``) and raises ``DoesNotFit`` so the sweep can stop and
profiler.memory can search the largest batch that fits.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable
from typing import Any

import torch

from profiler.sweep import DoesNotFit, Measurement
from workloads.emulate import Slowdown
from workloads.specs import Workload, synthetic_batch


def use_channels_last(workload: Workload, device: torch.device, channels_last: bool | None) -> bool:
    """channels_last by default for image models on CUDA (what fast conv training uses), off elsewhere."""
    if channels_last is None:
        return device.type == "cuda" and len(workload.sample_shape) == 3
    return channels_last and len(workload.sample_shape) == 3


class StepRunner:
    """A model + SGD optimizer on one device; ``measure(b, warmup, repeats)`` times full training steps."""

    def __init__(self, workload: Workload, device: torch.device | str, *, amp: bool = False,
                 channels_last: bool | None = None, slowdown: float = 1.0, lr: float = 1e-4,
                 timer: Callable[[], float] = time.perf_counter) -> None:
        self.timer = timer
        """Host clock for a step (tests on a shared CPU pass time.thread_time: CPU time survives preemption)."""
        self.workload = workload
        self.device = torch.device(device)
        self.amp = amp
        self.channels_last = use_channels_last(workload, self.device, channels_last)
        self.slowdown = Slowdown(slowdown)
        model = workload.model_fn().to(self.device)
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        model.train()
        self.model = model
        # A small lr keeps weights finite over hundreds of random-data steps (NaNs/denormals change CPU timing).
        self.optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        self._batch: tuple[int, Any, Any] | None = None

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def grad_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if not self.amp:
            return contextlib.nullcontext()
        # bf16 needs no loss scaler; on CPU autocast bf16 is supported too (slow, but it keeps the code path one).
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def _inputs(self, b: int) -> tuple[Any, Any]:
        if self._batch is None or self._batch[0] != b:
            self._batch = None  # drop the old batch before allocating the new one
            # Inputs in the model's own float dtype (a float64 model gets float64 data).
            dtype = next((q.dtype for q in self.model.parameters() if q.is_floating_point()), None)
            x, y = synthetic_batch(self.workload, b, self.device, dtype=dtype)
            if self.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            self._batch = (b, x, y)
        return self._batch[1], self._batch[2]

    def step(self, x: Any, y: Any) -> None:
        """One full training step: (emulated extra work), forward, backward, optimizer."""
        with self._autocast():
            self.slowdown.apply(self.model, self.workload.loss_fn, x, y)
            loss = self.workload.loss_fn(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def measure(self, batch_size: int, warmup: int, repeats: int) -> Measurement:
        """Run `warmup` untimed then `repeats` timed steps at `batch_size` (the sweep's Measure)."""
        cuda = self.device.type == "cuda"
        oom = False
        try:
            x, y = self._inputs(batch_size)
            if cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            for _ in range(warmup):
                self.step(x, y)
            times = []
            for _ in range(repeats):
                self._sync()
                t0 = self.timer()
                self.step(x, y)
                self._sync()
                times.append(self.timer() - t0)
            peak = int(torch.cuda.max_memory_allocated(self.device)) if cuda else None
        except torch.cuda.OutOfMemoryError:
            oom = True
        if oom:
            # Freed outside the except block: the live traceback would keep the failed step's tensors alive.
            x = y = None
            self.free()
            raise DoesNotFit(batch_size)
        return Measurement(times_s=tuple(times), peak_bytes=peak)

    def fits(self, batch_size: int) -> bool:
        """True when one training step at this batch runs without running out of memory."""
        try:
            self.measure(batch_size, 0, 1)
        except DoesNotFit:
            return False
        return True

    def free(self) -> None:
        """Release what a failed (or finished) step holds, so the next attempt starts from a clean allocator."""
        self._batch = None
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def close(self) -> None:
        self.free()
        del self.model, self.optimizer
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
