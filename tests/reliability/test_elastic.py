"""Elastic torchrun (``--nnodes 1:2``): a node dies mid-epoch, the survivors re-plan and finish the epoch exactly.

Node A (2 ranks, ``PLANNER_HOST_ID=node-a``, hosting the c10d store) and node B (1 rank, ``node-b``) start one
`planner train --auto --resume --checkpoint-every 10` job (the command an elastic job runs on every (re)start).
Mid-epoch node B's agent and rank are killed (SIGKILL).  Node A's agent restarts its workers (``--max-restarts``),
the rendezvous closes with node A alone, and the same command resumes from the last checkpoint on 2 ranks:

* it re-plans for 2 ranks at the same global batch, taking both ranks' curves from the checkpoint's profile (same
  host, same kind: no sweep) -- the restart's profile says so in each rank's meta;
* it continues at the checkpoint's global step: global step s covers positions P[s*B:(s+1)*B] of the epoch's
  permutation whatever the split, so the steps before the checkpoint (3 ranks) and those after it (2 ranks) hold
  every sample of the interrupted epoch exactly once -- checked from the indices each rank logged;
* the float64 parameters equal one process trained on the same samples (global batch 20, same seed).

Bounded: a deadline on the whole job, gloo's timeout, both agents' sessions killed in ``finally``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

import planner
from planner.plan import Plan
from planner.runlog import read_run_log
from tests._ranks import free_port
from tests.reliability import _torchrun
from tests.reliability.test_no_hangs import two_rank_profile

FIX = "tests.reliability._fixtures"
DEADLINE_S = 150.0
GLOBAL_BATCH = 20
N = 2000  # _fixtures.long_dataset: 100 steps an epoch
EPOCHS = 2
KILL_AT_STEP = 30  # node B dies once rank 0 has begun step 30 of epoch 0 (checkpoints every 10 steps)
# A node is taken for dead after keep_alive_interval x keep_alive_max_attempt seconds without a heartbeat: short
# enough to notice node B's death soon, long enough for a busy machine's agents (2 s was not: docs/RELIABILITY.md).
RDZV = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=5,join_timeout=60"


def start_node(port: int, run_id: str, host: str, addr: str, nproc: int, is_host: bool, args: list[str],
               log: Path) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
           "--rdzv-conf", f"{RDZV},is_host={str(is_host).lower()}", "--local-addr", addr, "--max-restarts", "2",
           "--monitor-interval", "0.5", "-m", "planner", *args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "GROUP_RANK", "PLANNER_HOST_ID")}
    # A fresh store for the workers at every rendezvous round (docs/RELIABILITY.md, "Elastic restarts").
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PLANNER_HOST_ID=host, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               PYTHONPATH=os.pathsep.join([str(_torchrun.REPO), env.get("PYTHONPATH", "")]))
    with open(log, "w", encoding="utf-8") as out:
        return subprocess.Popen(cmd, cwd=_torchrun.REPO, env=env, text=True, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def trace_rows(tmp_path: Path) -> list[dict[str, object]]:
    rows = []
    for p in sorted(tmp_path.glob("trace.*")):
        rows += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return rows


@pytest.mark.distributed
@pytest.mark.slow
def test_node_leaves_mid_epoch_survivors_replan_and_finish_exactly_once(tmp_path: Path) -> None:
    from planner.cli import main

    common = ["--device", "cpu", "--model", f"{FIX}:model", "--dataset", f"{FIX}:long_dataset", "--seed", "5",
              "--lr", "0.05", "--epochs", str(EPOCHS)]
    args = ["train", "--auto", "--quick", *common, "--global-batch", str(GLOBAL_BATCH), "--resume",
            "--checkpoint", str(tmp_path / "ckpt"), "--checkpoint-every", "10", "--log-file", str(tmp_path / "run.jsonl"),
            "--plan-out", str(tmp_path / "plan.json"), "--profile-out", str(tmp_path / "profile.json"),
            "--trace-file", str(tmp_path / "trace.{rank}"), "--loader-check-s", "0", "--quiet"]
    port, run_id = free_port(), f"el-{uuid.uuid4().hex[:8]}"
    logs = [tmp_path / "node-a.log", tmp_path / "node-b.log"]
    a = start_node(port, run_id, "node-a", "127.0.0.1", 2, True, args, logs[0])
    b = start_node(port, run_id, "node-b", "127.0.0.2", 1, False, args, logs[1])
    deadline = time.monotonic() + DEADLINE_S

    def tail() -> str:
        return "\n".join(p.read_text()[-2500:] for p in logs if p.exists())

    try:
        while not any(r["epoch"] == 0 and r["rank"] == 0 and r["world_size"] == 3 and r["step"] >= KILL_AT_STEP
                      for r in trace_rows(tmp_path)):
            assert a.poll() is None and b.poll() is None, "a node ended before the kill:\n" + tail()
            assert time.monotonic() < deadline, "the job never reached the kill point:\n" + tail()
            time.sleep(0.02)
        _torchrun.kill_job(_torchrun.job_pids(b), signal.SIGKILL)  # node B is gone: agent and rank
        b.wait(timeout=30)
        try:
            a.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"node A did not finish in {DEADLINE_S:.0f} s after node B left\n" + tail())
    finally:
        for p in (a, b):
            _torchrun.stop(p)
    assert a.returncode == 0, tail()

    log = read_run_log(tmp_path / "run.jsonl")
    assert log.world_size == 3 and log.ended and log.end_reason is None
    assert len(log.resizes) == 1
    resize = log.resizes[0]
    assert (resize.old_world_size, resize.new_world_size, resize.epoch) == (3, 2, 0)
    resumed_at = resize.step
    assert resumed_at % 10 == 0 and 10 <= resumed_at <= KILL_AT_STEP + 10
    plan = Plan.load(tmp_path / "plan.json")  # the restart's plan: 2 ranks, same global batch
    assert plan.world_size == 2 and plan.global_batch == GLOBAL_BATCH
    profile = json.loads((tmp_path / "profile.json").read_text())  # the restart's: no rank swept again
    assert [r["host"] for r in profile["ranks"]] == ["node-a", "node-a"]
    assert all(r["meta"]["curve_from_checkpoint"]["world_size"] == 3 for r in profile["ranks"])

    # Exactly once, from the indices each rank logged: epoch 0's steps before the checkpoint ran on 3 ranks, the
    # rest on 2 (steps between the checkpoint and the kill ran on 3 ranks too, then again: the later run counts).
    rows = trace_rows(tmp_path)
    before = [i for r in rows if r["epoch"] == 0 and r["world_size"] == 3 and r["step"] < resumed_at
              for i in r["indices"]]
    after = [i for r in rows if r["epoch"] == 0 and r["world_size"] == 2 for i in r["indices"]]
    assert min(r["step"] for r in rows if r["epoch"] == 0 and r["world_size"] == 2) == resumed_at
    assert sorted(before + after) == list(range(N))
    assert sorted(i for r in rows if r["epoch"] == 1 for i in r["indices"]) == list(range(N))
    assert {r["world_size"] for r in rows if r["epoch"] == 1} == {2}

    # Exact: one process over the same samples ends at the same parameters.
    one = tmp_path / "plan1.json"
    first = two_rank_profile()
    planner.evaluate(planner.Profile(hosts=first.hosts, ranks=(first.by_rank[0],)), [GLOBAL_BATCH],
                     num_workers=[0]).save(one)
    assert main(["train", "--plan", str(one), *common, "--checkpoint", str(tmp_path / "ref"), "--quiet"]) == 0
    got = torch.load(tmp_path / "ckpt" / "checkpoint.pt", map_location="cpu", weights_only=True)
    ref = torch.load(tmp_path / "ref" / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert (got["epoch"], got["step"]) == (EPOCHS, 0)
    for name in ref["model"]:
        assert got["model"][name].dtype == torch.float64
        torch.testing.assert_close(got["model"][name], ref["model"][name], rtol=1e-10, atol=1e-12)


def test_curves_are_reused_only_for_the_same_kind_on_the_same_host() -> None:
    """planner.cli.elastic: a rank takes a curve of its own host and kind, its own number's when there are several."""
    from dataclasses import replace

    from planner.cli.elastic import as_rank, kind_of, rank_kind, reusable
    from planner.profile import HostProfile

    base = two_rank_profile()
    r0, r1 = (replace(r, device_name="CPU x") for r in base.by_rank)
    saved = planner.Profile(hosts=(HostProfile(name="a", cpu_cores=2), HostProfile(name="b", cpu_cores=2)), ranks=(replace(r0, host="a"), replace(r1, host="a"),
                                                     replace(r1, rank=2, host="b", meta={**r1.meta, "emulate_slowdown": 3.0})),
                            meta={"workload": "w"})
    same_a = kind_of(saved.by_rank[0])
    assert reusable(saved, same_a, "w", prefer_rank=1) is saved.by_rank[1]  # its own number's curve
    assert reusable(saved, same_a, "w", prefer_rank=7) is saved.by_rank[0]  # a new rank of that kind: the first
    assert reusable(saved, same_a, "other workload") is None
    on_c = rank_kind("c", r0.device_name, r0.device, amp=None, slowdown=None, loader_cap=None)
    assert reusable(saved, on_c, "w") is None  # another host: its cores and loader were not measured
    slow_b = kind_of(saved.by_rank[2])
    assert reusable(saved, slow_b, "w") is saved.by_rank[2]
    plain_b = rank_kind("b", r1.device_name, r1.device, amp=None, slowdown=None, loader_cap=None)
    assert reusable(saved, plain_b, "w") is None  # same host, another kind (not slowed)
    moved = as_rank(saved.by_rank[2], 0, saved.world_size, {"ranks_on_host": 1})
    assert moved.rank == 0 and moved.compute == saved.by_rank[2].compute
    assert moved.meta["curve_from_checkpoint"] == {"rank": 2, "world_size": 3}
