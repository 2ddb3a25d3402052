"""Fail-fast multi-rank harness for tests (gloo on CPU).

Ranks start from a fork server (never a fork of pytest itself, whose threads a fork would copy half-way): one
clean process per pytest run that imported torch and the packages once, so a launch costs a fork instead of
every rank importing torch again (2-4 s a launch on 2 cores). Each launch gets a FileStore rendezvous in a fresh
temp dir (no port to pick, nothing shared with a parallel run), a gloo timeout so a rank stuck in a collective
raises, a harness deadline, and its children killed in ``finally`` so nothing outlives the test.
Worker functions must be module-level (picklable); assert inside them -- the child's traceback reaches pytest.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from planner.cli.launch import PRELOAD, fork_server

# What the fork server imports before it forks any rank: what every worker function needs anyway.
# torch._dynamo: DistributedDataParallel's constructor imports it on first use (through torch._disable_dynamo;
# ~900 modules, sympy among them): 2-8 s in every rank of every launch that wraps a model in DDP, paid once here.
# planner.cli.train/autoplan, torchvision and psutil: what a `planner train` or `planner profile` rank started by
# tests/_ranks.py imports before its first step.
_PRELOAD = [*PRELOAD, "numpy", "scipy.optimize", "pytest",
            "psutil", "torchvision", "planner", "planner.cli", "planner.cli.train", "planner.cli.autoplan", "runtime",
            "runtime.collectives", "runtime.sampler", "runtime.timing", "profiler", "tests._dist"]
# The framework tests' ranks (tests/frameworks): ~4.6 s of CPU a rank for Lightning, ~1.8 for the HF Trainer, paid
# once by the fork server instead -- where the session runs framework tests (tests/conftest.py sets
# ``preload_frameworks``; ~6 s of one core otherwise spent for nothing).  A framework that is not installed is
# skipped by the fork server.
_FRAMEWORKS = ["lightning.pytorch", "transformers.trainer"]
preload_frameworks = False


def _entry(rank: int, world_size: int, store_path: str, fn: Callable[..., None], pg_timeout_s: float,
           args: tuple[Any, ...]) -> None:
    # Inside a rank, DataLoader workers (and any other multiprocessing) start by fork, as under torchrun and as
    # the programs' launcher (planner.cli.launch) sets it.
    import multiprocessing

    multiprocessing.set_start_method("fork", force=True)
    torch.set_num_threads(1)  # several ranks on 2 cores: no oversubscription
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=pg_timeout_s))
    try:
        fn(rank, world_size, *args)
        # Both ranks finish their collectives before either tears its process group down: a rank destroying
        # gloo while its peer still talks to it can abort the peer ("terminate called without an active
        # exception", seen about once in 200 runs here).
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Success: leave without running interpreter/C++ teardown, which can abort on gloo's worker threads after
    # the test has already passed. Errors above still raise and reach the parent with their traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _start_method() -> str:
    return fork_server([*_PRELOAD, *(_FRAMEWORKS if preload_frameworks else [])])


def start_fork_server() -> None:
    """Start the fork server now, without waiting for it: it imports its modules on a core of its own while pytest
    collects and runs the tests before the first launch (``ensure_running`` only spawns it; the first launch waits
    for it).  tests/conftest.py calls this once a session holding launches has collected."""
    import multiprocessing.forkserver

    if _start_method() == "forkserver":
        multiprocessing.forkserver.ensure_running()


def _every_error(error_files: list[str]) -> str:
    out = []
    for rank, path in enumerate(error_files):
        try:
            with open(path, "rb") as fh:
                out.append(f"\n-- rank {rank}:\n{pickle.load(fh)}")
        except (OSError, EOFError, pickle.UnpicklingError):
            pass
    return "".join(out)


def run_distributed(fn: Callable[..., None], world_size: int = 2, *args: Any, timeout_s: float = 90.0,
                    pg_timeout_s: float = 15.0) -> None:
    """Run fn(rank, world_size, *args) on world_size gloo ranks; raise on any rank's error or on a hang."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_entry, args=(world_size, os.path.join(tmp, "store"), fn, pg_timeout_s, args),
                                 nprocs=world_size, join=False, start_method=_start_method())
        try:
            deadline = time.monotonic() + timeout_s
            while not ctx.join(timeout=0.2, grace_period=5.0):  # raises as soon as any rank failed
                if time.monotonic() > deadline:
                    raise TimeoutError(f"distributed test did not finish in {timeout_s:.0f} s")
        except mp.ProcessRaisedException as e:
            # join names the first failed rank it looks at, often a peer that only saw the failing rank leave
            # ("Connection reset by peer"): every rank's traceback, so the cause is among them.
            raise mp.ProcessRaisedException(_every_error(ctx.error_files) or str(e), e.error_index,
                                            e.error_pid) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join()
