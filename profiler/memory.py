"""Device memory: capacity, peak bytes per batch (recorded by the sweep) and the largest batch that fits.

CUDA: ``StepRunner.measure`` resets the peak counter (``reset_peak_memory_stats``) before a batch's steps and
reads ``max_memory_allocated`` after them, so each sweep point carries its peak bytes.  When the sweep hits a
batch that does not fit, ``find_max_batch`` bisects between the last batch that ran and the failing one (each
probe one training step; an out-of-memory probe is freed and stepped back from) and the result becomes
``MemoryProfile.max_batch_size``, a hard cap for the planner.

CPU: no device memory cap (the planner treats the rank as uncapped); the host's RAM goes to
``HostProfile.memory_bytes``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from planner.profile import MemoryProfile
from profiler.sweep import SweepResult, search_max_batch


def device_capacity_bytes(device: torch.device) -> int | None:
    """Memory this process may use on a CUDA device (its total, times the per-process fraction when one is set,
    e.g. by ``--emulate-memory``); None on CPU."""
    if device.type != "cuda":
        return None
    total = int(torch.cuda.get_device_properties(device).total_memory)
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.7
    fraction = float(get_fraction(device)) if get_fraction is not None else 1.0
    return int(total * min(1.0, fraction))


def host_memory_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # psutil missing or unreadable /proc: the field is optional
        return None


def find_max_batch(result: SweepResult, fits: Callable[[int], bool], *, rel_tol: float = 0.05) -> int | None:
    """Largest batch that fits, when the sweep saw one that did not; None when nothing failed."""
    if result.oom_batch is None:
        return None
    ran = [p.batch_size for p in result.points if p.batch_size < result.oom_batch]
    if not ran:
        # Even the first batch failed: search down from it.
        lo = 1
        if not fits(lo):
            return None
    else:
        lo = max(ran)
    if result.oom_batch - lo <= 1:
        return lo
    return search_max_batch(fits, lo, result.oom_batch, rel_tol=rel_tol)


def memory_profile(device: torch.device, result: SweepResult, max_batch_size: int | None) -> MemoryProfile | None:
    """The rank's MemoryProfile: capacity, peak bytes per swept batch, measured max batch (None on CPU)."""
    if device.type != "cuda":
        return None
    return MemoryProfile(capacity_bytes=device_capacity_bytes(device), points=result.memory_points(),
                         max_batch_size=max_batch_size)
