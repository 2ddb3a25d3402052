"""A profile of CPU ranks on one host whose step time is linear in the batch: the tests' smallest real plans."""

from __future__ import annotations

from collections.abc import Sequence

import planner


def linear_cpu_profile(per_sample_s: Sequence[float], sizes: Sequence[int] = (2, 8, 16)) -> planner.Profile:
    """Rank i measured ``per_sample_s[i] * b`` seconds a step at each batch of ``sizes``, on a 2-core host."""
    return planner.Profile.from_dict({
        "version": 1, "kind": "profile", "hosts": [{"name": "node0", "cpu_cores": 2}],
        "ranks": [{"rank": r, "host": "node0", "device": "cpu",
                   "compute": [{"batch_size": b, "step_time_s": c * b} for b in sizes]}
                  for r, c in enumerate(per_sample_s)]})
