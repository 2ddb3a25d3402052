"""Standard output that cannot take a command down: `planner ... | head -1` and `> /dev/full` lose the text, not
the work.

A failed write to stdout (EPIPE when the reader left, ENOSPC on a full disk) would raise out of a ``print``
wherever it happened -- in `planner bench`, before the JSON is written, so a minute of measurements would go with
it, as a traceback.  ``GuardedStdout`` remembers the first failure and drops the rest of the text; the command
finishes its files, and the CLI says at the end, in one line, what was lost (nothing for a closed pipe: the reader
chose to stop, as with any Unix tool).
"""

from __future__ import annotations

import errno
import re
from typing import IO, Any

_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u202a-\u202e\u2066-\u2069]")


def terminal_safe(text: str) -> str:
    """``text`` with every control character except newline and tab (ESC, CR, BEL, C1, bidi overrides) shown as
    its escape (``\\x1b``): device, host and model names come from files, and a name holding a terminal escape
    sequence would otherwise be run by the user's terminal when `plan` or `report` prints it."""
    return _UNSAFE.sub(lambda m: ascii(m.group())[1:-1], text)


class TerminalSafe:
    """A stand-in for ``sys.stderr`` that writes ``terminal_safe`` text."""

    def __init__(self, inner: IO[str]) -> None:
        self.inner = inner

    def write(self, text: str) -> int:
        self.inner.write(terminal_safe(text))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class GuardedStdout:
    """A stand-in for ``sys.stdout`` that never raises OSError from ``write`` or ``flush``, and writes
    ``terminal_safe`` text."""

    def __init__(self, inner: IO[str]) -> None:
        self.inner = inner
        self.error: OSError | None = None
        """The first write or flush failure (None: everything reached stdout)."""

    def write(self, text: str) -> int:
        if self.error is None:
            try:
                self.inner.write(terminal_safe(text))
                return len(text)
            except OSError as e:
                self.error = e
        return len(text)

    def flush(self) -> None:
        if self.error is None:
            try:
                self.inner.flush()
            except OSError as e:
                self.error = e

    def isatty(self) -> bool:
        return self.inner.isatty()

    def __getattr__(self, name: str) -> Any:  # fileno, encoding, buffer ...: the real stream's
        return getattr(self.inner, name)

    @property
    def reader_left(self) -> bool:
        """The failure was a closed pipe (`| head`): not worth a message."""
        return isinstance(self.error, BrokenPipeError) or getattr(self.error, "errno", None) == errno.EPIPE

    def problem(self) -> str | None:
        """One line for stderr when output was lost for a reason other than a closed pipe, else None."""
        if self.error is None or self.reader_left:
            return None
        return f"error: cannot write to standard output ({self.error.strerror or self.error}); the files the command " \
               "writes were written, the text it printed was lost"


__all__ = ["GuardedStdout", "TerminalSafe", "terminal_safe"]
