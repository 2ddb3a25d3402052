"""The hand-over's copy: a loader batch into pinned memory, big tensors split across a few threads.

The DataLoader's pin-memory thread copies each batch once more on one core (``Tensor.pin_memory``), and for
ResNet-50's 287 MB batches that copy was the step's ceiling on 2x H200: 2.2-2.5 GB/s as delivered in training, rank
0 waiting 33-50 ms a step for data its workers had built (docs/BENCHMARKS.md sections 19-20).  ``pin_tree`` copies
a large tensor in ``PIN_THREADS`` slices at once (``Tensor.copy_`` releases the GIL), into a block of the CUDA
pinned-host pool.  It lives here, below ``runtime``, because the profile times the same copy
(``LoaderProfile.handover_bytes_per_s``) that ``runtime.pinning.PinAhead`` makes in training.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

PIN_THREADS = 4
"""Threads a large tensor's copy into pinned memory is split across."""
PIN_SLICE_BYTES = 4 << 20
"""Smallest slice worth a thread of its own (the profile's 19 MB scan batches still split four ways, as training's
287 MB ones do); smaller tensors are pinned whole, on the calling thread."""

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _copy_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=PIN_THREADS, thread_name_prefix="pin-copy")
        return _pool


def pin_tensor(t: torch.Tensor, threads: int = PIN_THREADS) -> torch.Tensor:
    """``t`` copied into pinned memory (``t`` itself when it is not a CPU tensor or already pinned); a contiguous
    tensor of at least two ``PIN_SLICE_BYTES`` is copied in up to ``threads`` slices at once."""
    if t.device.type != "cpu" or t.is_pinned():
        return t
    slices = min(threads, t.numel() * t.element_size() // PIN_SLICE_BYTES)
    if slices <= 1 or not t.is_contiguous():
        return t.pin_memory()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    src, dst = t.view(-1), out.view(-1)
    n = src.numel()
    step = -(-n // slices)
    jobs = [_copy_pool().submit(dst[i:i + step].copy_, src[i:i + step]) for i in range(0, n, step)]
    for job in jobs:
        job.result()
    return out


def pin_tree(obj: Any, threads: int = PIN_THREADS) -> Any:
    """``obj`` with every CPU tensor in it (nested tuples, namedtuples, lists and dicts) copied to pinned memory
    (``pin_tensor``)."""
    if isinstance(obj, torch.Tensor):
        return pin_tensor(obj, threads)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(pin_tree(v, threads) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(pin_tree(v, threads) for v in obj)
    if isinstance(obj, dict):
        return {k: pin_tree(v, threads) for k, v in obj.items()}
    return obj
