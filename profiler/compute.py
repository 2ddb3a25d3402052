"""Timing full training steps (forward, backward, optimizer step) of one rank alone, no communication.

``TimedSteps`` implements the sweep's ``measure`` callable for any training step: a model and optimizer on the
device, a batch of size b (made once per size, so the loader never enters compute timing) and one step on it.
``StepRunner`` is the step `planner profile` times: a workload's model, SGD, synthetic inputs from
``synthetic_batch`` and the emulated slowdown; profiler.api times a user's own model, batch and loss with the same
code (profiler.sweep decides which batches and how many repeats).

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
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from profiler.sweep import DoesNotFit, Measurement
from profiler.workloads.emulate import Slowdown
from profiler.workloads.specs import Workload, synthetic_batch
from runtime.workload import model_fingerprint

if TYPE_CHECKING:
    from profiler.compiled import CompiledStep


def use_channels_last(workload: Workload, device: torch.device, channels_last: bool | None) -> bool:
    """channels_last by default for image models on CUDA (what fast conv training uses), off elsewhere."""
    if channels_last is None:
        return device.type == "cuda" and len(workload.sample_shape) == 3
    return channels_last and len(workload.sample_shape) == 3


class TimedSteps:
    """A model + optimizer on one device; ``measure(b, warmup, repeats)`` times full training steps.

    Subclasses say what a batch is (``make_batch``) and what one step's loss is (``loss``); this class owns the
    timing, the synchronization, out-of-memory recovery and the optimizer step.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device | str, *,
                 optimizer_fn: Callable[[torch.nn.Module], torch.optim.Optimizer], amp: bool = False,
                 timer: Callable[[], float] = time.perf_counter) -> None:
        self.timer = timer
        """Host clock for a step (tests on a shared CPU pass time.thread_time: CPU time survives preemption)."""
        self.device = torch.device(device)
        self.amp = amp
        model.train()
        self.model = model
        self.optimizer = optimizer_fn(model)
        self._batch: tuple[int, Any] | None = None
        self.compiled: CompiledStep | None = None
        """Set by profiler.compiled.compile_runner: steps run through its torch.compile'd module, a new batch is
        marked dynamic, and each size's first step is timed apart (the compile)."""

    # -- what a subclass defines ---------------------------------------------------------------------------
    def make_batch(self, batch_size: int) -> Any:
        """A batch of ``batch_size`` samples on the device."""
        raise NotImplementedError

    def loss(self, module: torch.nn.Module, batch: Any) -> torch.Tensor:
        """Forward and loss of one step through ``module`` (the model, or its DDP wrapper in profiler.ddp)."""
        raise NotImplementedError

    # -- one step ------------------------------------------------------------------------------------------
    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def structure(self) -> str:
        """The model's structural fingerprint (runtime.workload.model_fingerprint): what a plan records."""
        return model_fingerprint(self.model)

    @property
    def grad_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if not self.amp:
            return contextlib.nullcontext()
        # bf16 needs no loss scaler; on CPU autocast bf16 is supported too (slow, but it keeps the code path one).
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def batch_for(self, batch_size: int) -> Any:
        """The cached batch of this size (the previous size's batch is dropped first)."""
        if self._batch is None or self._batch[0] != batch_size:
            self._batch = None  # drop the old batch before allocating the new one
            self._batch = (batch_size, self.make_batch(batch_size))
            if self.compiled is not None:
                self.compiled.mark(self._batch[1])
        return self._batch[1]

    def train_step(self, batch: Any, module: torch.nn.Module | None = None) -> None:
        """One full training step: forward and loss (inside autocast), backward, optimizer."""
        if module is None:
            module = self.model if self.compiled is None else self.compiled.module
        with self.autocast():
            loss = self.loss(module, batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def timed_step(self, batch: Any) -> float:
        """Seconds of one synchronized training step on ``batch``."""
        self._sync()
        t0 = self.timer()
        self.train_step(batch)
        self._sync()
        return self.timer() - t0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def optimizer_step_s(self, batch_size: int, repeats: int = 10) -> float:
        """Median seconds of one ``optimizer.step()`` (its cost does not depend on the batch): the part of a step
        that gradient accumulation pays once per optimizer step rather than once per micro-batch."""
        batch = self.batch_for(batch_size)
        with self.autocast():
            loss = self.loss(self.model, batch)
        loss.backward()  # gradients to step on (kept: every timed step sees the same state)
        self.optimizer.step()  # warm-up: lazily created optimizer state
        times = []
        for _ in range(repeats):
            self._sync()
            t0 = self.timer()
            self.optimizer.step()
            self._sync()
            times.append(self.timer() - t0)
        self.optimizer.zero_grad(set_to_none=True)
        return float(statistics.median(times))

    def micro_step(self, batches: list[Any]) -> None:
        """One optimizer step over several micro-batches (gradient accumulation, as the trainer runs it)."""
        module = self.model if self.compiled is None else self.compiled.module
        for batch in batches:
            with self.autocast():
                loss = self.loss(module, batch)
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def measure(self, batch_size: int, warmup: int, repeats: int) -> Measurement:
        """Run `warmup` untimed then `repeats` timed steps at `batch_size` (the sweep's Measure).  Compiled: a new
        size's first step runs before the warm-up, timed apart (profiler.compiled.CompiledStep.measure)."""
        if self.compiled is not None:
            return self.compiled.measure(self, batch_size, warmup, repeats, self._measure)
        return self._measure(batch_size, warmup, repeats)

    def _measure(self, batch_size: int, warmup: int, repeats: int) -> Measurement:
        cuda = self.device.type == "cuda"
        oom = False
        try:
            batch = self.batch_for(batch_size)
            if cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            for _ in range(warmup):
                self.train_step(batch)
            times = [self.timed_step(batch) for _ in range(repeats)]
            peak = int(torch.cuda.max_memory_allocated(self.device)) if cuda else None
        except torch.cuda.OutOfMemoryError:
            oom = True
        if oom:
            # Freed outside the except block: the live traceback would keep the failed step's tensors alive.
            batch = None
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
        if self.compiled is not None:  # the compiled wrapper holds the model: it goes too, its record stays
            self._compile_record: dict[str, Any] | None = self.compiled.record()
            self.compiled = None
        del self.model, self.optimizer
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def meta(self) -> dict[str, Any]:
        """Facts for the rank profile's meta (what a DDP measurement must rebuild the same way)."""
        return {"amp": "bf16" if self.amp else None,
                "compile": self.compiled.record() if self.compiled is not None
                else getattr(self, "_compile_record", None)}


class StepRunner(TimedSteps):
    """A workload's model + SGD on one device, fed synthetic inputs: the step `planner profile` times."""

    def __init__(self, workload: Workload, device: torch.device | str, *, amp: bool = False,
                 channels_last: bool | None = None, slowdown: float | Slowdown = 1.0, lr: float = 1e-4,
                 timer: Callable[[], float] = time.perf_counter) -> None:
        self.workload = workload
        dev = torch.device(device)
        self.channels_last = use_channels_last(workload, dev, channels_last)
        self.slowdown = slowdown if isinstance(slowdown, Slowdown) else Slowdown(slowdown)
        model = workload.model_fn().to(dev)
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        # A small lr keeps weights finite over hundreds of random-data steps (NaNs/denormals change CPU timing).
        super().__init__(model, dev, amp=amp, timer=timer,
                         optimizer_fn=lambda m: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9))

    def make_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Inputs in the model's own float dtype (a float64 model gets float64 data).
        dtype = next((q.dtype for q in self.model.parameters() if q.is_floating_point()), None)
        x, y = synthetic_batch(self.workload, batch_size, self.device, dtype=dtype)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y

    def loss(self, module: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        # Emulated extra work where the trainer does it (profiler.workloads.emulate); Slowdown unwraps a DDP module.
        self.slowdown.apply(module, self.workload.loss_fn, x, y)
        return self.workload.loss_fn(module(x), y)

    def step(self, x: Any, y: Any) -> None:
        """One full training step on (x, y): (emulated extra work), forward, backward, optimizer."""
        self.train_step((x, y))

    def meta(self) -> dict[str, Any]:
        return {**super().meta(), "channels_last": self.channels_last,
                "emulate_slowdown": self.slowdown.factor if self.slowdown.enabled else None,
                "emulate_mode": self.slowdown.mode if self.slowdown.enabled else None}
