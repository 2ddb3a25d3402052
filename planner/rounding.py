"""Largest-remainder rounding: real shares -> integer batches with an exact total, within bounds."""

from __future__ import annotations

import math
from collections.abc import Sequence

from planner.errors import PlanError


def largest_remainder(x: Sequence[float], total: int, *, lo: int = 0,
                      hi: Sequence[int | None] | None = None) -> list[int]:
    """Integers n_i summing to ``total``, each in [lo, hi_i], by Hamilton's rule: floor every x_i (clipped to its
    bounds), then give the missing units to the largest remainders first (taking surplus units -- where ``lo``
    raised some -- from the smallest remainders first), in as many passes as the bounds need.

    The order among equal remainders is the rank order, so every caller (and every rank) gets the same answer.

    Raises:
        PlanError: the bounds cannot hold ``total`` (sum of lo > total, or sum of hi < total).
    """
    n = len(x)
    upper = [math.inf if hi is None or hi[i] is None else float(hi[i]) for i in range(n)]  # type: ignore[arg-type]
    if n == 0 or lo * n > total or sum(upper) < total:
        raise PlanError(f"cannot split {total} into {n} integers within [{lo}, {list(hi) if hi else 'inf'}]")
    out = [int(min(max(math.floor(v), lo), upper[i])) for i, v in enumerate(x)]
    rem = [v - math.floor(v) for v in x]
    grow = sorted(range(n), key=lambda i: -rem[i])  # stable: ties keep rank order
    while sum(out) < total:
        for i in grow:
            if sum(out) >= total:
                break
            if out[i] < upper[i]:
                out[i] += 1
    shrink = sorted(range(n), key=lambda i: rem[i])
    while sum(out) > total:
        for i in shrink:
            if sum(out) <= total:
                break
            if out[i] > lo:
                out[i] -= 1
    return out
