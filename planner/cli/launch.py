"""Start N local ranks that can never outlive their deadline: the bench's launcher.

Ranks fork from a fork server (``multiprocessing``'s "forkserver" where the platform has it, "spawn" elsewhere): a
fresh interpreter that imports torch, torch.distributed and DDP's dependencies once, before any CUDA or gloo state
exists, and forks one rank per request.  A rank then starts in a fraction of a second instead of importing torch
again (about 5 s of CPU a rank, 7 with DDP's first import of torch._dynamo), and like a spawned rank it holds no
CUDA context or gloo thread of its parent (those do not survive a plain fork).  Each rank gets the parent's
environment, stdout and stderr as they are at launch, as a spawned one would.  Inside a rank, DataLoader workers
fork, as under torchrun (``_rank_entry``).  A FileStore rendezvous in a fresh temp dir (no port to pick, nothing
to collide with a parallel run), a deadline, and every child killed in ``finally`` -- also when the parent is
interrupted or terminated (SIGTERM is Ctrl-C, planner/lifetime.py) -- and, for a parent killed by SIGKILL, the
fork server, the ranks and their workers each die with their parent (``PR_SET_PDEATHSIG``), so nothing is left
running or holding a GPU.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from planner.lifetime import die_with_parent

PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo")
"""What the fork server imports before forking ranks (DDP's constructor imports torch._dynamo)."""


def fork_server(preload: Sequence[str]) -> str:
    """The start method for ranks: "forkserver", its server importing ``preload`` first, where the platform has it;
    "spawn" elsewhere.  A process has one fork server: where it already runs, it keeps the modules it preloaded.
    The server imports ``planner.cli._forkserver_ready`` last: its preloaded objects frozen out of the ranks' garbage
    collections, and no interpreter teardown when it ends."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload([*preload, "planner.cli._forkserver_ready"])
    return "forkserver"


class _Stdio:
    """The launching process's stdout and stderr as they are at launch, handed to a rank with its arguments (a
    fork-server rank would otherwise write where the fork server's own descriptors pointed when it started, e.g.
    to an earlier launch's redirection).  Pickled while the rank starts, as ``multiprocessing`` passes a descriptor
    to a child: the fork server receives a duplicate, a spawned child the same number."""

    def __init__(self, out: Any = None, err: Any = None) -> None:
        self.out, self.err = out, err

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        return (_Stdio, (reduction.DupFd(1), reduction.DupFd(2)))

    def apply(self) -> None:
        for fd, wrapped in ((1, self.out), (2, self.err)):
            got = wrapped.detach()
            if got != fd:
                os.dup2(got, fd)
                os.close(got)


def _rank_entry(rank: int, environ: dict[str, str], stdio: _Stdio, fn: Callable[..., None], *args: Any) -> None:
    """A rank: the launching process's environment, then DataLoader workers (and any other multiprocessing) start
    as under torchrun, by fork.

    A rank started by spawn or the fork server keeps that start method as its default, so every DataLoader it made
    would start each worker as a fresh interpreter importing torch and the package: ~10 s a loader on 2x H100
    (11.4-18.2 s per worker count of the profile's loader scan, for 1 s of timing), paid again by every strategy's
    run of `planner bench --data loader`.  torchrun's ranks fork their workers; ours do too (Linux only, where fork is the
    platform default; the workers never touch CUDA)."""
    os.environ.clear()
    os.environ.update(environ)
    stdio.apply()
    if sys.platform.startswith("linux"):
        import multiprocessing

        multiprocessing.set_start_method("fork", force=True)
        # A rank dies with its parent (the fork server, which dies with the launcher), and every process it forks
        # (DataLoader workers) dies with the rank: a launcher killed by SIGKILL leaves nothing running.
        die_with_parent(signal.SIGKILL)
        os.register_at_fork(after_in_child=_die_with_parent)
    fn(rank, *args)


def _die_with_parent() -> None:
    die_with_parent(signal.SIGKILL)


def spawn(fn: Callable[..., None], nprocs: int, args: tuple[Any, ...] = (), *, timeout_s: float,
          what: str = "ranks") -> None:
    """Run ``fn(rank, nprocs, store_path, *args)`` in ``nprocs`` rank processes and wait for all of them.

    ``store_path`` names a fresh file for ``torch.distributed.FileStore(store_path, nprocs)``.  Raises the first
    failing rank's error (with its traceback) or ``TimeoutError`` after ``timeout_s`` seconds.
    """
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        rank_args = (dict(os.environ), _Stdio(), fn, nprocs, os.path.join(tmp, "store"), *args)
        ctx = mp.start_processes(_rank_entry, args=rank_args, nprocs=nprocs, join=False,
                                 start_method=fork_server([*PRELOAD, fn.__module__]))
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
