"""Progress lines for the long-running programs (profile, bench, train): never silent for more than a few seconds.

A newcomer who sees nothing for a minute assumes a hang.  ``Progress`` prints one line per phase or event on
stderr, prefixed with the program and the seconds since it started::

    [profile   3s] rank 0 (cpu): compute sweep, batch 16: 41.2 ms (7 steps)
    [train    21s] epoch 0: step 24/98, 2.9 steps/s, ETA 25 s

Frequent updates (one per training step) only replace the current status; it is printed when the phase changes
or ``interval_s`` after the last line.  A background thread prints the current status after ``interval_s``
without a line -- with the time it has lasted when it was already shown -- so a phase that takes longer than that
(one slow step, a big sweep point, a loader measurement) still shows a line at least every ``interval_s``.  Lines, not a redrawn bar: they
survive logs, CI and torchrun's interleaved output.  ``enabled=False`` (``--quiet``, ranks other than 0) makes
every call a no-op.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

DEFAULT_INTERVAL_S = 5.0
"""Half the 10 s a user waits before wondering whether anything happens."""


class Progress:
    """Status lines on a stream (stderr by default); use as a context manager to run the heartbeat."""

    def __init__(self, what: str, *, enabled: bool = True, interval_s: float = DEFAULT_INTERVAL_S,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what
        self.enabled = enabled
        self.interval_s = interval_s
        self._stream = stream
        self._clock = clock
        self._t0 = clock()
        self._last_print = self._t0
        self._status = ""
        self._status_since = self._t0
        self._status_printed = False
        self._phase = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what callers use ----------------------------------------------------------------------------------
    def __call__(self, text: str) -> None:
        """A new phase or event: printed now."""
        self._set(text, force=True)

    def update(self, text: str) -> None:
        """The current status of a running phase (e.g. every step): printed at most every ``interval_s``."""
        self._set(text, force=False)

    def phase(self, name: str) -> None:
        """A prefix for the following lines (bench: "strategy plan (3/4)"), announced now."""
        self._phase = name
        self._set("starting", force=True)

    # -- the heartbeat -------------------------------------------------------------------------------------
    def __enter__(self) -> Progress:
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._beat, name=f"progress-{self.what}", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s)
            self._thread = None

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s / 4):
            self.tick()

    def tick(self) -> bool:
        """Repeat the current status if nothing was printed for ``interval_s`` (what the heartbeat thread calls
        four times per interval); True when it printed."""
        if not self.enabled:
            return False
        with self._lock:
            now = self._clock()
            if self._status and now - self._last_print >= self.interval_s:
                # A status not shown yet (a step count moved on) is news; one already shown says how long it lasts.
                stuck = f" (still running, {now - self._status_since:.0f} s)" if self._status_printed else ""
                self._emit(self._status + stuck, now)
                self._status_printed = True
                return True
        return False

    # -- printing ------------------------------------------------------------------------------------------
    def _set(self, text: str, *, force: bool) -> None:
        if not self.enabled:
            return
        full = f"{self._phase}: {text}" if self._phase else text
        with self._lock:
            now = self._clock()
            if force or full != self._status:
                self._status_since, self._status_printed = now, False
            self._status = full
            if force or now - self._last_print >= self.interval_s:
                self._emit(full, now)
                self._status_printed = True

    def _emit(self, text: str, now: float) -> None:
        stream = self._stream or sys.stderr  # looked up late: pytest's capsys swaps sys.stderr per test
        print(f"[{self.what} {now - self._t0:4.0f}s] {text}", file=stream, flush=True)
        self._last_print = now


def no_progress() -> Progress:
    """A disabled reporter (library calls, other ranks): every method is a no-op."""
    return Progress("", enabled=False)
