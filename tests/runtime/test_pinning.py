"""runtime.pinning.PinAhead: batches pinned by a background thread a bounded number of steps ahead of the loop.

A CPU-only torch cannot pin (no driver), so these tests hand PinAhead a stand-in for the pin and hold what does not
depend on it: order, the bound on how far ahead the thread pulls, errors reaching the consumer, and a consumer that
stops early (or drops the iterator) letting the thread and its DataLoader go."""

from __future__ import annotations

import gc
import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from runtime.loader_timing import TimedBatches, TimedLoader
from runtime.pinning import PIN_AHEAD, PinAhead, pin_tree


def _pinned(x: Any) -> tuple[str, Any]:
    return ("pinned", x)


class Counting:
    """An endless source that counts what was pulled from it."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.pulled = 0
        self.fail_at = fail_at

    def __iter__(self) -> Iterator[int]:
        while True:
            if self.fail_at is not None and self.pulled == self.fail_at:
                raise RuntimeError(f"worker died at item {self.pulled}")
            self.pulled += 1
            yield self.pulled - 1


def _threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "pin-ahead"}


def _wait(cond: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_every_item_in_order_through_the_pin() -> None:
    assert list(PinAhead(iter(range(7)), pin=_pinned)) == [("pinned", i) for i in range(7)]


def test_the_thread_pulls_at_most_depth_items_ahead_of_the_consumer() -> None:
    src = Counting()
    it = PinAhead(iter(src), depth=2, pin=_pinned)
    assert next(it) == ("pinned", 0)
    time.sleep(0.5)  # room for the thread to run as far ahead as it may
    # one taken, two in the queue, one pinned and waiting for room: never the DataLoader's whole prefetch
    assert src.pulled <= 1 + 2 + 1
    it.close()


def test_an_error_in_the_source_reaches_the_consumer_after_the_items_before_it() -> None:
    it = PinAhead(iter(Counting(fail_at=3)), pin=_pinned)
    assert [next(it) for _ in range(3)] == [("pinned", 0), ("pinned", 1), ("pinned", 2)]
    with pytest.raises(RuntimeError, match="worker died at item 3"):
        next(it)
    with pytest.raises(StopIteration):  # and it stays finished
        next(it)


def test_close_and_dropping_the_iterator_both_stop_the_thread() -> None:
    before = _threads()
    it = PinAhead(iter(Counting()), pin=_pinned)
    next(it)
    it.close()
    assert _wait(lambda: _threads() <= before)
    it2 = PinAhead(iter(Counting()), pin=_pinned)
    next(it2)
    del it2
    gc.collect()
    assert _wait(lambda: _threads() <= before)  # the thread holds no reference to its PinAhead


def test_depth_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="depth must be at least 1"):
        PinAhead(iter([]), depth=0)


def test_pin_tree_pins_every_cpu_tensor_and_keeps_the_structure(monkeypatch: pytest.MonkeyPatch) -> None:
    pinned: list[torch.Tensor] = []

    def fake_pin(self: torch.Tensor) -> torch.Tensor:
        pinned.append(self)
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    x, y = torch.ones(2, 3), torch.arange(2)
    out = pin_tree({"x": x, "rest": [y, 3, "label"]})
    assert set(out) == {"x", "rest"} and out["rest"][1:] == [3, "label"]
    assert torch.equal(out["x"], x) and torch.equal(out["rest"][0], y)
    assert len(pinned) == 2


def test_timed_loader_pins_ahead_over_a_real_dataloader_and_lets_its_workers_go(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pins: list[int] = []

    def fake_pin(self: torch.Tensor) -> torch.Tensor:
        pins.append(self.numel())
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    ds = [torch.full((2,), float(i)) for i in range(64)]
    seen: list[float] = []
    loader = TimedLoader(DataLoader(TimedBatches(ds), sampler=[[i, i + 1] for i in range(0, 64, 2)], batch_size=None,
                                    num_workers=2, persistent_workers=True, prefetch_factor=2),
                         on_batch=seen.append, pin_device=torch.device("cpu"))
    before = _threads()
    it = iter(loader)
    first = list(itertools.islice(it, 5))  # an epoch of a stream: StreamedEpochs slices one iterator
    assert [float(batch[0][0]) for batch in first] == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert len(seen) == 5 and all(s >= 0 for s in seen)  # the workers' build seconds still reach the timer
    assert 5 <= len(pins) <= 5 + PIN_AHEAD + 1  # pinned: the batches taken and at most PIN_AHEAD + 1 more
    rest = list(it)
    assert len(first) + len(rest) == 32 and len(pins) == 32
    del it
    gc.collect()
    assert _wait(lambda: _threads() <= before)


def test_a_large_tensor_is_copied_in_slices_across_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime import pinning as pp

    made: list[tuple[int, ...]] = []
    real_empty = torch.empty

    def empty_unpinned(*shape: Any, pin_memory: bool = False, **kw: Any) -> torch.Tensor:
        made.append(tuple(shape[0]))  # the pinned buffer; a CPU-only torch cannot pin, so a plain one stands in
        return real_empty(*shape, **kw)

    monkeypatch.setattr(pp.torch, "empty", empty_unpinned)
    monkeypatch.setattr(pp, "PIN_SLICE_BYTES", 1024)
    threads: set[str] = set()
    real_copy = torch.Tensor.copy_

    def copy_and_note(self: torch.Tensor, src: torch.Tensor, *a: Any) -> torch.Tensor:
        threads.add(threading.current_thread().name)
        return real_copy(self, src, *a)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_and_note)
    x = torch.randn(4, 3, 32, 32)  # 48 KiB: four slices of 1 KiB or more
    out = pp.pin_tensor(x, threads=4)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr() and made == [(4, 3, 32, 32)]
    assert threads and all(n.startswith("pin-copy") for n in threads)
    small = torch.randn(8)  # under two slices: pinned whole on the calling thread (Tensor.pin_memory)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self.clone())
    assert torch.equal(pp.pin_tensor(small), small) and made == [(4, 3, 32, 32)]


def test_a_failure_before_the_first_item_reaches_the_consumer_instead_of_hanging() -> None:
    # set_device refuses an index-less "cuda" in the thread; the consumer gets the error instead of hanging
    def broken_pin(item: Any) -> Any:
        raise ValueError("cannot pin this")

    it = PinAhead(iter(Counting()), pin=broken_pin)
    with pytest.raises(ValueError, match="cannot pin this"):
        next(it)


def test_an_index_less_cuda_device_is_not_set_in_the_thread() -> None:
    # torch.cuda.set_device("cuda") raises; the thread then pins under the current device, as the loop does
    it = PinAhead(iter(range(3)), torch.device("cuda"), pin=_pinned)
    assert list(it) == [("pinned", i) for i in range(3)]


def test_a_thread_that_dies_silently_does_not_hang_the_consumer(monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime import pinning as rp

    monkeypatch.setattr(rp, "_pin_loop", lambda *a: None)  # exits at once, puts nothing
    it = PinAhead(iter(range(3)), pin=_pinned)
    with pytest.raises(RuntimeError, match="stopped without finishing"):
        next(it)


def test_the_defaults_pin_big_batches_in_four_slices_four_batches_ahead() -> None:
    # 2x H100 (raw files in git history of docs/results): 4 copy threads handed a 287 MB batch over at 3.51 GB/s against
    # 2.46 for one, and one thread two batches ahead left rank 0 waiting 17-48 ms a step for data
    import os

    from runtime import pinning as pp

    if "PLANNER_PIN_THREADS" not in os.environ:
        assert pp.PIN_THREADS == 4
    assert pp.PIN_AHEAD == 4
    assert PinAhead(iter([]))._queue.maxsize == pp.PIN_AHEAD
