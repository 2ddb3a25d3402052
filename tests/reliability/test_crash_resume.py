"""kill -9 of a whole 2-rank job mid-epoch, then ``--resume``: same (epoch, step, rank) indices, equal parameters.

"Equal sequence" (docs/RELIABILITY.md): the steps between the last checkpoint and the kill run twice -- once
before the kill, once after the resume -- so the resumed trace holds those (epoch, step, rank) keys twice. The
guarantee is that every key of the uninterrupted run appears, no other key appears, and every occurrence of a key
carries exactly the indices the uninterrupted run used. In float64 on CPU the final parameters and optimizer
state are then bit-identical to the uninterrupted run's.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from tests.reliability import _torchrun
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
    return torch.load(ckpt / "checkpoint.pt", map_location="cpu", weights_only=False)  # type: ignore[no-any-return]


@pytest.mark.distributed
def test_kill9_mid_epoch_then_resume_equals_uninterrupted(tmp_path: Path) -> None:
    plan = write_plan(tmp_path / "plan.json", [7, 5])
    # 1. the reference: one uninterrupted run
    ref_ckpt, ref_trace = tmp_path / "ref_ckpt", tmp_path / "ref_trace"
    rc, _, err, _ = _torchrun.run(_train_args(plan, ref_ckpt, ref_trace), timeout_s=90)
    assert rc == 0, err[-3000:]
    ref = _trace(ref_trace)
    ref_map = dict(ref)
    assert len(ref) == len(ref_map) == EPOCHS * STEPS * 2  # every step once per rank

    # 2. the same run, slowed down so it can be killed mid-epoch, then SIGKILLed as a whole (torchrun + ranks)
    ckpt, trace = tmp_path / "ckpt", tmp_path / "trace"
    log = (tmp_path / "killed.log").open("w")
    proc = _torchrun.start(_train_args(plan, ckpt, trace), env={"RELIABILITY_STEP_SLEEP_S": "0.1"},
                           stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while not any(k[:2] >= KILL_AT and k[2] == 0 for k, _ in _trace(trace)):
            assert proc.poll() is None, "the run ended before it could be killed:\n" + (tmp_path / "killed.log").read_text()
            assert time.monotonic() < deadline, "the run never reached the kill point"
            time.sleep(0.02)
        pids = _torchrun.job_pids(proc)
        assert len(pids) >= 3, "torchrun and its two ranks"
        _torchrun.kill_job(pids)  # kill -9 of every process of the job, mid-epoch
        proc.wait(timeout=30)
        assert _all_dead(pids[1:]), "the ranks are gone too (not orphans still writing checkpoints)"
    finally:
        _torchrun.stop(proc)
        log.close()
    state = _final(ckpt)
    assert (state["epoch"], state["step"]) == (1, 4), "the last checkpoint before the kill"
    killed_keys = {k for k, _ in _trace(trace)}
    assert (EPOCHS - 1, STEPS - 1, 0) not in killed_keys  # it really died before the end

    # 3. resume from the checkpoint: no sleep needed now
    rc, out, err, _ = _torchrun.run(_train_args(plan, ckpt, trace, "--resume"), timeout_s=90)
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


def test_restart_with_another_world_size_is_refused_clearly(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Elastic restarts are not supported yet: a checkpoint of 2 ranks resumed by 1 fails with one clear line."""
    from planner.cli import main
    from planner.plan import Plan
    from runtime.checkpoint import save_checkpoint
    from runtime.sampler import HeteroBatchSampler
    from tests.reliability import _fixtures

    plan2 = write_plan(tmp_path / "plan2.json", [7, 5])
    model = _fixtures.slow_model()
    sampler = HeteroBatchSampler.from_plan(str(plan2), 0, _fixtures.DATASET_LEN)
    sampler.set_epoch(1)
    save_checkpoint(tmp_path / "ckpt", epoch=1, step=4, model=model,
                    optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                    plan=Plan.load(plan2), sampler_state=sampler.state_dict(4))
    one_rank_plan = Path(__file__).resolve().parents[1] / "data" / "bad" / "args_good_plan.json"
    rc = main(["train", "--plan", str(one_rank_plan), "--device", "cpu", "--model", f"{FIX}:slow_model",
               "--dataset", f"{FIX}:dataset", "--checkpoint", str(tmp_path / "ckpt"), "--resume",
               "--log-file", str(tmp_path / "run.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "sampler state was saved with world_size=2 but this sampler has world_size=1" in err
    assert not (tmp_path / "run.jsonl").exists()
