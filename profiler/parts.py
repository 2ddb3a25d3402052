"""The parts of a profile, timed, and the one part that runs beside another.

A 4-rank torchrun profile of ResNet-50 takes tens of seconds (43 s on 4x H100, median of 3); to cut it one has to
see where the time goes.
``Parts`` times each named part of a rank's profile (compute sweep, memory search, optimizer step, loader, DDP
cost) into the rank's meta (``profile_parts_s``) and says each one's seconds as it ends, so `--verbose`/progress
shows the budget per part.

``Background`` runs the dataloader measurement beside the GPU sweep: the loader is CPU work, the GPU sweep
mostly waits on the device, so on a CUDA rank the two overlap and the profile takes the longer of them instead
of their sum.  It starts once the sweep's steps are long enough that a busy CPU does not move them (a
launch-bound small batch would read slower while another thread holds the interpreter) -- or when the sweep ends.
The thread takes part in the loader's barriers (its turns, profiler.run.in_turn); the main thread issues no
collective until it has joined, so the ranks' collectives keep one order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar, cast

T = TypeVar("T")


class Parts:
    """Seconds per named part; ``say`` hears "<part>: 12.3 s" as each part ends."""

    def __init__(self, say: Callable[[str], None] | None = None, *, clock: Callable[[], float] = time.perf_counter) -> None:
        self.seconds: dict[str, float] = {}
        self._say = say
        self._clock = clock

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        t0 = self._clock()
        try:
            yield
        finally:
            self.add(name, self._clock() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = round(self.seconds.get(name, 0.0) + seconds, 3)
        if self._say is not None:
            self._say(f"{name}: {seconds:.1f} s")

    def summary(self) -> str:
        """One line: every part's seconds, in the order they ran."""
        return ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items())


class Background(Generic[T]):
    """``fn`` in a daemon thread, started by ``start`` (at most once); ``result`` joins it and re-raises its error."""

    def __init__(self, fn: Callable[[], T], name: str) -> None:
        self._fn = fn
        self._result: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.started_at: float | None = None
        self.elapsed_s = 0.0

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            self._result = self._fn()
        except BaseException as e:  # re-raised in the caller's thread by result()
            self._error = e
        finally:
            self.elapsed_s = time.perf_counter() - t0

    def start(self) -> None:
        if self.started_at is None:
            self.started_at = time.perf_counter()
            self._thread.start()

    @property
    def started(self) -> bool:
        return self.started_at is not None

    def result(self) -> T:
        self.start()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return cast(T, self._result)  # set by _run: fn returned (T may itself allow None)
