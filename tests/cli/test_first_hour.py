"""The first hour's surprises, each fixed or refused with one clear line: train --auto and plan.json, plans for
another workload, errors that name the flag typed, and your own model found in the current folder."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from planner import Profile, solve
from planner.cli import main
from planner.cli.cmd_train import auto_plan_out
from planner.errors import ValidationError

ROOT = Path(__file__).resolve().parents[2]
NOISY = ROOT / "tests" / "data" / "noisy_cpu_profile.json"  # measured for cifar_cnn, 3x32x32, 2 ranks


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


# -- train --auto and the plan file -------------------------------------------------------------------------------
def test_auto_never_overwrites_a_plan_it_did_not_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert auto_plan_out(None) == "plan.json"  # nothing there yet
    solve(Profile.load(NOISY), global_batch=64).save(tmp_path / "plan.json")  # made by hand with `planner plan`
    before = (tmp_path / "plan.json").read_text()
    rc, out, err = _run(["train", "--auto", "--global-batch", "64", "--device", "cpu", "--quick", "--model", "mlp"],
                        capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "--auto would overwrite plan.json, which `planner train --auto` did not write; pass --plan-out PATH" in err
    assert (tmp_path / "plan.json").read_text() == before
    assert auto_plan_out("plan.json") == "plan.json"  # asked for explicitly: the user's call
    assert auto_plan_out("elsewhere.json") == "elsewhere.json"
    # A plan an earlier --auto wrote may be replaced.
    data = json.loads(before)
    data["meta"]["written_by"] = "planner train --auto"
    (tmp_path / "plan.json").write_text(json.dumps(data))
    assert auto_plan_out(None) == "plan.json"
    (tmp_path / "plan.json").write_text("not json")  # unreadable: not ours either
    with pytest.raises(ValidationError, match="did not write"):
        auto_plan_out(None)


def test_auto_says_where_it_wrote_the_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    rc, out, err = _run(["train", "--auto", "--global-batch", "32", "--device", "cpu", "--quick", "--model", "mlp",
                         "--epochs", "1", "--num-samples", "256", "--data-on-device"], capsys)
    assert rc == 0, err
    assert "wrote the plan to plan.json (--plan-out PATH to choose)" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["meta"]["written_by"] == "planner train --auto"
    assert plan["meta"]["workload"] == {"model": "mlp", "sample_shape": [1, 28, 28]}
    assert "[train" in err and "rank 0 (cpu): compute sweep" in err and "epoch 0: 8 steps of 32 samples" in err


# -- a plan or profile made for another workload -----------------------------------------------------------------
@pytest.fixture()
def cifar_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    path = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(NOISY), "--global-batch", "64", "--out", str(path)]) == 0
    capsys.readouterr()
    return path


@pytest.mark.parametrize(("extra", "needle"), [
    (["--model", "mlp"], "the plan was measured for --model cifar_cnn but this run trains --model mlp; re-profile"),
    (["--model", "cifar_cnn", "--image-size", "16"],
     "the plan was measured for inputs 3x32x32 but this run feeds 3x16x16 (--image-size)"),
    (["--model", "mlp", "--profile", str(NOISY)], "the plan was measured for --model cifar_cnn"),
])
def test_train_refuses_a_plan_for_another_workload(extra: list[str], needle: str, cifar_plan: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(["train", "--plan", str(cifar_plan), "--device", "cpu", *extra], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert needle in err and "--allow-workload-mismatch" in err


def test_train_refuses_a_profile_for_another_workload_or_plan(tmp_path: Path, cifar_plan: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    # An old plan without its workload recorded: the profile still tells.
    plan = json.loads(cifar_plan.read_text())
    del plan["meta"]["workload"]
    old = tmp_path / "old_plan.json"
    old.write_text(json.dumps(plan))
    rc, _, err = _run(["train", "--plan", str(old), "--profile", str(NOISY), "--device", "cpu", "--model", "mlp"],
                      capsys)
    assert rc == 2 and "the profile was measured for --model cifar_cnn but this run trains --model mlp" in err
    # A profile other than the one the plan was solved from.
    other = tmp_path / "other.json"
    prof = json.loads(NOISY.read_text())
    prof["ranks"][1]["compute"][0]["step_time_s"] = 0.06
    other.write_text(json.dumps(prof))
    rc, _, err = _run(["train", "--plan", str(cifar_plan), "--profile", str(other), "--device", "cpu", "--model",
                       "cifar_cnn"], capsys)
    assert rc == 2 and "the plan was solved from another profile" in err


def test_allow_workload_mismatch_goes_on(cifar_plan: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Past the workload check, the next one speaks: this 2-rank plan on one process.
    rc, _, err = _run(["train", "--plan", str(cifar_plan), "--device", "cpu", "--model", "mlp",
                       "--allow-workload-mismatch"], capsys)
    assert rc == 2 and "the plan is for 2 rank(s) but 1 were launched" in err


# -- errors name the flag typed -----------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(("argv", "said"), [
    (["profile", "--devices", "cuda:0,cpu", "--model", "mlp", "--quick"], "--devices cuda:0,cpu: cuda:0"),
    (["bench", "--rank-devices", "cuda:0,cpu", "--quick"], "--rank-devices cuda:0,cpu: cuda:0"),
    (["bench", "--device", "cuda", "--quick"], "--device cuda: cuda"),
])
def test_a_missing_gpu_names_the_flag_typed(argv: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(argv, capsys)
    assert rc == 2 and err.count("\n") == 1  # bench: refused before any rank is spawned, no traceback
    assert err.startswith(f"error: {said} asked for, but CUDA is not available"), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_rank_devices_without_a_gpu_names_the_rank_devices_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    from planner.cli.distenv import init_from_env

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValidationError, match=r"^--rank-devices cuda:0: cuda:0 asked for"):
        init_from_env("auto", "cuda:0")


def test_ranks_that_share_a_gpu_all_reduce_over_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): a job that places them so gets gloo."""
    from planner.cli.distenv import shares_gpu

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert shares_gpu("cuda:0", None)  # every local rank on GPU 0
    assert not shares_gpu("cuda", None) and not shares_gpu("auto", None)  # cuda:LOCAL_RANK, one GPU each
    assert shares_gpu("auto", "cuda:0,cuda:0,cuda:1")
    assert not shares_gpu("auto", "cuda:0,cuda:1") and not shares_gpu("auto", "cuda:0,cpu,cpu")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert not shares_gpu("cuda:0", None)  # one rank on this host: nothing to share


# -- your own model, found in the current folder ------------------------------------------------------------------
MYMODEL = '''\
import torch
from torch import nn


def build(num_classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 16), nn.ReLU(), nn.Linear(16, num_classes))


def data() -> torch.utils.data.Dataset:
    return torch.utils.data.TensorDataset(torch.randn(64, 3, 8, 8), torch.randint(0, 10, (64,)))
'''


def test_own_model_factory_is_found_in_the_current_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "fh_mymodel.py").write_text(MYMODEL)
    monkeypatch.chdir(tmp_path)
    # What the `planner` console script sees: its own bin/ folder on sys.path, not the current folder.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "fh_mymodel", raising=False)
    try:
        rc, _out, err = _run(["profile", "--model", "fh_mymodel:build", "--dataset", "fh_mymodel:data", "--device",
                             "cpu", "--quick", "--no-loader", "--batch-sizes", "4,8", "--out", "p.json", "--quiet"],
                            capsys)
    finally:
        sys.modules.pop("fh_mymodel", None)
    assert rc == 0, err
    prof = Profile.load(tmp_path / "p.json")
    assert prof.model is not None and prof.model.name == "fh_mymodel:build"
    assert prof.meta["sample_shape"] == [3, 8, 8]
    assert "error" not in err
