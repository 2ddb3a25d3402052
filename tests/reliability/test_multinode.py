"""Two torchrun "nodes" that differ: 2 ranks on one, 1 slower rank on the other, each agent its own command.

Node A (``--nproc-per-node 2``) and node B (``--nproc-per-node 1``, ``PLANNER_HOST_ID=node-b``) meet through one
c10d rendezvous on localhost at a free port picked just before (the kernel's choice for a socket bound to port 0),
as two machines of a cluster would; both agents run in sessions of their own and every process under them is
killed when the test ends, passes or not.  Node A's ranks are named by the rule for multi-node jobs,
``<hostname>/node<GROUP_RANK>`` (profiler.inventory.host_name): containers on different nodes often report one
host name, and the node keeps their loader budgets apart; node B's by the ``PLANNER_HOST_ID`` override.
Node B's rank is emulated 3x slower (another device kind).  torchrun's c10d rendezvous numbers the nodes by their
sorted descriptors (``--local-addr``, then the agent's pid), so node A binds 127.0.0.1 and node B 127.0.0.2 (both
loopback): node A is GROUP_RANK 0 with ranks 0 and 1, node B's rank is 2, so ``--emulate-slowdown 2=3`` names it.

One launch checks, with several asserts: the ranks' torchrun environment (node ranks, local ranks, local world
sizes), the gathered profile (one host per node with its own rank count), the plan (each rank's host and the
host groups of its all-reduce), training with a re-plan at each epoch end, the run log, the report -- and that
the trained parameters in float64 equal one process trained on the same samples at the same global batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

import planner
from planner.plan import Plan
from planner.runlog import read_run_log
from profiler.inventory import machine_name
from tests._ranks import free_port
from tests.reliability import _torchrun
from tests.reliability.test_no_hangs import two_rank_profile

FIX = "tests.reliability._fixtures"
DEADLINE_S = 150.0
NODES = ((None, "127.0.0.1", 2), ("node-b", "127.0.0.2", 1))  # (PLANNER_HOST_ID, --local-addr, ranks)
GLOBAL_BATCH = 20  # 100 samples: 5 full steps an epoch, no padded step (every split covers the same samples)
EPOCHS = 2


def start_node(port: int, run_id: str, host: str | None, addr: str, nproc: int, args: list[str],
               log: Path) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
           "--local-addr", addr, "--max-restarts", "0", "--monitor-interval", "0.5", "-m", "planner", *args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "GROUP_RANK", "PLANNER_HOST_ID")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=os.pathsep.join([str(_torchrun.REPO), env.get("PYTHONPATH", "")]))
    if host is not None:
        env["PLANNER_HOST_ID"] = host
    with open(log, "w", encoding="utf-8") as out:
        return subprocess.Popen(cmd, cwd=_torchrun.REPO, env=env, text=True, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def run_nodes(tmp_path: Path, args: list[str]) -> list[str]:
    """Start both agents, wait for both (deadline), kill everything under them; the nodes' logs."""
    port, run_id = free_port(), f"hn-{uuid.uuid4().hex[:8]}"
    nodes = [start_node(port, run_id, host, addr, nproc, args, tmp_path / f"node{i}.log")
             for i, (host, addr, nproc) in enumerate(NODES)]
    try:
        for p in nodes:
            try:
                p.wait(timeout=DEADLINE_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"two-node run did not finish in {DEADLINE_S:.0f} s\n"
                            + "\n".join((tmp_path / f"node{i}.log").read_text()[-2000:] for i in range(len(NODES))))
    finally:
        for p in nodes:
            _torchrun.stop(p)
    logs = [(tmp_path / f"node{i}.log").read_text() for i in range(len(NODES))]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(log[-3000:] for log in logs)
    return logs


@pytest.mark.distributed
@pytest.mark.slow
def test_nodes_of_different_sizes_and_kinds_profile_plan_train_and_report(tmp_path: Path) -> None:
    from planner.cli import main

    common = ["--device", "cpu", "--model", f"{FIX}:model", "--dataset", f"{FIX}:dataset", "--seed", "3",
              "--lr", "0.05", "--epochs", str(EPOCHS)]
    args = ["train", "--auto", "--quick", *common, "--global-batch", str(GLOBAL_BATCH), "--replan",
            "--emulate-slowdown", "2=3", "--plan-out", str(tmp_path / "plan.json"),
            "--profile-out", str(tmp_path / "profile.json"), "--log-file", str(tmp_path / "run.jsonl"),
            "--checkpoint", str(tmp_path / "ckpt"), "--trace-file", str(tmp_path / "trace.{rank}")]
    run_logs = run_nodes(tmp_path, args)

    # The profile: one host per node, each with its own ranks, the slow kind on node B.
    node_a = f"{machine_name()}/node0"
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert sorted(h["name"] for h in profile["hosts"]) == sorted([node_a, "node-b"])
    ranks = sorted(profile["ranks"], key=lambda r: r["rank"])
    assert [r["host"] for r in ranks] == [node_a, node_a, "node-b"]
    assert all(r["meta"]["hostname"] == machine_name() for r in ranks)
    assert [r["meta"]["ranks_on_host"] for r in ranks] == [2, 2, 1]
    assert [r["meta"].get("emulate_slowdown") for r in ranks] == [None, None, 3.0]
    node = [r["meta"]["node"] for r in ranks]  # torchrun's view of each rank, as the rank read it
    assert [(n["group_rank"], n["local_rank"], n["local_world_size"]) for n in node] == [(0, 0, 2), (0, 1, 2),
                                                                                        (1, 0, 1)]
    assert all(n["group_world_size"] == 2 for n in node)

    # The plan: each rank's host, and its all-reduce spans the two hosts.
    plan = Plan.load(tmp_path / "plan.json")
    assert [r.host for r in plan.ranks] == [node_a, node_a, "node-b"]
    links = plan.meta["allreduce"]
    assert links["host_groups"] == [{"host": node_a, "ranks": [0, 1]}, {"host": "node-b", "ranks": [2]}]
    assert links["spans_hosts"] is True and links["intra_host_allreduce_s"]["node-b"] == 0.0
    assert 0.0 <= links["inter_host_s"] <= links["allreduce_s"]
    table = run_logs[0]
    assert "all-reduce spans 2 hosts" in table and "node-b" in table  # the plan table shows the hosts
    log = read_run_log(tmp_path / "run.jsonl")
    assert log.world_size == 3 and log.global_batch == GLOBAL_BATCH and len(log.epochs) == EPOCHS and log.ended

    # The report renders from the two-node run's files.
    assert main(["report", "--profile", str(tmp_path / "profile.json"), "--plan", str(tmp_path / "plan.json"),
                 "--log", str(tmp_path / "run.jsonl"), "--out", str(tmp_path / "report.html"), "--quiet"]) == 0
    assert "node-b" in (tmp_path / "report.html").read_text()

    # Every sample once an epoch, over the three ranks.
    seen: dict[int, list[int]] = {}
    for rank in range(3):
        for line in (tmp_path / f"trace.{rank}").read_text().splitlines():
            row = json.loads(line)
            seen.setdefault(row["epoch"], []).extend(row["indices"])
    assert sorted(seen) == list(range(EPOCHS)) and all(sorted(v) == list(range(100)) for v in seen.values())

    # Exact: one process over the same samples (global batch 20, same seed) ends at the same parameters.
    one = tmp_path / "plan1.json"
    first = two_rank_profile()
    planner.evaluate(planner.Profile(hosts=first.hosts, ranks=(first.by_rank[0],)), [GLOBAL_BATCH],
                     num_workers=[0]).save(one)
    assert main(["train", "--plan", str(one), *common, "--checkpoint", str(tmp_path / "ref"), "--quiet"]) == 0
    a = torch.load(tmp_path / "ckpt" / "checkpoint.pt", map_location="cpu", weights_only=True)
    b = torch.load(tmp_path / "ref" / "checkpoint.pt", map_location="cpu", weights_only=True)
    for name in b["model"]:
        assert a["model"][name].dtype == torch.float64
        torch.testing.assert_close(a["model"][name], b["model"][name], rtol=1e-10, atol=1e-12)
