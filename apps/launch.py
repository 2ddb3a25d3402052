"""Spawn N local ranks that can never outlive their deadline: the bench's launcher and the tests' harness.

spawn (never fork: CUDA and gloo threads do not survive a fork), a FileStore rendezvous in a fresh temp dir (no
port to pick, nothing to collide with a parallel run), a deadline, and every child killed in ``finally`` -- also
when the parent is interrupted -- so nothing is left running or holding a GPU.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from typing import Any


def spawn(fn: Callable[..., None], nprocs: int, args: tuple[Any, ...] = (), *, timeout_s: float,
          what: str = "ranks") -> None:
    """Run ``fn(rank, nprocs, store_path, *args)`` in ``nprocs`` spawned processes and wait for all of them.

    ``store_path`` names a fresh file for ``torch.distributed.FileStore(store_path, nprocs)``.  Raises the first
    failing rank's error (with its traceback) or ``TimeoutError`` after ``timeout_s`` seconds.
    """
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(fn, args=(nprocs, os.path.join(tmp, "store"), *args), nprocs=nprocs, join=False,
                                 start_method="spawn")
        try:
            deadline = time.monotonic() + timeout_s
            while not ctx.join(timeout=0.5, grace_period=5.0):  # raises as soon as any rank failed
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what} did not finish in {timeout_s:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join()
