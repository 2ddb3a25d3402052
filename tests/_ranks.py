"""Run a program's ranks the way torchrun would, from the tests' fork server: `planner ...` or a script, N ranks.

torchrun costs three interpreter starts per launch (its agent and one per rank, each importing torch: ~7 s of a
2-core machine's time before a rank runs a step). A test whose subject is the program -- `planner train`'s
weighting, re-planning, logs -- rather than torchrun itself launches the ranks here instead: each rank is a fork of
the fork server that already imported torch and the packages (tests/_dist.py), given the environment torchrun
gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT, ...), so the
program's own ``init_process_group`` (env://) rendezvous as under torchrun. Its stdout and stderr (file
descriptors 1 and 2, C++ output included) go to files read back in rank order. A deadline kills every rank; a
rank that fails makes the others' collectives fail within the program's gloo timeout, and the launch returns
once every rank has exited.

Tests of torchrun's own behaviour (an agent restarting its workers after a node died, two agents as two nodes,
its failure summary) keep torchrun (tests/reliability/_torchrun.py).
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch.multiprocessing as mp

from tests._dist import _start_method

REPO = Path(__file__).resolve().parents[1]
FAIL_GRACE_S = 5.0
"""After a rank fails, the others get this long to print their own error and leave before they are killed."""


def free_port() -> int:
    """A port nothing listens on now (bound to 0, read, released); the rendezvous binds it right after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, argv: list[str], env: dict[str, str], out_dir: str) -> None:
    import multiprocessing

    multiprocessing.set_start_method("fork", force=True)  # a rank's DataLoader workers fork, as under torchrun
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world),
                      ROLE_NAME="default", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                      TORCHELASTIC_RUN_ID=f"tests-{port}", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    import torch

    torch.set_num_threads(1)
    os.chdir(REPO)
    for fd, name in ((1, "out"), (2, "err")):
        f = os.open(os.path.join(out_dir, f"{name}.{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    rc = 1
    try:
        if argv[:2] == ["-m", "planner"]:
            argv = argv[2:]
        if argv and argv[0].endswith(".py"):
            import runpy

            sys.argv = list(argv)
            try:
                runpy.run_path(argv[0], run_name="__main__")
                rc = 0
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        else:
            from planner.cli import main_and_exit

            sys.argv = ["planner", *argv]
            main_and_exit(argv)  # exits through os._exit, as `python -m planner` does
    except BaseException:
        import traceback

        traceback.print_exc()
        rc = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc)


def run(argv: list[str], *, nproc: int = 2, timeout_s: float = 120.0,
        env: dict[str, str] | None = None) -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr, wall seconds) of ``argv`` -- ``["-m", "planner", "train", ...]``, ``["train",
    ...]`` or ``["script.py", ...]`` -- on ``nproc`` local ranks; the same return as
    ``tests.reliability._torchrun.run``. The exit code is the first failing rank's (0 when all succeeded); every
    rank's output is concatenated in rank order. A launch past ``timeout_s`` is killed and fails the test."""
    codes, out, err, wall = run_each(argv, nproc=nproc, timeout_s=timeout_s, env=env)
    return next((c for c in codes if c != 0), 0), out, err, wall


def run_each(argv: list[str], *, nproc: int = 2, timeout_s: float = 120.0,
             env: dict[str, str] | None = None) -> tuple[list[int], str, str, float]:
    """``run``, with every rank's exit code (rank order; -9 for a rank killed after another failed)."""
    return start(argv, nproc=nproc, env=env).finish(timeout_s)


class Launch:
    """Ranks started by ``start``, running: their pids while they run, ``finish`` to wait for them."""

    def __init__(self, argv: list[str], nproc: int, env: dict[str, str] | None) -> None:
        self.argv, self.nproc, self.t0 = list(argv), nproc, time.monotonic()
        self._dir = tempfile.TemporaryDirectory()
        self.ctx = mp.start_processes(_rank, args=(nproc, free_port(), self.argv, dict(env or {}), self._dir.name),
                                      nprocs=nproc, join=False, start_method=_start_method())

    @property
    def pids(self) -> list[int]:
        return [int(p.pid) for p in self.ctx.processes if p.pid is not None]

    def running(self) -> bool:
        return any(p.is_alive() for p in self.ctx.processes)

    def finish(self, timeout_s: float) -> tuple[list[int], str, str, float]:
        """(exit codes, stdout, stderr, wall seconds since the start) once every rank has exited: a failed rank
        stops the rest after FAIL_GRACE_S, as torchrun's agent does; past ``timeout_s`` every rank is killed and
        the test fails."""
        hung = False
        try:
            deadline = time.monotonic() + timeout_s
            failed_at = None
            while self.running():
                now = time.monotonic()
                if failed_at is None and any(p.exitcode not in (None, 0) for p in self.ctx.processes):
                    failed_at = now  # as torchrun's agent: a failed rank stops the job (after a grace period)
                if failed_at is not None and now > failed_at + FAIL_GRACE_S:
                    break
                if now > deadline:
                    hung = True
                    break
                time.sleep(0.05)
        finally:
            for p in self.ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join()
        codes = [p.exitcode if p.exitcode is not None else -9 for p in self.ctx.processes]

        def read(name: str) -> str:
            parts = []
            for r in range(self.nproc):
                path = Path(self._dir.name, f"{name}.{r}")
                parts.append(path.read_text(errors="replace") if path.exists() else "")
            return "".join(parts)

        out, err = read("out"), read("err")
        self._dir.cleanup()
        if hung:
            raise AssertionError(f"{' '.join(self.argv[:4])} on {self.nproc} ranks hung past {timeout_s:.0f} s\n"
                                 f"{err[-3000:]}")
        return codes, out, err, time.monotonic() - self.t0


def start(argv: list[str], *, nproc: int = 2, env: dict[str, str] | None = None) -> Launch:
    """Start ``argv`` on ``nproc`` ranks (as ``run``) and return at once; ``Launch.finish`` waits for them."""
    return Launch(argv, nproc, env)


def run_planner(nproc: int, args: list[str], *, timeout_s: float = 150.0,
                env: dict[str, str] | None = None) -> tuple[int, str]:
    """``tests._torchrun.run_planner_torchrun``'s form: (exit code, stdout and stderr together)."""
    rc, out, err, _ = run(args, nproc=nproc, timeout_s=timeout_s, env=env)
    return rc, out + err
