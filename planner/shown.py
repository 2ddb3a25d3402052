"""Values echoed in one-line messages: cut to a width, with their length said, and never cut alike when they differ.

An error line names the value it refuses, but a file can hold a 5,000-character string: echoed whole it buries
the line.  ``shown`` cuts a long value and says how long it was (``"AAAA..." (5,000 characters)``).  Two values
that differ only past the cut (two 200-character paths that share their first 40) would read the same; the
messages that put values side by side ("rank 0 has X, rank 1 has Y") take ``shown_apart``, which shows each
around the first character where they differ.  Pure: the standard library only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any

WIDTH = 40
"""Characters of a value a message shows by default."""


def text_of(value: Any) -> str:
    """The text a message shows for ``value``: a string as JSON (quoted, control characters and lone surrogates
    escaped, so the line stays one printable line), a non-finite float as Python prints it, else JSON where it
    can be, else ``str``."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    try:
        return json.dumps(value)
    except (TypeError, ValueError):  # not JSON-able (a tensor, a set) or a circular structure
        return str(value)


def _length(text: str, value: Any) -> str:
    n = len(value) if isinstance(value, (str, list, dict, tuple)) else len(text)
    unit = "characters" if isinstance(value, str) else ("items" if isinstance(value, (list, dict, tuple)) else
                                                         "characters as text")
    return f" ({n:,} {unit})"


def shown(value: Any, width: int = WIDTH) -> str:
    """``value`` as a message shows it: whole when its text fits ``width``, else its first ``width - 3``
    characters, "...", and its length.

    >>> shown("A" * 5000, 10)
    '"AAAAAA... (5,000 characters)'
    """
    text = text_of(value)
    if len(text) <= width:
        return text
    return text[:max(1, width - 3)] + "..." + _length(text, value)


def shown_apart(values: Sequence[Any], width: int = WIDTH, *, text: Callable[[Any], str] = text_of) -> list[str]:
    """Each of ``values`` as ``shown`` gives it, unless two that differ would read the same: then each is shown
    from a little before the first character where the texts differ, with that position said
    (``.../node-b/ckpt (from character 13 of 24)``), so the line shows what differs.  ``text``: how a value
    reads (JSON by default; ``str`` for messages that print values bare).

    >>> shown_apart(["/scratch/job/node-a/ckpt", "/scratch/job/node-b/ckpt"], 12, text=str)
    ['.../node-a/ckpt (from character 13 of 24)', '.../node-b/ckpt (from character 13 of 24)']
    """
    texts = [text(v) for v in values]
    plain = [t if len(t) <= width else t[:max(1, width - 3)] + "..." + _length(t, v) for t, v in zip(texts, values)]
    distinct = set(texts)
    if len(set(plain)) == len(distinct):
        return plain
    first = _first_difference(sorted(distinct))
    start = max(0, first - width // 2)  # half the window before the difference, half from it
    out = []
    for t in texts:
        cut = ("..." if start else "") + t[start:start + width] + ("..." if start + width < len(t) else "")
        out.append(f"{cut} (from character {start + 1:,} of {len(t):,})" if cut != t else t)
    return out


def _first_difference(texts: Sequence[str]) -> int:
    """The first index at which the (distinct, at least two) ``texts`` do not all agree."""
    shortest = min(len(t) for t in texts)
    for i in range(shortest):
        if len({t[i] for t in texts}) > 1:
            return i
    return shortest


__all__ = ["WIDTH", "shown", "shown_apart", "text_of"]
