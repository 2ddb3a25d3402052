"""Every output is checked before any work, and one run at a time owns a checkpoint folder and a run log.

``--step-log`` pointed at the ``--plan`` file used to append JSON lines to the plan (exit 0, the plan no longer
validated), and pointed into a missing folder it raised a traceback after the first epoch; two runs on one
``--checkpoint``/``--log-file`` both passed the fresh-run checks, interleaved one log and overwrote each other's
checkpoints.  Now both are refused in one line, exit 2, before anything is trained.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from planner.cli import main
from tests.reliability.test_divergence import one_rank_plan

REPO = Path(__file__).resolve().parents[2]
COMMON = ["--device", "cpu", "--model", "mlp", "--num-samples", "32"]


def _one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:") or "Traceback" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("where", ["the-plan", "missing-folder"])
def test_step_log_is_checked_before_any_work(where: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    plan = one_rank_plan(tmp_path / "plan.json", 8)
    before = plan.read_bytes()
    step_log = str(plan) if where == "the-plan" else str(tmp_path / "nowhere" / "steps.jsonl")
    rc = main(["train", "--plan", str(plan), *COMMON, "--epochs", "1", "--step-log", step_log,
               "--checkpoint", str(tmp_path / "ck")])
    line = _one_line_error(capsys.readouterr().err)
    assert rc == 2 and line.startswith("error: --step-log "), line
    assert ("does not exist" if where == "missing-folder" else "--plan") in line, line
    assert plan.read_bytes() == before
    assert not (tmp_path / "ck" / "checkpoint.pt").exists()  # nothing trained


def _locked(path: Path) -> bool:
    """True when another process holds the lock a run takes on ``path`` (a folder or a file)."""
    from planner.paths import held_elsewhere

    return path.exists() and held_elsewhere(str(path))


@pytest.fixture(scope="module")
def run_a(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Run A, one `python -m planner train` for the module: it trains for long enough to be caught holding both of
    its outputs (--checkpoint and --log-file); its session is killed after the module's tests."""
    tmp_path = tmp_path_factory.mktemp("run_a")
    plan = one_rank_plan(tmp_path / "plan.json", 8)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1")
    outputs = {"--checkpoint": str(tmp_path / "ck"), "--log-file": str(tmp_path / "run.jsonl")}
    first = subprocess.Popen([sys.executable, "-m", "planner", "train", "--plan", str(plan), *COMMON, "--epochs",
                              "100000", "--quiet", "--checkpoint", outputs["--checkpoint"], "--log-file",
                              outputs["--log-file"]], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not all(_locked(Path(p)) for p in outputs.values()):
            assert first.poll() is None, first.stderr.read() if first.stderr else ""
            assert time.monotonic() < deadline, "run A never took its locks"
            time.sleep(0.2)
        yield {"plan": plan, "outputs": outputs}
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)


@pytest.mark.parametrize("shared", ["--checkpoint", "--log-file"])
@pytest.mark.subprocess
def test_a_second_run_on_the_same_outputs_is_refused(shared: str, run_a: dict[str, Any], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # Run B (here, in this process) shares one of run A's outputs while run A holds it.
    assert _locked(Path(run_a["outputs"][shared]))
    other = {"--checkpoint": str(tmp_path / "ck2"), "--log-file": str(tmp_path / "run2.jsonl")}
    other[shared] = run_a["outputs"][shared]
    capsys.readouterr()
    rc = main(["train", "--plan", str(run_a["plan"]), *COMMON, "--epochs", "1",
               "--resume" if shared == "--checkpoint" else "--quiet",
               "--checkpoint", other["--checkpoint"], "--log-file", other["--log-file"]])
    line = _one_line_error(capsys.readouterr().err)
    assert rc == 2, line
    assert line.startswith(f"error: {shared} ") and " is in use by another run" in line, line  # long paths shortened
    assert not (tmp_path / "ck2" / "checkpoint.pt").exists()
