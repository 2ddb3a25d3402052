"""A checkpoint is data, never code (docs/SECURITY.md).

A ``checkpoint.pt`` whose pickle would run a command on load (``__reduce__`` -> ``os.system``) is refused with one
line naming the file -- through the Python API and through ``planner train --resume`` -- and the command never
runs. What ``save_checkpoint`` writes holds only tensors and plain data and reads back equal.
"""

from __future__ import annotations

import builtins
import json
import os
import pickle
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from planner import solve
from planner.cli.checkpoint import CHECKPOINT_NAME, CHECKPOINT_VERSION, load_checkpoint, save_checkpoint
from planner.errors import ValidationError
from runtime import HeteroBatchSampler, Replanner
from tests.planner._profiles import linear_profile

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


class _RunsShell:
    """Unpickling this calls os.system(command): what a tampered checkpoint carries."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.command,))


class _RunsPython:
    """Unpickling this calls exec(source): no import of os needed, a builtin is enough."""

    def __init__(self, source: str) -> None:
        self.source = source

    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.exec, (self.source,))


def _zip(obj: Any, path: Path) -> None:
    torch.save(obj, path)


def _legacy(obj: Any, path: Path) -> None:
    torch.save(obj, path, _use_new_zipfile_serialization=False)


def _raw_pickle(obj: Any, path: Path) -> None:
    path.write_bytes(pickle.dumps(obj, protocol=2))


def _raw_pickle_framed(obj: Any, path: Path) -> None:
    path.write_bytes(pickle.dumps(obj, protocol=4))


REFUSED = "refused: the checkpoint holds objects other than tensors and plain data"
# writer -> how the refusal starts. Protocol 4 frames its opcodes (FRAME), which torch's safe unpickler does not
# read at all: it stops there, before the payload's GLOBAL, so the file is "not readable" rather than "refused".
WRITERS: dict[str, tuple[Callable[[Any, Path], None], str]] = {
    "torch.save": (_zip, REFUSED),
    "torch.save-legacy": (_legacy, REFUSED),
    "pickle-protocol-2": (_raw_pickle, REFUSED),
    "pickle-protocol-4": (_raw_pickle_framed, "not a readable checkpoint (UnpicklingError"),
}


def _write_malicious(directory: Path, marker: Path, *, payload: str = "shell",
                     writer: Callable[[Any, Path], None] = _zip) -> Path:
    """A checkpoint laid out like ours whose "plan" entry creates `marker` when unpickled."""
    directory.mkdir(parents=True, exist_ok=True)
    evil = (_RunsShell(f"touch '{marker}'") if payload == "shell"
            else _RunsPython(f"open({str(marker)!r}, 'w').close()"))
    state = {"version": CHECKPOINT_VERSION, "epoch": 0, "step": 0, "model": {}, "optimizer": {}, "plan": evil,
             "sampler": None, "replanner": None}
    writer(state, directory / CHECKPOINT_NAME)
    return directory / CHECKPOINT_NAME


@pytest.mark.parametrize("writer", WRITERS, ids=list(WRITERS))
@pytest.mark.parametrize("payload", ["shell", "python"])
def test_reduce_payload_is_refused_and_never_runs(payload: str, writer: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    write, refusal = WRITERS[writer]
    path = _write_malicious(tmp_path / "ckpt", marker, payload=payload, writer=write)
    with pytest.raises(ValidationError) as e:
        load_checkpoint(tmp_path / "ckpt", CPU)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"{path}: {refusal}"), msg
    assert "delete it to start afresh" in msg
    if refusal == REFUSED:
        # the callable the payload names: posix.system, or exec (torch names builtins without their module)
        named = re.search(r"unsupported global (\S+)\)", msg)
        assert named is not None and named.group(1).endswith("system" if payload == "shell" else "exec"), msg
    assert "weights_only=False" not in msg  # torch's advice to load it unsafely is not passed on
    assert not marker.exists()
    assert path.exists()  # kept for the user to inspect


def _train_cli(ckpt: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """`python -m planner train --auto ... --resume` on one process (no torchrun), with a deadline."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    argv = [sys.executable, "-m", "planner", "train", "--auto", *extra, "--device", "cpu", "--quick", "--model",
            "mlp", "--num-samples", "64", "--epochs", "1", "--checkpoint", str(ckpt), "--resume"]
    return subprocess.run(argv, cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=120)


# Without --global-batch the elastic restart reads it from the checkpoint before anything else runs; with it, the
# checkpoint is first read inside train(), after --auto has profiled and planned (a few seconds with --quick).
@pytest.mark.subprocess
@pytest.mark.parametrize("extra", [["--global-batch", "8"], []], ids=["global-batch-given", "global-batch-saved"])
def test_cli_resume_refuses_malicious_checkpoint(extra: list[str], tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = _write_malicious(tmp_path / "ckpt", marker)
    proc = _train_cli(tmp_path / "ckpt", *extra)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {path}: {REFUSED} (weights_only load failed: unsupported global "), lines
    assert not marker.exists()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [CHECKPOINT_NAME]  # nothing else written


def _tampered(tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A checkpoint save_checkpoint wrote, with one non-tensor value changed by hand."""
    plan = solve(linear_profile([1.0]), global_batch=8)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    save_checkpoint(tmp_path, epoch=0, step=1, model=model, optimizer=opt, plan=plan,
                    sampler_state=HeteroBatchSampler(64, [8], 0).state_dict(),
                    run={"model": "mlp", "dataset": "fake", "seed": 0, "lr": 0.01, "global_batch": 8})
    state = torch.load(tmp_path / CHECKPOINT_NAME, weights_only=True)
    edit(state)
    torch.save(state, tmp_path / CHECKPOINT_NAME)
    return tmp_path


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda s: s.__setitem__("optimizer", {}), "optimizer.state is missing"),
    (lambda s: s["optimizer"]["param_groups"][0].__setitem__("lr", "0.1"), "param_groups[0].lr is 0.1, expected"),
    (lambda s: s["optimizer"].__setitem__("param_groups", []), "param_groups is missing, empty"),
    (lambda s: s.__setitem__("epoch", 10**18), "epoch is 1000000000000000000, expected an integer in 0.."),
    (lambda s: s["model"].__setitem__("weight", "x"), "model['weight'] is a str, expected a tensor"),
    (lambda s: s["run"].__setitem__("lr", "0.1"), "run.lr is str 0.1"),
    (lambda s: s["run"].__setitem__("global_batch", 2**80), "run.global_batch is int"),
], ids=["empty-optimizer", "string-lr", "no-param-groups", "epoch-1e18", "model-value", "run-lr", "run-batch"])
def test_tampered_contents_are_refused_in_one_line(edit: Callable[[dict[str, Any]], None], needle: str,
                                                   tmp_path: Path) -> None:
    folder = _tampered(tmp_path, edit)
    with pytest.raises(ValidationError) as e:
        load_checkpoint(folder, CPU)
    msg = str(e.value)
    assert "\n" not in msg and needle in msg and "refused" in msg, msg


def test_a_tampered_sampler_state_is_refused_on_resume(tmp_path: Path) -> None:
    def drop_key(state: dict[str, Any]) -> None:
        del state["sampler"]["batch_sizes"]

    state = load_checkpoint(_tampered(tmp_path, drop_key), CPU)
    assert state is not None
    with pytest.raises(ValidationError, match="sampler state: missing batch_sizes"):
        HeteroBatchSampler(64, [8], 0).load_state_dict(state["sampler"])


@pytest.mark.parametrize(("state", "needle"), [
    ([1, 2], "expected a dict of version, epoch, step"),
    ({"version": 0}, f"checkpoint version 0 is not {CHECKPOINT_VERSION}"),
    ({"version": CHECKPOINT_VERSION, "epoch": 0}, "missing step, model, optimizer, plan, sampler, replanner"),
    ({"version": CHECKPOINT_VERSION, "epoch": -1, "step": 0, "model": {}, "optimizer": {}, "plan": {},
      "sampler": None, "replanner": None}, "epoch is -1, expected an integer in 0..2147483648"),
    ({"version": CHECKPOINT_VERSION, "epoch": 0, "step": 0, "model": [], "optimizer": {}, "plan": {},
      "sampler": None, "replanner": None}, "model is a list, expected dict"),
    ({"version": CHECKPOINT_VERSION, "epoch": 0, "step": 0, "model": {}, "optimizer": {}, "plan": {"kind": "x"},
      "sampler": None, "replanner": None}, "refused: plan"),
], ids=["not-a-dict", "old-version", "missing-keys", "negative-epoch", "model-not-a-dict", "bad-plan"])
def test_data_that_is_not_our_checkpoint_is_refused_in_one_line(state: Any, needle: str, tmp_path: Path) -> None:
    tmp_path.joinpath(CHECKPOINT_NAME).write_bytes(b"")
    torch.save(state, tmp_path / CHECKPOINT_NAME)
    with pytest.raises(ValidationError) as e:
        load_checkpoint(tmp_path, CPU)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{tmp_path / CHECKPOINT_NAME}: refused: ") and needle in msg, msg


def test_garbage_is_not_a_readable_checkpoint(tmp_path: Path) -> None:
    (tmp_path / CHECKPOINT_NAME).write_bytes(b"not a checkpoint\x00\x01")
    with pytest.raises(ValidationError, match=r"checkpoint.pt: not a readable checkpoint \(UnpicklingError: ") as e:
        load_checkpoint(tmp_path, CPU)
    assert "\n" not in str(e.value)


def _parts() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, Any, Any]:
    """A model and SGD with momentum after one step, a solved plan, a sampler position and a re-planner."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(6, 4, dtype=torch.float64)).square().mean().backward()
    opt.step()
    profile = linear_profile([0.001, 0.002])
    plan = solve(profile, global_batch=96)
    sampler = HeteroBatchSampler.from_plan(plan, 0, 1000, seed=3)
    return model, opt, plan, sampler, Replanner(profile, plan)


def test_round_trip_is_data_only_and_equal(tmp_path: Path) -> None:
    model, opt, plan, sampler, replanner = _parts()
    sampler_state = sampler.state_dict(0)
    path = save_checkpoint(tmp_path, epoch=1, step=4, model=model, optimizer=opt, plan=plan,
                           sampler_state=sampler_state, replanner=replanner)
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_NAME]  # no temp file left
    torch.load(path, map_location=CPU, weights_only=True)  # readable by torch's safe loader alone

    state = load_checkpoint(tmp_path, CPU)
    assert state is not None
    assert (state["version"], state["epoch"], state["step"]) == (CHECKPOINT_VERSION, 1, 4)
    saved_model = model.state_dict()
    assert list(state["model"]) == list(saved_model)
    assert all(torch.equal(state["model"][k], v) for k, v in saved_model.items())
    saved_opt = opt.state_dict()
    assert state["optimizer"]["param_groups"] == saved_opt["param_groups"]
    assert state["optimizer"]["state"].keys() == saved_opt["state"].keys()
    assert all(torch.equal(state["optimizer"]["state"][i]["momentum_buffer"], s["momentum_buffer"])
               for i, s in saved_opt["state"].items())
    # The JSON-able parts come back as their JSON round trip (tuples as lists).
    assert state["plan"] == json.loads(json.dumps(plan.to_dict()))
    assert state["sampler"] == json.loads(json.dumps(sampler_state))
    assert state["replanner"] == json.loads(json.dumps(replanner.state_dict()))

    # ... and resume: fresh objects loaded from it hold the saved values.
    model2, opt2, _, sampler2, replanner2 = _parts()
    torch.nn.init.zeros_(model2[0].weight)
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["optimizer"])
    sampler2.load_state_dict(state["sampler"])
    replanner2.load_state_dict(state["replanner"])
    assert all(torch.equal(a, b) for a, b in zip(model2.state_dict().values(), saved_model.values(), strict=True))
    assert sampler2.state_dict(0) == sampler_state
    assert json.dumps(replanner2.state_dict()) == json.dumps(replanner.state_dict())


def test_numpy_scalars_are_saved_as_python_numbers(tmp_path: Path) -> None:
    model, opt, plan, sampler, _ = _parts()
    sampler_state = {**sampler.state_dict(0), "step": np.int64(0), "seed": np.int32(3)}
    save_checkpoint(tmp_path, epoch=0, step=0, model=model, optimizer=opt, plan=plan, sampler_state=sampler_state)
    state = load_checkpoint(tmp_path, CPU)
    assert state is not None
    assert type(state["sampler"]["step"]) is int and type(state["sampler"]["seed"]) is int
    assert state["replanner"] is None


def test_saving_an_object_is_our_bug_and_names_the_key(tmp_path: Path) -> None:
    model, opt, plan, sampler, _ = _parts()
    sampler_state = {**sampler.state_dict(0), "extra": [1, {"when": object()}]}
    with pytest.raises(TypeError, match=r"checkpoint sampler\.extra\[1\]\.when: builtins\.object is not plain data"):
        save_checkpoint(tmp_path, epoch=0, step=0, model=model, optimizer=opt, plan=plan, sampler_state=sampler_state)
    assert list(tmp_path.iterdir()) == []  # refused before the temp file exists


def test_torch_without_a_safe_weights_only_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, plan, _, _ = _parts()
    save_checkpoint(tmp_path, epoch=0, step=0, model=model, optimizer=opt, plan=plan, sampler_state=None)
    monkeypatch.setattr(torch, "__version__", "2.5.1+cu124")
    with pytest.raises(ValidationError, match=r"checkpoint.pt: refused: resuming needs torch >= 2\.6 \(torch 2\.5\.1"):
        load_checkpoint(tmp_path, CPU)
