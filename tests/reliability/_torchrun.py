"""Launch ``torchrun --standalone`` for a test: its own process group, a deadline, SIGTERM then SIGKILL.

``--standalone`` picks a free port itself (no fixed port). torchrun starts every rank in a session of its own
(torch.distributed.elastic's SubprocessHandler passes ``start_new_session=True``), so killing torchrun's process
group leaves the ranks running as orphans -- they even finish the job. Killing "the whole job" therefore means
torchrun's group plus every descendant, collected (psutil) before anything dies and gets re-parented.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[2]
_RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def start(args: list[str], *, nproc: int = 2, monitor_interval_s: float | None = None,
          env: dict[str, str] | None = None, **popen: Any) -> subprocess.Popen[str]:
    """Start ``torchrun --standalone --nproc-per-node nproc ARGS`` in the repository root."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    if monitor_interval_s is not None:
        cmd.append(f"--monitor-interval={monitor_interval_s}")
    base = {k: v for k, v in os.environ.items() if k not in _RANK_ENV}
    base.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", **(env or {}))
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen([*cmd, *args], cwd=REPO, env=base, text=True, start_new_session=True, **popen)


def job_pids(proc: subprocess.Popen[str]) -> list[int]:
    """torchrun and every process under it (ranks, their loader workers)."""
    try:
        return [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def kill_job(pids: list[int], sig: int = signal.SIGKILL) -> None:
    """Signal torchrun's process group and every listed process (as a scheduler's kill of the job would)."""
    for i, pid in enumerate(pids):
        try:
            if i == 0:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            pass


def stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM torchrun (it forwards it to the ranks), then SIGKILL the whole job after 5 s."""
    pids = job_pids(proc)
    if proc.poll() is None:
        kill_job(pids[:1], signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    kill_job(pids, signal.SIGKILL)
    if proc.poll() is None:
        proc.wait()


def run(args: list[str], *, timeout_s: float, **kw: Any) -> tuple[int, str, str, float]:
    """(return code, stdout, stderr, wall seconds); a job past its deadline is killed and fails the test."""
    t0 = time.monotonic()
    proc = start(args, **kw)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop(proc)
        out, err = proc.communicate()
        raise AssertionError(f"torchrun {' '.join(args)} hung past {timeout_s}s\n{err[-3000:]}") from None
    finally:
        stop(proc)
    return proc.returncode, out, err, time.monotonic() - t0
