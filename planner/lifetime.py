"""A command's processes end with it: SIGTERM stops a command the way Ctrl-C does, and the processes it starts
die when it dies.

- ``terminate_as_interrupt``: SIGTERM (what ``kill``, Slurm and a scheduler's preemption send) raises
  ``Terminated``, a ``KeyboardInterrupt``, so every cleanup that Ctrl-C runs runs for it too: children killed in
  ``finally``, the run log's end record, a checkpoint's half-written temp file removed.  A second SIGTERM kills at
  once (the default action is back once the first is taken).
- ``die_with_parent``: a child asks the kernel to send it a signal when its parent ends (Linux
  ``prctl(PR_SET_PDEATHSIG)``), which also covers a parent killed by SIGKILL, where no ``finally`` runs: the bench's
  fork server and ranks, the demo's stage commands.

Pure: the standard library only.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

PR_SET_PDEATHSIG = 1


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: handled wherever Ctrl-C is."""


def _on_sigterm(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise Terminated("terminated (SIGTERM)")


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises ``Terminated`` in the main thread.  Only where SIGTERM has its default
    action and this is the main thread: a handler a framework or the user installed is kept."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


_LIBC: Any = None


def _libc() -> Any:
    """The C library, loaded once (before a fork: a ``preexec_fn`` must not import or load anything)."""
    global _LIBC
    if _LIBC is None:
        import ctypes

        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> bool:
    """Ask the kernel to send this process ``sig`` when its parent ends (Linux; elsewhere nothing: False).

    ``parent``: the pid the parent had before this process started; if it is already gone (it died before the
    request took effect), this process exits at once."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        if _libc().prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent is not None and os.getppid() != parent:
        os._exit(128 + int(sig))
    return True


def child_dies_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``subprocess.Popen(preexec_fn=...)`` that ties the child to this process: ``sig`` when it ends
    (SIGTERM for a launcher such as torchrun, which forwards it to its workers); None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        _libc()
    except OSError:
        return None
    parent = os.getpid()

    def tie() -> None:
        die_with_parent(sig, parent)

    return tie


__all__ = ["Terminated", "child_dies_with_parent", "die_with_parent", "terminate_as_interrupt"]
