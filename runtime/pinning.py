"""Pin a DataLoader's batches a bounded number of steps ahead of the training loop.

A library piece for a script that must bound its pinned memory; `planner train` does not use it: it bounds the
pinned pool, but on a loader-fed rank it is slower than the DataLoader's own pinning (2x H100, the loader case: a
clean epoch at 0.829-0.840 of the prediction by the wall clock, median, against 0.947 with ``pin_memory=True``; rank
0 waited 24-41 ms a step for data against 3-5; docs/PERFORMANCE.md). The likely cause: the DataLoader's pin thread
takes batches in the order the workers finish them, so the ones finished behind a late batch are already pinned when
it arrives; ``PinAhead`` takes them from the DataLoader in order and pins each only then, which costs a step's time
on a rank whose copy takes about as long as its step.

``DataLoader(pin_memory=True)`` pins every batch its workers finish, as soon as it arrives: up to ``workers x
prefetch_factor`` batches wait in pinned memory when the workers run ahead of the GPU.  Each new pinned block is a
``cudaHostAlloc``, and while one runs the driver serializes the process's other CUDA calls (pytorch#97432,
pytorch#108488).  Measured on 2x H100 (`planner train --auto --emulate-loader 1=2`, ResNet-50 bf16, 28 workers of
287 MB batches, docs/PERFORMANCE.md): rank 0's pinned pool still grew by 6-19 blocks an epoch in the
steady epochs 1-2, each ~100 ms of ``cudaHostAlloc``, to 15-25 GB; its compute (forward start to last gradient
bucket, GPU events) had a steady median of 115-116 ms and means up to 130 ms from steps 20-80 ms long.

``PinAhead`` keeps the DataLoader unpinned (``pin_memory=False``) and pins in its own thread, at most ``depth``
batches ahead of the consumer: the pinned pool holds ``depth`` + 2 batches (the queue, the one being pinned, the one
the device copy still reads), its blocks are reused from the first steps on, and the workers' batches wait in
shared memory instead, as they do without pinning.  The copy into pinned memory (``pin_tree``) is the DataLoader's
own, with a large tensor split across ``PIN_THREADS`` threads at once (``Tensor.copy_`` releases the GIL; small ones whole);
a profile given ``loader_pin=pin_tree`` times the same copy (``LoaderProfile.handover_bytes_per_s``).  On 2x
H200 with a one-thread copy 2 batches ahead rank 0 still waited 33-50 ms a step (2.5 GB/s delivered);
hence 4 threads and 4 batches ahead (docs/PERFORMANCE.md).

    batches = PinAhead(iter(loader), torch.device("cuda", local_rank))   # loader built with pin_memory=False
    for x, y in batches:
        x = x.to(device, non_blocking=True)
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

PIN_AHEAD = 4
"""Batches pinned ahead of the training loop.  More than one: the pinning thread is nearly as busy as the loop on a
loader-fed rank (2x H100 under load: one thread pinned a 287 MB batch in 116 ms, the step took 116 ms), and a
thread that stops whenever its queue is full loses the time the loop runs slow.  With depth 2 rank 0 waited
17-48 ms a step for data where the DataLoader's own unbounded pinning waited 1.5-8 ms (same card).
The pool stays at ``depth`` + 2 batches (about 1.7 GB at 287 MB) however many workers build ahead."""

_POLL_S = 0.1
"""How often a blocked put looks whether the consumer has gone (``close``)."""


PIN_THREADS = max(1, int(os.environ.get("PLANNER_PIN_THREADS", "4") or "4"))
"""Threads a large tensor's copy into pinned memory is split across (``PLANNER_PIN_THREADS``; 1: one core, as the
DataLoader's own pin thread).  Measured on 2x H100 (28 workers, 476-sample
batches, one and four pinning threads against the DataLoader's): 287 MB batches handed
over at 2.25 GB/s by the DataLoader's pinning, 2.46 by one thread, 3.51 by four (81.5 ms a batch against 116)."""
PIN_SLICE_BYTES = 16 << 20
"""Smallest slice worth a thread of its own: smaller tensors are pinned whole, on the calling thread (the profile's
hand-over reading pins 256 MiB batches, profiler.loader.HANDOVER_BYTES, which split as training's do)."""

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _copy_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(4, PIN_THREADS), thread_name_prefix="pin-copy")
        return _pool


def pin_tensor(t: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """``t`` copied into pinned memory (``t`` itself when it is not a CPU tensor or already pinned); a contiguous
    tensor of at least two ``PIN_SLICE_BYTES`` is copied in up to ``threads`` (default ``PIN_THREADS``) slices at
    once."""
    if t.device.type != "cpu" or t.is_pinned():
        return t
    slices = min(PIN_THREADS if threads is None else threads, t.numel() * t.element_size() // PIN_SLICE_BYTES)
    if slices <= 1 or not t.is_contiguous():
        return t.pin_memory()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    src, dst = t.view(-1), out.view(-1)
    n = src.numel()
    step, pool = -(-n // slices), _copy_pool()
    jobs = [pool.submit(dst[i:i + step].copy_, src[i:i + step]) for i in range(0, n, step)]
    for job in jobs:
        job.result()
    return out


def pin_tree(obj: Any, threads: int | None = None) -> Any:
    """``obj`` with every CPU tensor in it (any nesting of tuples, namedtuples, lists and dicts) copied to pinned
    memory (``pin_tensor``)."""
    return tree_map_only(torch.Tensor, lambda t: pin_tensor(t, threads), obj)


class _End:
    """The source is exhausted (``error``: it raised)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


def _put(q: queue.Queue[Any], stop: threading.Event, item: Any) -> bool:
    """Put ``item`` once there is room; False when the consumer stopped first."""
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _pin_loop(source: Iterator[Any], device: torch.device | None, pin: Callable[[Any], Any], q: queue.Queue[Any],
              stop: threading.Event) -> None:
    """The thread: pin each item of ``source`` into ``q``, then an ``_End``.  It holds no reference to its
    ``PinAhead``, so a consumer that drops the iterator lets it be collected, which stops the thread."""
    end = _End()
    try:
        if device is not None and device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)  # as the DataLoader's own pin thread: pin under the rank's context
        for item in source:
            if not _put(q, stop, pin(item)):
                return
    except BaseException as e:  # every error reaches the consumer
        end = _End(e)
    _put(q, stop, end)


class PinAhead:
    """Iterate ``source`` with each item pinned (``pin_tree``) by a background thread at most ``depth`` items ahead.

    The source's exceptions re-raise in the consumer; ``close`` (or dropping the iterator) stops the thread, which
    then drops its reference to the source (a DataLoader iterator shuts its workers down when the last one goes).
    ``device``: the CUDA device whose context the thread pins under (the rank's); ``pin``: what is done to each
    item (default ``pin_tree``)."""

    def __init__(self, source: Iterator[Any], device: torch.device | None = None, depth: int = PIN_AHEAD,
                 pin: Callable[[Any], Any] | None = None) -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=_pin_loop,
                                        args=(source, device, pin or pin_tree, self._queue, self._stop),
                                        daemon=True, name="pin-ahead")
        self._thread.start()

    def __iter__(self) -> PinAhead:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():  # it died without a word: never hang
                    self._done = True
                    raise RuntimeError("the pinning thread stopped without finishing its batches") from None
        if isinstance(item, _End):
            self._done = True
            self._thread.join(timeout=5 * _POLL_S)
            if item.error is not None:
                raise item.error
            raise StopIteration
        return item

    def close(self) -> None:
        """Stop pinning and let the thread (and its source) go; items not taken are dropped."""
        self._done = True
        self._stop.set()
        while True:  # empty the queue so a thread blocked on put sees the stop at once
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=10 * _POLL_S)

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)  # None: __init__ refused its arguments
        if stop is not None:
            stop.set()
