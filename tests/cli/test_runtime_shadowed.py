"""A user's own package named ``runtime`` first on sys.path: one line naming its path and the fix, never an import
error from deep inside the tool (planner.shadow)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import planner
import runtime
from planner.shadow import MARKER, require_runtime

REPO = Path(planner.__file__).resolve().parent.parent


def _user_project(tmp_path: Path) -> Path:
    """A project folder with its own runtime/ package, as a user's would have."""
    pkg = tmp_path / "runtime"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("USERS_OWN = True\n")
    return tmp_path


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_our_runtime_carries_the_marker_and_is_accepted() -> None:
    assert getattr(runtime, MARKER) == "runtime"
    assert require_runtime() is runtime


@pytest.mark.subprocess
def test_cli_run_from_a_folder_with_its_own_runtime_package_names_it_in_one_line(tmp_path: Path) -> None:
    project = _user_project(tmp_path)
    # python -m (and torchrun -m) put the current folder first on sys.path: the user's runtime/ comes first.
    proc = _run(project, "-m", "planner", "train", "--plan", "plan.json", "--device", "cpu")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert str(project / "runtime") in lines[0] and "is not ddp-planner's" in lines[0]
    assert "rename your runtime/ package" in lines[0]


@pytest.mark.subprocess
def test_profiling_api_import_with_a_shadowing_runtime_names_it(tmp_path: Path) -> None:
    project = _user_project(tmp_path)
    proc = _run(project, "-c", "import profiler.api")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("planner.errors.ValidationError: the 'runtime' package imported from "), proc.stderr
    assert str(project / "runtime") in last
