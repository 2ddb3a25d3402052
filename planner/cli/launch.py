"""Spawn N local ranks that can never outlive their deadline: the bench's launcher and the tests' harness.

spawn (never fork: CUDA and gloo threads do not survive a fork; inside a rank, DataLoader workers fork, as under
torchrun: ``_rank_entry``), a FileStore rendezvous in a fresh temp dir (no
port to pick, nothing to collide with a parallel run), a deadline, and every child killed in ``finally`` -- also
when the parent is interrupted -- so nothing is left running or holding a GPU.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any


def _rank_entry(rank: int, fn: Callable[..., None], *args: Any) -> None:
    """A spawned rank: DataLoader workers (and any other multiprocessing) start as under torchrun, by fork.

    A spawned process inherits "spawn" as its default start method, so every DataLoader it made started each worker
    as a fresh interpreter importing torch and the package: ~10 s a loader on 2x H100 (11.4-18.2 s per
    worker count of the profile's loader scan, for 1 s of timing), paid again by every strategy's run of `planner
    bench --data loader`.  torchrun's ranks fork their workers; ours do too (Linux only, where fork is the
    platform default; the workers never touch CUDA)."""
    if sys.platform.startswith("linux"):
        import multiprocessing

        multiprocessing.set_start_method("fork", force=True)
    fn(rank, *args)


def spawn(fn: Callable[..., None], nprocs: int, args: tuple[Any, ...] = (), *, timeout_s: float,
          what: str = "ranks") -> None:
    """Run ``fn(rank, nprocs, store_path, *args)`` in ``nprocs`` spawned processes and wait for all of them.

    ``store_path`` names a fresh file for ``torch.distributed.FileStore(store_path, nprocs)``.  Raises the first
    failing rank's error (with its traceback) or ``TimeoutError`` after ``timeout_s`` seconds.
    """
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_rank_entry, args=(fn, nprocs, os.path.join(tmp, "store"), *args), nprocs=nprocs,
                                 join=False, start_method="spawn")
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
