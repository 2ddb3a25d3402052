"""A diverged loss is an outcome, not a crash.

``--lr 1e30``: the run stops at the end of the epoch where the loss first went non-finite, every rank with the
same one line "loss diverged at epoch E step S" (exit 2); the run log is readable to its end record, which says
why; the checkpoint folder keeps the last finite state (a mid-epoch save after the first bad step is skipped, the
epoch-end save is not made). Resuming it with a smaller --lr is refused unless allowed, then continues.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from planner.cli import main
from planner.runlog import read_run_log
from tests import _ranks
from tests.reliability.test_no_hangs import write_plan

# mlp on FakeData (float32): with --lr 1e30 the first update leaves finite but huge weights, the second loss is
# not finite -- the divergence is at step 1 of epoch 0, the state saved after step 0 is the last finite one.
COMMON = ["--device", "cpu", "--model", "mlp", "--num-samples", "48", "--epochs", "3", "--checkpoint-every", "1"]


def one_rank_plan(path: Path, global_batch: int, num_workers: int = 0) -> Path:
    """A plan for one CPU rank (rank 0 of the no-hangs profile), loader in the training process by default."""
    import planner
    from tests.reliability.test_no_hangs import two_rank_profile

    first = two_rank_profile()
    one = planner.Profile(hosts=first.hosts, ranks=(first.by_rank[0],))
    planner.evaluate(one, [global_batch], num_workers=[num_workers]).save(path)
    return path


def _state(ckpt: Path) -> dict[str, Any]:
    return torch.load(ckpt / "checkpoint.pt", map_location="cpu", weights_only=True)  # type: ignore[no-any-return]


def _finite(state: dict[str, Any]) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in state["model"].values() if v.is_floating_point())


def _check_outcome(log: Path, ckpt: Path) -> None:
    run = read_run_log(log)  # strictly readable: every line JSON, null where the loss was not finite
    assert run.ended and run.end_reason == "loss diverged at epoch 0 step 1"
    assert [e.epoch for e in run.epochs] == [0] and run.epochs[0].loss is None
    assert all(json.loads(line) for line in log.read_text().splitlines())
    state = _state(ckpt)
    assert (state["epoch"], state["step"]) == (0, 1), "the state after step 0, saved before the divergence"
    assert _finite(state)
    assert state["run"]["lr"] == 1e30


def test_diverged_loss_stops_with_one_line_and_keeps_the_last_finite_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = one_rank_plan(tmp_path / "plan.json", 16)
    log, ckpt = tmp_path / "run.jsonl", tmp_path / "ck"
    rc = main(["train", "--plan", str(plan), *COMMON, "--lr", "1e30", "--log-file", str(log), "--checkpoint",
               str(ckpt)])
    err = capsys.readouterr().err
    err = _without_progress(err)
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: loss diverged at epoch 0 step 1 (--lr 1e+30); the run stopped and ")
    assert f"{ckpt} keeps the last finite state (epoch 0 step 1)" in err
    _check_outcome(log, ckpt)


@pytest.mark.distributed
def test_two_gloo_ranks_stop_together_with_the_same_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = write_plan(tmp_path / "plan.json", [7, 5])
    log, ckpt = tmp_path / "run.jsonl", tmp_path / "ck"
    args = ["train", "--plan", str(plan), *COMMON, "--log-file", str(log), "--checkpoint", str(ckpt)]
    # The ranks run on the tests' fork-server launcher (torchrun's environment; each rank's exit code read directly).
    codes, _, err, _ = _ranks.run_each([*args, "--lr", "1e30"], timeout_s=120)
    assert codes == [2, 2], (codes, err[-3000:])  # both ranks, by themselves, with the user-error code
    lines = [ln for ln in err.splitlines() if "loss diverged" in ln]
    assert len(lines) == 2 and all("loss diverged at epoch 0 step 1 (--lr 1e+30)" in ln for ln in lines), err[-3000:]
    assert "Traceback" not in err, err[-3000:]  # no rank printed one
    assert all("keeps the last finite state (epoch 0 step 1)" in ln for ln in lines)  # both name rank 0's save
    _check_outcome(log, ckpt)
    before = (ckpt / "checkpoint.pt").read_bytes()

    # The checkpoint's lr is 1e30: another one is a change the user must ask for (checked before any rank starts).
    rc = main(["train", "--plan", str(plan), *COMMON, "--log-file", str(log), "--checkpoint", str(ckpt), "--resume",
               "--lr", "0.01"])
    err = _without_progress(capsys.readouterr().err)
    assert rc == 2 and err.count("\n") == 1
    assert "--resume: --lr 0.01 differs from the checkpoint's 1e+30" in err and "--allow-resume-changes" in err
    assert (ckpt / "checkpoint.pt").read_bytes() == before



def test_a_good_checkpoint_survives_a_diverged_resume_and_resumes_again(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Epoch 0 at a sane lr, then a resume at --lr 1e30 that diverges in epoch 1: the epoch-0 checkpoint is what the
    folder still holds, and resuming it at a sane lr finishes the run, in the same log."""
    plan = one_rank_plan(tmp_path / "plan.json", 16)
    log, ckpt = tmp_path / "run.jsonl", tmp_path / "ck"
    base = ["train", "--plan", str(plan), "--device", "cpu", "--model", "mlp", "--num-samples", "48", "--log-file",
            str(log), "--checkpoint", str(ckpt)]
    assert main([*base, "--epochs", "1", "--lr", "0.05"]) == 0
    good = (ckpt / "checkpoint.pt").read_bytes()
    capsys.readouterr()
    rc = main([*base, "--epochs", "3", "--resume", "--lr", "1e30", "--allow-resume-changes"])
    err = _without_progress(capsys.readouterr().err)
    assert rc == 2 and err.count("\n") == 1
    assert "loss diverged at epoch 1 step 1 (--lr 1e+30)" in err and "(epoch 1 step 0)" in err
    assert (ckpt / "checkpoint.pt").read_bytes() == good  # the diverged epoch saved nothing over it
    assert read_run_log(log).end_reason == "loss diverged at epoch 1 step 1"
    rc = main([*base, "--epochs", "3", "--resume", "--lr", "0.05", "--allow-resume-changes"])
    out = capsys.readouterr().out
    assert rc == 0 and "resuming with --lr 0.05 instead of the checkpoint's 1e+30" not in out  # saved lr is 0.05
    state = _state(ckpt)
    assert (state["epoch"], state["step"]) == (3, 0) and _finite(state)
    events = [json.loads(line)["event"] for line in log.read_text().splitlines()]
    assert events.count("start") == 1 and events[-1] == "end"
    assert math.isfinite(read_run_log(log).epochs[-1].loss or math.nan)


def test_any_other_failure_still_ends_the_log_with_why(tmp_path: Path) -> None:
    plan = one_rank_plan(tmp_path / "plan.json", 12)
    log = tmp_path / "run.jsonl"
    with pytest.raises(RuntimeError, match="injected failure"):  # an internal error: main_and_exit makes it exit 1
        main(["train", "--plan", str(plan), "--device", "cpu", "--model", "tests.reliability._fixtures:failing_model",
              "--dataset", "tests.reliability._fixtures:dataset", "--epochs", "2", "--log-file", str(log)])
    run = read_run_log(log)
    assert run.ended and run.end_reason == "stopped: RuntimeError: injected failure at forward call 3"


def _without_progress(err: str) -> str:
    """stderr less the progress lines ("[train   3s] epoch 0: ..."; planner/cli/progress.py): the error is one line."""
    return "".join(line for line in err.splitlines(keepends=True) if not line.startswith("["))
