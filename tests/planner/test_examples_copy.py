"""`python -m planner.examples` puts the tour's example files where a pip-installed user can name them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import planner
from planner.examples import NAMES, path
from planner.examples.__main__ import main


def test_copies_the_examples_here_and_the_copy_plans(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main([]) == 0
    assert capsys.readouterr().out.splitlines() == [f"wrote {os.path.join('.', n)}" for n in NAMES]
    copy = tmp_path / "minimal_profile.json"
    assert copy.read_text() == path("minimal_profile.json").read_text()
    plan = planner.solve(planner.Profile.load(copy), global_batch=512)
    assert plan.batch_sizes == (400, 112)  # the README tour's table
    assert main([]) == 0  # again: the same file is left as it is
    assert "is already there" in capsys.readouterr().out


def test_a_different_file_of_that_name_is_refused_not_overwritten(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "minimal_profile.json").write_text("mine\n")
    assert main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exists with other content" in err[0]
    assert (tmp_path / "minimal_profile.json").read_text() == "mine\n"
    assert main(["--out", str(tmp_path / "missing")]) == 2
    assert "not an existing folder" in capsys.readouterr().err
