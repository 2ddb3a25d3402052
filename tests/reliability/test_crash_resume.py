"""kill -9 of a whole 2-rank job mid-epoch, then ``--resume``: same (epoch, step, rank) indices, equal parameters.

"Equal sequence" (docs/RELIABILITY.md): the steps between the last checkpoint and the kill run twice -- once
before the kill, once after the resume -- so the resumed trace holds those (epoch, step, rank) keys twice. The
guarantee is that every key of the uninterrupted run appears, no other key appears, and every occurrence of a key
carries exactly the indices the uninterrupted run used. In float64 on CPU the final parameters and optimizer
state are then bit-identical to the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from tests import _ranks
from tests.reliability.test_no_hangs import write_plan

FIX = "tests.reliability._fixtures"
EPOCHS = 3
# 100 samples at global batch 12: 8 full steps and a padded partial one per epoch (steps 0..8).
STEPS = 9
KILL_AT = (1, 6)  # (epoch, step) seen in rank 0's trace -> SIGKILL the job; the last checkpoint is (1, 4)


def _train_args(plan: Path, ckpt: Path, trace: Path, *extra: str) -> list[str]:
    return ["-m", "planner", "train", "--plan", str(plan), "--device", "cpu", "--epochs", str(EPOCHS),
            "--model", f"{FIX}:slow_model", "--dataset", f"{FIX}:dataset", "--checkpoint", str(ckpt),
            "--checkpoint-every", "4", "--trace-file", str(trace) + ".{rank}", "--lr", "0.05", *extra]


def _trace(prefix: Path) -> list[tuple[tuple[int, int, int], list[int]]]:
    rows = []
    for rank in (0, 1):
        p = Path(f"{prefix}.{rank}")
        for line in p.read_text().splitlines() if p.exists() else []:
            d = json.loads(line)
            rows.append(((d["epoch"], d["step"], d["rank"]), d["indices"]))
    return rows


def _all_dead(pids: list[int], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids):
                return True
        except psutil.NoSuchProcess:
            continue
        time.sleep(0.05)
    return False


def _final(ckpt: Path) -> dict[str, Any]:
    return torch.load(ckpt / "checkpoint.pt", map_location="cpu", weights_only=True)  # type: ignore[no-any-return]


@pytest.mark.distributed
def test_kill9_mid_epoch_then_resume_equals_uninterrupted(tmp_path: Path) -> None:
    plan = write_plan(tmp_path / "plan.json", [7, 5])
    # 1. the reference: one uninterrupted run
    ref_ckpt, ref_trace = tmp_path / "ref_ckpt", tmp_path / "ref_trace"
    rc, _, err, _ = _ranks.run(_train_args(plan, ref_ckpt, ref_trace), timeout_s=90)
    assert rc == 0, err[-3000:]
    ref = _trace(ref_trace)
    ref_map = dict(ref)
    assert len(ref) == len(ref_map) == EPOCHS * STEPS * 2  # every step once per rank

    # 2. the same run, slowed down so it can be killed mid-epoch, then SIGKILLed as a whole (every rank at once)
    ckpt, trace = tmp_path / "ckpt", tmp_path / "trace"
    job = _ranks.start(_train_args(plan, ckpt, trace), env={"RELIABILITY_STEP_SLEEP_S": "0.1"})
    killed = False
    try:
        deadline = time.monotonic() + 90
        while not any(k[:2] >= KILL_AT and k[2] == 0 for k, _ in _trace(trace)):
            assert job.running(), "the run ended before it could be killed"
            assert time.monotonic() < deadline, "the run never reached the kill point"
            time.sleep(0.02)
        pids = job.pids
        assert len(pids) == 2, "two ranks"
        for pid in pids:  # kill -9 of every process of the job, mid-epoch (no loader workers: num_workers 0)
            os.kill(pid, signal.SIGKILL)
        killed = True
        assert _all_dead(pids), "the ranks are gone (not still writing checkpoints)"
    finally:
        codes, _, err, _ = job.finish(timeout_s=30)
    assert killed and codes == [-9, -9], (codes, err[-3000:])
    state = _final(ckpt)
    assert (state["epoch"], state["step"]) == (1, 4), "the last checkpoint before the kill"
    killed_keys = {k for k, _ in _trace(trace)}
    assert (EPOCHS - 1, STEPS - 1, 0) not in killed_keys  # it really died before the end

    # 3. resume from the checkpoint: no sleep needed now
    rc, out, err, _ = _ranks.run(_train_args(plan, ckpt, trace, "--resume"), timeout_s=90)
    assert rc == 0, err[-3000:]
    assert "resumed from" in out and "at epoch 1 step 4" in out

    got = _trace(trace)
    assert {k for k, _ in got} == set(ref_map), "every (epoch, step, rank) of the reference, and no other"
    wrong = [k for k, idx in got if idx != ref_map[k]]
    assert wrong == [], f"indices differ from the uninterrupted run at {wrong[:5]}"
    repeated = len(got) - len(ref_map)
    assert repeated >= 2 * 2, "steps 4.. of epoch 1 ran before the kill and again after the resume"

    a, b = _final(ref_ckpt), _final(ckpt)
    assert (a["epoch"], a["step"]) == (b["epoch"], b["step"]) == (EPOCHS, 0)
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        assert a["model"][name].dtype == torch.float64
        assert torch.equal(a["model"][name], b["model"][name]), name
    for i, sa in a["optimizer"]["state"].items():
        assert torch.equal(sa["momentum_buffer"], b["optimizer"]["state"][i]["momentum_buffer"])
    assert a["sampler"] == b["sampler"] and a["plan"] == b["plan"]


def _two_rank_checkpoint(tmp_path: Path) -> Path:
    """A checkpoint written by a 2-rank run with plan [7, 5] in the middle of epoch 1 (next step: 4)."""
    from planner.cli.checkpoint import save_checkpoint
    from planner.plan import Plan
    from runtime.sampler import HeteroBatchSampler
    from tests.reliability import _fixtures

    plan2 = write_plan(tmp_path / "plan2.json", [7, 5])
    model = _fixtures.model()
    sampler = HeteroBatchSampler.from_plan(str(plan2), 0, _fixtures.DATASET_LEN)
    sampler.set_epoch(1)
    save_checkpoint(tmp_path / "ckpt", epoch=1, step=4, model=model,
                    optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                    plan=Plan.load(plan2), sampler_state=sampler.state_dict(4))
    return tmp_path / "ckpt"


def test_elastic_restart_on_fewer_ranks_keeps_global_batch_and_coverage(tmp_path: Path) -> None:
    """2 ranks checkpoint mid-epoch, 1 rank resumes: same global batch, same global step, same samples left."""
    from planner.cli import main
    from runtime.sampler import HeteroBatchSampler
    from tests.reliability import _fixtures

    ckpt = _two_rank_checkpoint(tmp_path)
    import planner
    from tests.reliability.test_no_hangs import two_rank_profile

    first = two_rank_profile()
    one_rank = planner.Profile(hosts=first.hosts, ranks=(first.by_rank[0],))
    one = tmp_path / "plan1.json"
    planner.evaluate(one_rank, [12], num_workers=[0]).save(one)
    trace = tmp_path / "trace.jsonl"
    log = tmp_path / "run.jsonl"
    rc = main(["train", "--plan", str(one), "--device", "cpu", "--model", f"{FIX}:model", "--dataset",
               f"{FIX}:dataset", "--epochs", "2", "--checkpoint", str(ckpt), "--resume", "--log-file", str(log),
               "--trace-file", str(trace)])
    assert rc == 0
    resize = [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "resize"]
    assert resize and resize[0]["old_world_size"] == 2 and resize[0]["new_world_size"] == 1
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert (rows[0]["epoch"], rows[0]["step"]) == (1, 4)  # continued where the 2-rank run stopped
    # The remaining steps of epoch 1 hold exactly the samples the two old ranks had left, step by step.
    old = [HeteroBatchSampler(_fixtures.DATASET_LEN, [7, 5], r, seed=0) for r in range(2)]
    for s in old:
        s.set_epoch(1)
    old_steps = list(zip(*(list(s) for s in old), strict=True))
    epoch1 = [r for r in rows if r["epoch"] == 1]
    assert [r["step"] for r in epoch1] == list(range(4, len(old_steps)))
    for row in epoch1[:-1]:  # full steps: the very same samples
        assert sorted(row["indices"]) == sorted(old_steps[row["step"]][0] + old_steps[row["step"]][1])
    # The partial last step holds the same real samples; only the wrap-around padding differs (the old split
    # [7, 5] rounded 4 leftover samples up to 3 + 2, the new one takes exactly 4).
    last = epoch1[-1]
    assert set(last["indices"]) <= set(old_steps[last["step"]][0] + old_steps[last["step"]][1])
    assert len(set(last["indices"])) == _fixtures.DATASET_LEN - 12 * (len(old_steps) - 1)


@pytest.mark.subprocess
def test_elastic_restart_with_another_global_batch_is_refused_clearly(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from planner.cli import main

    ckpt = _two_rank_checkpoint(tmp_path)
    one_rank_plan = Path(__file__).resolve().parents[1] / "data" / "bad" / "args_good_plan.json"  # B = 16
    rc = main(["train", "--plan", str(one_rank_plan), "--device", "cpu", "--model", f"{FIX}:model",
               "--dataset", f"{FIX}:dataset", "--checkpoint", str(ckpt), "--resume",
               "--log-file", str(tmp_path / "run.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "keeps the global batch -- re-plan with --global-batch 12" in err
    assert not (tmp_path / "run.jsonl").exists()


def test_elastic_auto_restart_reprofiles_and_takes_the_global_batch_from_the_checkpoint(tmp_path: Path) -> None:
    from planner.cli import main
    from planner.plan import Plan

    ckpt = _two_rank_checkpoint(tmp_path)
    log = tmp_path / "run.jsonl"
    rc = main(["train", "--auto", "--quick", "--device", "cpu", "--model", f"{FIX}:model", "--dataset",
               f"{FIX}:dataset", "--epochs", "2", "--checkpoint", str(ckpt), "--resume", "--log-file", str(log),
               "--plan-out", str(tmp_path / "new_plan.json")])
    assert rc == 0
    new_plan = Plan.load(tmp_path / "new_plan.json")
    assert new_plan.world_size == 1 and new_plan.global_batch == 12  # re-planned for 1 rank, same global batch
    events = [e["event"] for e in map(json.loads, log.read_text().splitlines())]
    assert events[0] == "resize" and events.count("epoch") == 1 and events[-1] == "end"
