"""Two torchrun "nodes" on one machine profile, plan and train: `planner train --auto` across --nnodes 2.

Each node is its own torchrun agent (``--nnodes 2 --nproc-per-node 1``) meeting through a c10d rendezvous on
localhost at a free port picked just before (the kernel's choice for a socket bound to port 0); both agents run
in sessions of their own and every process under them is killed when the test ends, passes or not.  The ranks
share one host name, as containers on different nodes often do; the gathered profile must still name two hosts
(``<hostname>/node<GROUP_RANK>``, profiler.inventory.host_name), so neither node's loader budget is split with
the other's ranks (docs/FRAMEWORKS.md, "Multi-node").
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from planner.runlog import read_run_log
from profiler.inventory import machine_name
from tests.reliability import _torchrun

DEADLINE_S = 240.0


def free_port() -> int:
    """A port nothing listens on now (bound to 0, read, released); the rendezvous binds it right after."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_node(port: int, run_id: str, args: list[str], log: Path) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
           "--local-addr", "127.0.0.1", "--max-restarts", "0", "--monitor-interval", "0.5",
           "-m", "planner", *args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "GROUP_RANK", "PLANNER_HOST_ID")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=os.pathsep.join([str(_torchrun.REPO), env.get("PYTHONPATH", "")]))
    with open(log, "w", encoding="utf-8") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=_torchrun.REPO, env=env, text=True, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_torchrun_nodes_profile_plan_and_train(tmp_path: Path) -> None:
    args = ["train", "--auto", "--device", "cpu", "--quick", "--model", "mlp", "--num-samples", "256",
            "--global-batch", "32", "--epochs", "2", "--plan-out", str(tmp_path / "plan.json"),
            "--profile-out", str(tmp_path / "profile.json"), "--log-file", str(tmp_path / "run.jsonl")]
    port, run_id = free_port(), f"mn-{uuid.uuid4().hex[:8]}"
    nodes = [start_node(port, run_id, args, tmp_path / f"node{i}.log") for i in range(2)]
    try:
        for p in nodes:
            try:
                p.wait(timeout=DEADLINE_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"two-node run did not finish in {DEADLINE_S:.0f} s\n"
                            + "\n".join((tmp_path / f"node{i}.log").read_text()[-2000:] for i in range(2)))
    finally:
        for p in nodes:
            _torchrun.stop(p)
    logs = [(tmp_path / f"node{i}.log").read_text() for i in range(2)]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(log[-3000:] for log in logs)

    profile = json.loads((tmp_path / "profile.json").read_text())
    machine = machine_name()
    hosts = sorted(h["name"] for h in profile["hosts"])
    assert hosts == [f"{machine}/node0", f"{machine}/node1"]  # one host per node, though the names match
    assert sorted(r["host"] for r in profile["ranks"]) == hosts
    assert all(r["meta"]["hostname"] == machine and r["meta"]["ranks_on_host"] == 1 for r in profile["ranks"])
    log = read_run_log(tmp_path / "run.jsonl")
    assert log.world_size == 2 and log.global_batch == 32 and len(log.epochs) == 2 and log.ended
