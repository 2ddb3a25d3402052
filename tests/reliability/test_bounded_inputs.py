"""Files are read strictly and cross-checked: a number no file of ours holds, a key given twice, a field that
contradicts another, or a run log that contradicts its plan is one line and exit 2 in validate, plan and report --
never a traceback, never accepted and printed."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from planner import solve
from planner.cli import main
from tests.planner._profiles import linear_profile


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = main(argv)
    err = capsys.readouterr().err
    return rc, err


def _one_line(rc: int, err: str) -> str:
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, (rc, err)
    return err


def _profile_text(tmp_path: Path) -> str:
    return json.dumps(linear_profile([1.0, 2.0]).to_dict())


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda t: t.replace('"cpu_cores": 64', '"cpu_cores": ' + "9" * 400), "an integer of 400 digits"),
    (lambda t: t.replace('"cpu_cores": 64', '"cpu_cores": ' + "9" * 5000), "an integer of 5000 digits"),
    (lambda t: t.replace('"cpu_cores": 64', '"cpu_cores": 1e400'), "must be a finite number, got inf"),
    (lambda t: t.replace('"cpu_cores": 64', '"cpu_cores": NaN'), "must be a finite number, got nan"),
    (lambda t: t.replace('"cpu_cores": 64', '"cpu_cores": 64, "cpu_cores": 2'), "appears twice in one object"),
])
@pytest.mark.slow
def test_profile_numbers_and_keys_are_read_strictly(edit: Any, needle: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    text = _profile_text(tmp_path)
    assert '"cpu_cores": 64' in text
    path = tmp_path / "p.json"
    path.write_text(edit(text))
    for argv in (["validate", str(path)], ["plan", "--profile", str(path), "--global-batch", "8"],
                 ["report", "--profile", str(path), "--global-batch", "8", "--out", str(tmp_path / "r.html")]):
        err = _one_line(*_run(argv, capsys))
        assert needle in err, (argv[0], err)
        if "digits" not in needle and "twice" not in needle:
            assert "hosts[0].cpu_cores" in err, err  # the field is named


def _plan_dict(**edits: Any) -> dict[str, Any]:
    data = solve(linear_profile([1.0, 2.0]), global_batch=8).to_dict()
    data.update(edits)
    return data


def test_a_share_that_contradicts_the_batch_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _plan_dict()
    data["ranks"][0]["share"] = 1e300
    (tmp_path / "plan.json").write_text(json.dumps(data))
    err = _one_line(*_run(["validate", str(tmp_path / "plan.json")], capsys))
    assert "plan.ranks[0].share is 1e+300 but its batch" in err, err


def test_solver_options_the_report_refuses_are_refused_by_validate(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    data = _plan_dict()
    data["solver"] = dict(data.get("solver") or {}, options={"time_limit_s": -1})
    (tmp_path / "plan.json").write_text(json.dumps(data))
    err = _one_line(*_run(["validate", str(tmp_path / "plan.json")], capsys))
    assert "plan.solver.options" in err, err


def test_a_run_log_whose_world_size_contradicts_its_plan_is_refused(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan_dict()
    start = {"event": "start", "version": 1, "time": 0.0, "world_size": 3, "global_batch": 8, "plan": plan}
    (tmp_path / "run.jsonl").write_text(json.dumps(start) + "\n")
    err = _one_line(*_run(["validate", str(tmp_path / "run.jsonl")], capsys))
    assert "world_size 3 but the run's plan has 2" in err, err


def test_overwriting_an_output_keeps_its_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "p.json"
    linear_profile([1.0, 2.0]).save(profile)
    out = tmp_path / "plan.json"
    out.write_text("{}")
    os.chmod(out, 0o600)
    assert main(["plan", "--profile", str(profile), "--global-batch", "8", "--out", str(out)]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    fresh = tmp_path / "fresh.json"
    assert main(["plan", "--profile", str(profile), "--global-batch", "8", "--out", str(fresh)]) == 0
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o644 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_loader_workers_are_bounded_in_the_plan_and_by_the_host(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from planner.cli.preflight import check_workers_fit
    from planner.errors import ValidationError

    data = _plan_dict()
    data["ranks"][0]["num_workers"] = 2147483647
    (tmp_path / "plan.json").write_text(json.dumps(data))
    err = _one_line(*_run(["validate", str(tmp_path / "plan.json")], capsys))
    assert "num_workers 2147483647 is outside 0..1024" in err, err
    plan = solve(linear_profile([1.0, 2.0]), global_batch=8)
    import dataclasses

    many = dataclasses.replace(plan, ranks=(dataclasses.replace(plan.ranks[0], num_workers=40), *plan.ranks[1:]))
    with pytest.raises(ValidationError, match="gives rank 0 40 loader workers but this host has 2 CPU cores"):
        check_workers_fit(many, 0, cores=2)
    check_workers_fit(many, 1, cores=2)  # rank 1's own workers fit


def test_names_from_files_reach_the_terminal_as_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = linear_profile([1.0, 2.0]).to_dict()
    data["ranks"][0]["device"] = "cuda:0\x1b]0;owned\x07\x1b[2J"
    data["hosts"][0]["name"] = data["ranks"][0]["host"] = data["ranks"][1]["host"] = "h\x1b[31m\u202e"
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    for argv in (["plan", "--profile", str(path), "--global-batch", "8"],
                 ["report", "--profile", str(path), "--global-batch", "8", "--out", str(tmp_path / "r.html")]):
        assert main(argv) == 0
        out = capsys.readouterr()
        for stream in (out.out, out.err):
            assert "\x1b" not in stream and "\x07" not in stream and "\u202e" not in stream, argv
        assert "cuda:0\\x1b]0;owned\\x07" in out.out, out.out
