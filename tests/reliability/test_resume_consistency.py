"""``--resume`` compares the command line with what the checkpoint's run was started with.

It used to continue silently with the checkpoint's plan and learning rate whatever was given, and crash in
``load_state_dict`` (a multi-line traceback) on another model. Now a differing value is refused before anything
starts, in one line naming both values; ``--allow-resume-changes`` accepts a new lr, plan (same global batch),
seed or dataset and prints each change; the model and the global batch cannot change; a value not given is the
checkpoint's.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch

from planner.cli import main
from planner.plan import Plan
from tests.reliability.test_divergence import one_rank_plan

FIX = "tests.reliability._fixtures"


def _digest(*paths: Path) -> list[str]:
    return [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]


def _state(ckpt: Path) -> dict[str, Any]:
    return torch.load(ckpt / "checkpoint.pt", map_location="cpu", weights_only=True)  # type: ignore[no-any-return]


@pytest.fixture
def trained(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Path]:
    """One epoch of a 1-rank run at lr 0.05, seed 3, global batch 12, checkpointed; plus two other plans."""
    p = {"plan": one_rank_plan(tmp_path / "plan.json", 12),
         "plan_other_split": one_rank_plan(tmp_path / "plan_w1.json", 12, num_workers=1),  # same B, another plan
         "plan_b16": one_rank_plan(tmp_path / "plan_b16.json", 16),
         "ckpt": tmp_path / "ck", "log": tmp_path / "run.jsonl"}
    assert main(["train", "--plan", str(p["plan"]), "--device", "cpu", "--model", f"{FIX}:model", "--dataset",
                 f"{FIX}:dataset", "--epochs", "1", "--lr", "0.05", "--seed", "3", "--checkpoint", str(p["ckpt"]),
                 "--log-file", str(p["log"])]) == 0
    capsys.readouterr()
    return p


def _resume(p: dict[str, Path], *extra: str, plan: str = "plan") -> list[str]:
    return ["train", "--plan", str(p[plan]), "--device", "cpu", "--epochs", "2", "--checkpoint", str(p["ckpt"]),
            "--resume", "--log-file", str(p["log"]), *extra]


REFUSED = {
    "lr": ((["--lr", "0.5"], "plan"),
           "--resume: --lr 0.5 differs from the checkpoint's 0.05; resume with --lr 0.05, or pass "
           "--allow-resume-changes to continue with 0.5"),
    "seed": ((["--seed", "4"], "plan"), "--resume: --seed 4 differs from the checkpoint's 3"),
    "dataset": ((["--dataset", f"{FIX}:dataset_len_by_rank"], "plan"),
                f"--dataset {FIX}:dataset_len_by_rank differs from the checkpoint's {FIX}:dataset"),
    "plan": (([], "plan_other_split"), "differs from the checkpoint's"),
    "global-batch": (([], "plan_b16"), "--global-batch 16 differs from the checkpoint's 12; a resumed run keeps the "
                                        "global batch"),
    "model": ((["--model", "mlp"], "plan"), f"--model mlp differs from the checkpoint's {FIX}:model; the checkpoint "
                                            "holds that model's weights"),
    "model-even-when-allowed": ((["--model", "mlp", "--allow-resume-changes"], "plan"),
                                "--model mlp differs from the checkpoint's"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_differing_value_is_refused_naming_both(case: str, trained: dict[str, Path],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    (extra, plan), needle = REFUSED[case]
    before = _digest(trained["ckpt"] / "checkpoint.pt", trained["log"])
    rc = main(_resume(trained, *extra, plan=plan))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert needle in err, err
    if case == "plan":
        fp = Plan.load(trained["plan_other_split"]).fingerprint
        assert f"--plan {trained['plan_other_split']}: fingerprint {fp} differs" in err
        assert "pass the plan file the run started with" in err
    assert _digest(trained["ckpt"] / "checkpoint.pt", trained["log"]) == before  # nothing touched


def test_values_not_given_are_the_checkpoints(trained: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    # A model or dataset spec that names code is never taken from a checkpoint: the user types it.
    assert main(_resume(trained)) == 2
    assert f"--model '{FIX}:model', which names code to import" in capsys.readouterr().err
    # No --lr, --seed: the checkpoint's (0.01/0, the defaults, would differ)
    assert main(_resume(trained, "--model", f"{FIX}:model", "--dataset", f"{FIX}:dataset")) == 0
    state = _state(trained["ckpt"])
    assert (state["epoch"], state["step"]) == (2, 0)
    assert state["optimizer"]["param_groups"][0]["lr"] == 0.05
    assert (state["run"]["model"], state["run"]["seed"], state["run"]["lr"]) == (f"{FIX}:model", 3, 0.05)
    assert "resuming with" not in capsys.readouterr().out


def test_allowed_changes_are_applied_and_said(trained: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(_resume(trained, "--model", f"{FIX}:model", "--dataset", f"{FIX}:dataset", "--lr", "0.001",
                      "--allow-resume-changes", plan="plan_other_split"))
    out = capsys.readouterr().out
    assert rc == 0
    assert "resuming with --lr 0.001 instead of the checkpoint's 0.05 (--allow-resume-changes)" in out
    assert "resuming with --plan" in out
    state = _state(trained["ckpt"])
    assert state["optimizer"]["param_groups"][0]["lr"] == 0.001  # applied over the optimizer state's own rate
    other = Plan.load(trained["plan_other_split"])
    assert state["plan"]["fingerprint"] == other.fingerprint and state["run"]["plan_fingerprint"] == other.fingerprint


def test_an_old_checkpoint_of_another_model_is_one_line_not_a_traceback(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    # Written without the run record (as before it existed): only the weights themselves can tell.
    from planner.cli.checkpoint import save_checkpoint
    from tests.reliability import _fixtures

    plan = one_rank_plan(tmp_path / "plan.json", 12)
    model = _fixtures.model()
    save_checkpoint(tmp_path / "ck", epoch=1, step=0, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                    plan=Plan.load(plan), sampler_state=None)
    rc = main(["train", "--plan", str(plan), "--device", "cpu", "--model", "mlp", "--num-samples", "48",
               "--checkpoint", str(tmp_path / "ck"), "--resume", "--lr", "0.1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "holds another model's weights (" in err and "resume with the model it was trained with" in err
