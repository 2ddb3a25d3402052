"""Run `python -m torch.distributed.run --standalone ... -m planner ...` from a test without ever hanging."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest


def run_planner_torchrun(nproc: int, args: list[str], *, timeout_s: float = 150.0,
                         env: dict[str, str] | None = None) -> tuple[int, str]:
    """(exit code, combined output). On timeout: SIGTERM (torchrun forwards it), then kill, then fail."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
           "planner", *args]
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # SIGKILL alone would orphan the workers with our pipe open
        try:
            proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        pytest.fail(f"torchrun planner {' '.join(args[:1])} did not finish in {timeout_s:.0f} s")
    return proc.returncode, text
