"""Aligned plain-text tables for terminal output (people read tables; machines read the JSON)."""

from __future__ import annotations

from collections.abc import Sequence


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, right: Sequence[bool] | None = None) -> str:
    """Columns padded to their widest cell; numbers right-aligned unless `right` says otherwise."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    if right is None:
        right = [all(_numeric(r[i]) for r in cells[1:]) and len(cells) > 1 for i in range(len(headers))]
    lines = []
    for k, r in enumerate(cells):
        parts = [c.rjust(w) if ra else c.ljust(w) for c, w, ra in zip(r, widths, right, strict=True)]
        lines.append("  ".join(parts).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _numeric(s: str) -> bool:
    try:
        float(s.rstrip("%x"))
    except ValueError:
        return False
    return True
