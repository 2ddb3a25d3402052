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


def _run_log(tmp_path: Path, *records: dict[str, Any]) -> Path:
    plan = _plan_dict()
    start = {"event": "start", "version": 1, "time": 0.0, "world_size": 2, "global_batch": 8, "plan": plan}
    epoch = {"event": "epoch", "epoch": 0, "plan_fingerprint": plan["fingerprint"], "samples_per_s": 10.0,
             "step_time_s": 0.8, "loss": 1.0, "batch_sizes": [5, 3], "ranks": [], "predicted_step_time_s": [0.7, 0.8]}
    path = tmp_path / "run.jsonl"
    lines = [start, *[epoch | r if r.get("event", "epoch") == "epoch" else r for r in records]]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.mark.parametrize(("record", "needle"), [
    ({"step_time_s": -3.0}, "'step_time_s' must be >= 0, got -3"),
    ({"samples_per_s": -1.0}, "'samples_per_s' must be >= 0"),
    ({"epoch": -1}, "'epoch' must be in 0..2,147,483,647, got -1"),
    ({"predicted_step_time_s": [0.7, -0.8]}, "'predicted_step_time_s' must be a list of at most 65,536 times"),
    ({"batch_sizes": [5, -3]}, "'batch_sizes' must be a list of at most 65,536 integers"),
    ({"event": "start", "world_size": 10**9, "global_batch": 8}, "'world_size' must be in 1..65,536, got 1,000,000,000"),
    ({"event": "resize", "time": 1.0, "epoch": 0, "step": 0, "old_world_size": 2, "new_world_size": 0},
     "'new_world_size' must be in 1..65,536, got 0"),
])
def test_validate_refuses_the_run_logs_report_cannot_read_with_the_same_line(
        record: dict[str, Any], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = _run_log(tmp_path, record)
    profile = tmp_path / "p.json"
    linear_profile([1.0, 2.0]).save(profile)
    lines = []
    for argv in (["validate", str(log)],
                 ["report", "--profile", str(profile), "--log", str(log), "--global-batch", "8",
                  "--out", str(tmp_path / "r.html")]):
        lines.append(_one_line(*_run(argv, capsys)))
        assert needle in lines[-1], (argv[0], lines[-1])
    assert lines[0] == lines[1]  # one loader: the same verdict, word for word
    assert not (tmp_path / "r.html").exists()


def test_validate_says_how_a_logged_run_ended(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from planner.cli.cmd_validate import validate_file

    end = {"event": "end", "time": 5.0, "epochs": 1}
    assert validate_file(str(_run_log(tmp_path, {}, end))).endswith(", finished")
    said = validate_file(str(_run_log(tmp_path, {}, end | {"reason": "interrupted"})))
    assert "interrupted (Ctrl-C or SIGTERM), not finished" in said and "finished;" not in said.split("not ")[0], said
    said = validate_file(str(_run_log(tmp_path, {}, end | {"reason": "loss diverged at epoch 0 step 3"})))
    assert "stopped early: \"loss diverged at epoch 0 step 3\"" in said, said
    assert validate_file(str(_run_log(tmp_path, {}))).endswith("no end record (still running or killed)")


def test_error_lines_cut_a_long_value_and_say_its_length(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _plan_dict()
    data["ranks"][0]["bottleneck"] = "b" * 3000  # under the 4,096 any string may have: the field's own check echoes it
    (tmp_path / "plan.json").write_text(json.dumps(data))
    err = _one_line(*_run(["validate", str(tmp_path / "plan.json")], capsys))
    assert "bottleneck: \"bbbb" in err and "(3,000 characters) is not one of compute" in err and len(err) < 250, err
    prof = linear_profile([1.0, 2.0]).to_dict()
    prof["hosts"][0]["k" * 3000] = 1  # an unknown field's name
    (tmp_path / "p.json").write_text(json.dumps(prof))
    err = _one_line(*_run(["validate", str(tmp_path / "p.json")], capsys))
    assert "unknown field \"kkkk" in err and "(3,000 characters)" in err and len(err) < 300, err


def test_a_bounded_read_refuses_large_and_special_files_before_reading(tmp_path: Path) -> None:
    from planner.errors import ValidationError
    from planner.jsonio import MAX_FILE_BYTES, read_text_bounded

    path = tmp_path / "p.json"
    path.write_text("x" * 101)
    with pytest.raises(ValidationError, match=r"p.json is 101 bytes, more than the 100 read"):
        read_text_bounded(path, "profile", limit=100)
    assert read_text_bounded(path, "profile", limit=101) == "x" * 101
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # reading one would wait for a writer forever
    with pytest.raises(ValidationError, match="is not a regular file"):
        read_text_bounded(fifo, "profile")
    assert MAX_FILE_BYTES == 64 * 2**20


@pytest.mark.subprocess
def test_real_process_refuses_a_lone_surrogate_in_one_line(tmp_path: Path) -> None:
    """The console entry point: a name holding half a UTF-16 pair was a 98-line matplotlib error in `report`."""
    import subprocess
    import sys

    data = linear_profile([1.0, 2.0]).to_dict()
    data["ranks"][0]["device_name"] = "H200\ud800"
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))  # ensure_ascii writes the "\ud800" escape, which decodes to a lone surrogate
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK")}
    for argv in (["validate", str(path)],
                 ["report", "--profile", str(path), "--global-batch", "8", "--out", str(tmp_path / "r.html")]):
        proc = subprocess.run([sys.executable, "-m", "planner", *argv], capture_output=True, text=True, timeout=120,
                              env=env | {"OMP_NUM_THREADS": "1"})
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "half of a UTF-16 pair" in proc.stderr, proc.stderr
    assert not (tmp_path / "r.html").exists()


def test_train_auto_reads_a_fifo_in_place_of_its_plan_without_waiting(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from planner.cli.cmd_train import auto_plan_out
    from planner.errors import ValidationError

    monkeypatch.chdir(tmp_path)
    os.mkfifo("plan.json")  # opened for reading the plain way, it waits for a writer that never comes
    outcome: list[BaseException | str] = []

    def call() -> None:
        try:
            outcome.append(auto_plan_out(None))
        except BaseException as e:  # the thread reports what it raised; the assertion below reads it
            outcome.append(e)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():  # unblock it (a writer opens the FIFO), then fail
        with open("plan.json", "w"):
            pass
        thread.join(10)
        pytest.fail("auto_plan_out waited on a FIFO")
    assert len(outcome) == 1 and isinstance(outcome[0], ValidationError), outcome
    assert "which `planner train --auto` did not write" in str(outcome[0])


def test_a_run_log_whose_plan_does_not_load_is_refused_by_validate_and_report_alike(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan_dict()
    plan["meta"] = {"ddp": {"static_graph": "yes"}}  # what train would refuse
    log = _run_log(tmp_path, {"event": "start", "version": 1, "time": 0.0, "world_size": 2, "global_batch": 8,
                              "plan": plan}, {})
    profile = tmp_path / "p.json"
    linear_profile([1.0, 2.0]).save(profile)
    lines = [_one_line(*_run(argv, capsys)) for argv in (
        ["validate", str(log)],
        ["report", "--profile", str(profile), "--log", str(log), "--out", str(tmp_path / "r.html")])]
    assert lines[0] == lines[1] and 'plan.meta.ddp.static_graph must be true or false, got "yes"' in lines[0], lines


@pytest.mark.subprocess
def test_validate_refuses_a_fifo_without_waiting_on_it(tmp_path: Path) -> None:
    import subprocess
    import sys

    fifo = tmp_path / "run.jsonl"
    os.mkfifo(fifo)  # validate peeks at a file's first line to tell a run log: a FIFO used to block it there
    proc = subprocess.run([sys.executable, "-m", "planner", "validate", str(fifo)], capture_output=True, text=True,
                          timeout=60)  # subprocess.run kills the child if it waits past the deadline
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "is not a regular file" in proc.stderr, proc
