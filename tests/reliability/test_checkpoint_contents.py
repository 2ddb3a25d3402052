"""A checkpoint's contents are checked against this run before any of it is loaded or announced.

- Data: a resume takes a left-off ``--dataset`` from the checkpoint only when it names no folder (a checkpoint's
  ``imagefolder:/`` walked the whole filesystem); the run record's sizes stay within what their flags accept typed
  (``num_samples`` 2**40 tried to allocate terabytes, ``image_size`` 2**20 a petabyte-sized layer).
- Model and optimizer: weights of another dtype (cast silently), optimizer state of another shape (a traceback at
  the first step, after the resume was announced), entries the optimizer does not keep, parameters no group lists,
  and a step beyond the epoch (printed as a negative step count) are one line, exit 2, before the "resumed" line.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from planner import solve
from planner.cli import main
from planner.cli.checkpoint import check_state_fits, checkpoint_fingerprint, load_checkpoint, save_checkpoint
from planner.errors import ValidationError
from tests.planner._profiles import linear_profile
from tests.reliability.test_divergence import one_rank_plan

FIX = "tests.reliability._fixtures"


def _record_checkpoint(folder: Path, run: dict[str, Any]) -> Path:
    """A 1-rank mlp checkpoint whose run record is edited as given; returns its plan file."""
    plan = solve(linear_profile([1.0]), global_batch=8)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    save_checkpoint(folder, epoch=0, step=1, model=model, optimizer=opt, plan=plan, sampler_state=None,
                    run={"model": "mlp", "dataset": "fake", "image_size": None, "num_samples": 64, "seed": 0,
                         "lr": 0.01, "global_batch": 8, "world_size": 1, "plan_fingerprint": plan.fingerprint} | run)
    plan.save(folder.parent / "plan.json")
    return folder.parent / "plan.json"


@pytest.mark.parametrize(("run", "expected"), [
    ({"dataset": "imagefolder:{tmp}/images"},
     "--resume: the checkpoint in {tmp}/ckpt was trained with --dataset 'imagefolder:{tmp}/images', which names a "
     "data folder; a checkpoint never chooses the files a run reads -- pass --dataset yourself to resume it"),
    ({"dataset": "cifar10:/data/cifar"}, "which names a data folder"),
    ({"num_samples": 2**40}, "refused: run.num_samples is 1099511627776, outside the 1..2147483647 its flag accepts"),
    ({"image_size": 2**20}, "refused: run.image_size is 1048576, outside the 1..8192 its flag accepts"),
], ids=["imagefolder-root", "cifar10-folder", "num-samples-2**40", "image-size-2**20"])
def test_data_the_checkpoint_would_choose_or_size_is_refused_in_one_line(
        run: dict[str, Any], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in run.items()}
    plan = _record_checkpoint(tmp_path / "ckpt", run)
    argv = ["train", "--plan", str(plan), "--device", "cpu", "--epochs", "1", "--checkpoint", str(tmp_path / "ckpt"),
            "--resume", "--model", "mlp"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected.format(tmp=tmp_path) in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_a_data_folder_typed_again_is_what_the_resume_compares() -> None:
    from planner.cli.preflight import _saved_value

    assert _saved_value("dataset", "fake", "ckpt") == "fake"
    assert _saved_value("dataset", "fake_text:64", "ckpt") == "fake_text:64"
    for spec in ("imagefolder:/", "mnist:/data/mnist", "cifar10:/data/cifar"):
        with pytest.raises(ValidationError, match="names a data folder"):
            _saved_value("dataset", spec, "ckpt")


@pytest.fixture(scope="module")
def epoch_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-rank run's checkpoint after one epoch (SGD with momentum: every parameter has a momentum buffer)."""
    tmp = tmp_path_factory.mktemp("trained")
    plan = one_rank_plan(tmp / "plan.json", 12)
    assert main(["train", "--plan", str(plan), "--device", "cpu", "--model", f"{FIX}:model", "--dataset",
                 f"{FIX}:dataset", "--epochs", "1", "--checkpoint", str(tmp / "ckpt"), "--quiet"]) == 0
    return tmp


def _momentum_of_another_shape(state: dict[str, Any]) -> None:
    state["optimizer"]["state"][0]["momentum_buffer"] = torch.zeros(3, dtype=torch.float64)


def _step_beyond_the_epoch(state: dict[str, Any]) -> None:
    state["step"] = 2**40


def _int64_weights(state: dict[str, Any]) -> None:
    key = next(iter(state["model"]))
    state["model"][key] = state["model"][key].round().long()


def _state_for_no_parameter(state: dict[str, Any]) -> None:
    state["optimizer"]["state"][99] = {"momentum_buffer": torch.zeros(3, dtype=torch.float64)}


def _state_sgd_does_not_keep(state: dict[str, Any]) -> None:
    state["optimizer"]["state"][0]["exp_avg"] = torch.zeros_like(state["optimizer"]["state"][0]["momentum_buffer"])


def _another_momentum(state: dict[str, Any]) -> None:
    state["optimizer"]["param_groups"][0]["momentum"] = 0.0


TAMPERED: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "momentum shape": (_momentum_of_another_shape,
                       "optimizer.state[0].momentum_buffer is torch.float64 [3] but its parameter is torch.float64 "
                       "[16, 8]"),
    "step": (_step_beyond_the_epoch, "step 1099511627776 is beyond an epoch of 9 steps"),
    "int64 weights": (_int64_weights, "model['0.weight'] is torch.int64 there and torch.float64 here"),
    "extra parameter": (_state_for_no_parameter, "optimizer.state holds parameter 99, which no parameter group lists"),
    "extra entry": (_state_sgd_does_not_keep, "optimizer.state[0] holds 'exp_avg', which SGD does not keep (it keeps momentum_buffer)"),
    "hyperparameter": (_another_momentum, "optimizer.param_groups[0].momentum is 0.0 there and 0.9 here"),
}


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_checkpoint_contents_that_do_not_fit_the_model_and_optimizer_are_one_line_before_any_output(
        case: str, epoch_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    edit, expected = TAMPERED[case]
    shutil.copytree(epoch_checkpoint / "ckpt", tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "checkpoint.pt"
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)
    before = path.read_bytes()
    argv = ["train", "--plan", str(epoch_checkpoint / "plan.json"), "--device", "cpu", "--model", f"{FIX}:model",
            "--dataset", f"{FIX}:dataset", "--epochs", "2", "--checkpoint", str(tmp_path / "ckpt"), "--resume"]
    capsys.readouterr()
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert f"{path}: refused: {expected}; it was not written by this run's model and optimizer" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "resumed from" not in out and "epoch 1" not in out, out  # nothing announced, nothing trained
    assert path.read_bytes() == before  # the checkpoint is kept as it was


def test_an_untampered_checkpoint_fits(epoch_checkpoint: Path) -> None:
    torch.manual_seed(0)
    from tests.reliability import _fixtures

    model = _fixtures.model()
    state = load_checkpoint(epoch_checkpoint / "ckpt", torch.device("cpu"))
    assert state is not None
    check_state_fits(state, model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), steps_per_epoch=9,
                     path=epoch_checkpoint / "ckpt")


def test_the_checkpoint_fingerprint_follows_its_contents(epoch_checkpoint: Path, tmp_path: Path) -> None:
    """What the ranks' resume agreement compares: a copy (another node's folder) matches, a checkpoint of another
    epoch does not, a folder without one has none, and a file that is not a zip archive is hashed whole."""
    source = epoch_checkpoint / "ckpt"
    shutil.copytree(source, tmp_path / "copy")
    assert checkpoint_fingerprint(tmp_path / "copy") == checkpoint_fingerprint(source) is not None
    state = torch.load(source / "checkpoint.pt", weights_only=True)
    state["epoch"] = 2
    (tmp_path / "other").mkdir()
    torch.save(state, tmp_path / "other" / "checkpoint.pt")
    assert checkpoint_fingerprint(tmp_path / "other") != checkpoint_fingerprint(source)
    assert checkpoint_fingerprint(tmp_path / "none") is None
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "checkpoint.pt").write_bytes(b"not a zip archive")
    assert checkpoint_fingerprint(tmp_path / "raw") == hashlib.sha256(b"not a zip archive").hexdigest()[:16]
