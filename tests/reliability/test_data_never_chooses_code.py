"""Files are data: a checkpoint never names the code `--resume` imports, and a profile or plan never sets an
environment variable outside the NCCL settings the profiler measures, nor a value a shell would run
(docs/SECURITY.md, "what may come from files")."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from planner import CommProfile, Plan, Profile, solve
from planner.cli.checkpoint import save_checkpoint
from planner.errors import ValidationError
from planner.launchenv import LAUNCH_ENV_VARS, check_launch_env, export_lines
from tests.planner._profiles import linear_profile

REPO = Path(__file__).resolve().parents[2]
EVIL_MODULE = '''\
import pathlib
pathlib.Path(__file__).with_name("IMPORTED").write_text("the checkpoint chose this code")
def build(*args, **kwargs):
    pathlib.Path(__file__).with_name("CALLED").write_text("and called it")
    raise SystemExit(0)
'''


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _checkpoint(folder: Path, run: dict[str, Any]) -> Plan:
    plan = solve(linear_profile([1.0]), global_batch=8)
    model = torch.nn.Linear(784, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    save_checkpoint(folder, epoch=0, step=1, model=model, optimizer=opt, plan=plan, sampler_state=None,
                    run={"model": "mlp", "dataset": "fake", "image_size": None, "num_samples": 64, "seed": 0,
                         "lr": 0.01, "global_batch": 8, "world_size": 1, "plan_fingerprint": plan.fingerprint} | run)
    return plan


def _resume_argv(tmp_path: Path, key: str, spec: str) -> list[str]:
    (tmp_path / "evilmod.py").write_text(EVIL_MODULE)  # in the working folder: importable if anything imports it
    plan = _checkpoint(tmp_path / "ckpt", {key: spec})
    plan.save(tmp_path / "plan.json")
    given = ["--model", "mlp"] if key == "dataset" else ["--dataset", "fake"]
    return ["train", "--plan", "plan.json", "--device", "cpu", "--epochs", "1", "--checkpoint", "ckpt", "--resume",
            *given]


def _refused(err: str, key: str, spec: str, tmp_path: Path) -> None:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"--{key} '{spec}', which names code to import" in err
    assert f"pass --{key} yourself" in err
    assert not (tmp_path / "IMPORTED").exists() and not (tmp_path / "CALLED").exists()


# Specs whose import would take the process down (a listener that never returns, an abort): in a process of
# their own, as a user would meet them.
@pytest.mark.parametrize(("key", "spec"), [("model", "http.server:test"), ("model", "os:abort")])
@pytest.mark.subprocess
def test_resume_never_imports_the_code_a_checkpoint_names(key: str, spec: str, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "planner", *_resume_argv(tmp_path, key, spec)]
    proc = subprocess.run(argv, cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    _refused(proc.stderr, key, spec, tmp_path)


@pytest.mark.parametrize(("key", "spec"), [("model", "evilmod:build"), ("dataset", "evilmod:build"),
                                           ("dataset", "this:nothing")])
def test_resume_never_imports_a_checkpoints_spec_in_process(key: str, spec: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from planner.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "evilmod", raising=False)
    assert main(_resume_argv(tmp_path, key, spec)) == 2
    out = capsys.readouterr()
    _refused(out.err, key, spec, tmp_path)
    assert "evilmod" not in sys.modules and "Beautiful is better" not in out.out  # this:nothing prints the Zen


def test_resume_takes_a_builtin_spec_from_the_checkpoint_and_compares_a_typed_one(tmp_path: Path) -> None:
    from planner.cli.preflight import _saved_value

    assert _saved_value("model", "resnet50", "ckpt") == "resnet50"
    assert _saved_value("model", "tiny_lm:small", "ckpt") == "tiny_lm:small"
    assert _saved_value("dataset", "fake_text:64", "ckpt") == "fake_text:64"
    with pytest.raises(ValidationError, match="names code"):
        _saved_value("model", "tiny_lm_evil:build", "ckpt")
    with pytest.raises(ValidationError, match="records --lr as str"):
        _saved_value("lr", "0.1", "ckpt")


def _profile_with(tmp_path: Path, launch_env: dict[str, Any]) -> Path:
    """A valid profile file whose comm.launch_env is edited by hand, as an attacker would."""
    path = tmp_path / "profile.json"
    prof = linear_profile([1.0, 2.0])
    data = prof.to_dict()
    data.setdefault("comm", {})["launch_env"] = launch_env
    path.write_text(json.dumps(data))
    return path


INJECTIONS = [
    {"NCCL_MIN_CTAS": "2; touch MARK #"},
    {"NCCL_MIN_CTAS": "$(touch MARK)"},
    {"NCCL_MIN_CTAS": "2\ntouch MARK"},
    {"LD_PRELOAD": "/tmp/evil.so"},
    {"X=1; touch MARK; Y": "2"},
    {"NCCL_MIN_CTAS": 2},
]


@pytest.mark.parametrize("launch_env", INJECTIONS[:2])
@pytest.mark.subprocess
def test_print_env_runs_nothing_from_a_profile_in_the_shell(launch_env: dict[str, Any], tmp_path: Path) -> None:
    path = _profile_with(tmp_path, launch_env)
    script = f'eval "$({sys.executable} -m planner plan --profile {path} --global-batch 8 --print-env)"'
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=_clean_env(), capture_output=True, text=True,
                          timeout=60)
    assert not (tmp_path / "MARK").exists()
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1 and "launch_env" in proc.stderr, proc.stderr


@pytest.mark.parametrize("launch_env", INJECTIONS)
def test_print_env_refuses_a_profile_setting_outside_the_allowlist(launch_env: dict[str, Any], tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from planner.cli import main

    path = _profile_with(tmp_path, launch_env)
    for argv in (["plan", "--profile", str(path), "--global-batch", "8", "--print-env"], ["validate", str(path)]):
        assert main(argv) == 2
        out = capsys.readouterr()
        assert out.out == "" and out.err.count("\n") == 1 and "launch_env" in out.err, (argv, out)


@pytest.mark.subprocess
def test_print_env_output_is_quoted_and_evaluates_to_the_setting(tmp_path: Path) -> None:
    path = _profile_with(tmp_path, {"NCCL_MIN_CTAS": "2", "NCCL_MAX_CTAS": "2"})
    script = (f'eval "$({sys.executable} -m planner plan --profile {path} --global-batch 8 --print-env)" && '
              'echo "$NCCL_MIN_CTAS/$NCCL_MAX_CTAS"')
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=_clean_env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "2/2"


def test_the_allowlist_holds_in_every_carrier(tmp_path: Path) -> None:
    bad = {"LD_PRELOAD": "/tmp/evil.so"}
    for carrier in (lambda: check_launch_env(bad), lambda: export_lines(bad)):
        with pytest.raises(ValidationError, match="LD_PRELOAD"):
            carrier()
    prof = linear_profile([1.0, 2.0])
    with pytest.raises(ValidationError, match="LD_PRELOAD"):
        CommProfile(launch_env=bad)
    plan = solve(prof, global_batch=8)
    with pytest.raises(ValidationError, match="LD_PRELOAD"):
        dataclasses.replace(plan, launch_env=bad)
    data = plan.to_dict()
    data["launch_env"] = bad  # the fingerprint is checked after the fields: the allowlist speaks first
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(ValidationError, match="LD_PRELOAD"):
        Plan.load(tmp_path / "plan.json")
    with pytest.raises(ValidationError, match="LD_PRELOAD"):
        Profile.load(_profile_with(tmp_path, bad))
    from planner.cli.cmd_train import apply_launch_env

    before = os.environ.get("LD_PRELOAD")
    with pytest.raises(ValidationError, match="LD_PRELOAD"):
        apply_launch_env(bad)
    assert os.environ.get("LD_PRELOAD") == before


def test_the_profiler_measures_only_allowed_settings() -> None:
    from profiler.comm import NCCL_CTA_VARIANTS

    for env in NCCL_CTA_VARIANTS:
        assert check_launch_env(env) == env
    assert set(LAUNCH_ENV_VARS) >= {k for env in NCCL_CTA_VARIANTS for k in env}
