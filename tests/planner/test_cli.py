from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from planner.cli import main
from tests.planner._profiles import MINIMAL

BASE: dict[str, Any] = json.loads(MINIMAL.read_text())


def _mutate(path: str, value: Any) -> dict[str, Any]:
    """A copy of the minimal profile with one field replaced (value DELETE removes it)."""
    d = copy.deepcopy(BASE)
    keys: list[Any] = [int(k) if k.isdigit() else k for k in path.split(".")]
    node = d
    for k in keys[:-1]:
        node = node[k]
    if value == "DELETE":
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return d


BAD_PROFILES = {
    "missing ranks": (_mutate("ranks", "DELETE"), "missing required field 'ranks'"),
    "missing compute": (_mutate("ranks.0.compute", "DELETE"), "ranks[0]: missing required field 'compute'"),
    "time is a string": (_mutate("ranks.0.compute.0.step_time_s", "fast"), "step_time_s: expected a number"),
    "negative time": (_mutate("ranks.1.compute.2.step_time_s", -0.1), "step_time_s: must be > 0"),
    "NaN time": (_mutate("ranks.1.compute.2.step_time_s", float("nan")), "must be a finite number"),
    "empty ranks": (_mutate("ranks", []), "ranks: must not be empty"),
    "wrong version": (_mutate("version", 7), "unsupported version 7"),
    "wrong kind": (_mutate("kind", "banana"), "banana"),
    "duplicate rank": (_mutate("ranks.1.rank", 0), "rank ids must be 0..1 each exactly once"),
    "unknown host": (_mutate("ranks.1.host", "node9"), "'node9' is not in profile.hosts"),
    "typo field": (_mutate("ranks.0.compute.0", {"batch_size": 32, "step_time": 0.01}), "missing required field 'step_time_s'"),
    "bool batch": (_mutate("ranks.0.compute.0.batch_size", True), "batch_size: expected an integer"),
    "zero cores": (_mutate("hosts.0.cpu_cores", 0), "cpu_cores: must be >= 1"),
}


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("name", sorted(BAD_PROFILES))
@pytest.mark.parametrize("command", ["plan", "validate"])
def test_bad_profile_exits_2_with_one_line(name: str, command: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    data, expected = BAD_PROFILES[name]
    f = tmp_path / "p.json"
    # allow_nan so the NaN case is written the way a careless tool would write it
    f.write_text(json.dumps(data, allow_nan=True))
    out_plan = tmp_path / "plan.json"
    argv = ["plan", "--profile", str(f), "--global-batch", "512", "--out", str(out_plan)] if command == "plan" else ["validate", str(f)]
    rc, _, err = _run(argv, capsys)
    assert rc == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert expected in err
    assert not out_plan.exists()


@pytest.mark.parametrize("text", ["", "{", "[1, 2]", "null", "not json"])
def test_not_json_or_not_object(text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "p.json"
    f.write_text(text)
    rc, _, err = _run(["plan", "--profile", str(f), "--global-batch", "8"], capsys)
    assert rc == 2 and err.count("\n") == 1


def test_plan_writes_file_and_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    rc, stdout, _ = _run(["plan", "--profile", str(MINIMAL), "--global-batch", "512", "--out", str(out)], capsys)
    assert rc == 0
    assert "bottleneck" in stdout and "x equal split" in stdout
    rc, stdout, _ = _run(["validate", str(out), str(MINIMAL)], capsys)
    assert rc == 0 and "valid plan" in stdout and "valid profile" in stdout
    plan = json.loads(out.read_text())
    for key in ("version", "kind", "world_size", "global_batch", "fingerprint", "ranks", "predicted"):
        assert key in plan
    for key in ("rank", "batch_size", "share", "num_workers", "predicted_step_time_s", "bottleneck"):
        assert key in plan["ranks"][0]
    for key in ("step_time_s", "samples_per_s", "equal_split_samples_per_s", "ideal_samples_per_s"):
        assert key in plan["predicted"]


def test_edited_plan_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert _run(["plan", "--profile", str(MINIMAL), "--global-batch", "512", "--out", str(out)], capsys)[0] == 0
    d = json.loads(out.read_text())
    d["ranks"][0]["batch_size"] += 1
    d["ranks"][1]["batch_size"] -= 1
    out.write_text(json.dumps(d))
    rc, _, err = _run(["validate", str(out)], capsys)
    assert rc == 2 and "edited by hand" in err
    d["ranks"][1]["batch_size"] += 5
    out.write_text(json.dumps(d))
    rc, _, err = _run(["validate", str(out)], capsys)
    assert rc == 2 and "sum to" in err


def test_infeasible_and_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(["plan", "--profile", str(MINIMAL), "--global-batch", "1", "--min-batch", "2"], capsys)
    assert rc == 2 and "below world size 2 x min batch 2" in err
    rc, _, err = _run(["plan", "--profile", str(MINIMAL)], capsys)
    assert rc == 2 and "--global-batch" in err
    rc, _, err = _run(["plan", "--profile", str(MINIMAL), "--global-batch", "x"], capsys)
    assert rc == 2
    rc, _, err = _run(["nope"], capsys)
    assert rc == 2 and "unknown command" in err
    rc, _, err = _run(["plan", "--profile", str(MINIMAL), "--global-batch", "512", "--from-batches", "1,2"], capsys)
    assert rc == 2 and "sums to 3" in err


def test_from_batches_evaluates_a_given_split(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(["plan", "--profile", str(MINIMAL), "--global-batch", "512", "--from-batches", "256,256", "--json"], capsys)
    assert rc == 0
    d = json.loads(out)
    assert [r["batch_size"] for r in d["ranks"]] == [256, 256]
    assert d["predicted"]["samples_per_s"] == pytest.approx(d["predicted"]["equal_split_samples_per_s"])


@pytest.mark.subprocess
def test_console_entry_point_has_no_traceback(tmp_path: Path) -> None:
    f = tmp_path / "p.json"
    f.write_text("{oops")
    proc = subprocess.run([sys.executable, "-m", "planner", "plan", "--profile", str(f), "--global-batch", "8"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_min_gain_option(capsys: pytest.CaptureFixture[str]) -> None:
    # The minimal profile's plan is 2.00x equal: any min_gain below 1.0 keeps it; a bad value is one line, exit 2.
    rc, out, _ = _run(["plan", "--profile", str(MINIMAL), "--global-batch", "512", "--min-gain", "0.9", "--json"],
                      capsys)
    assert rc == 0 and [r["batch_size"] for r in json.loads(out)["ranks"]] == [400, 112]
    assert json.loads(out)["solver"]["options"]["min_gain"] == 0.9
    rc, _, err = _run(["plan", "--profile", str(MINIMAL), "--global-batch", "512", "--min-gain", "1.5"], capsys)
    assert rc == 2 and "min_gain must be in [0, 1), got 1.5" in err and len(err.strip().splitlines()) == 1


def test_kept_equal_split_is_explained(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import planner
    from planner.profile import Profile
    from tests.planner._profiles import linear_profile

    path = tmp_path / "flat.json"
    linear_profile([0.000002, 0.0000015], fixed_s=0.0074, cores=8).save(path)
    rc, out, _ = _run(["plan", "--profile", str(path), "--global-batch", "1024"], capsys)
    optimum = planner.solve(Profile.load(path), global_batch=1024, min_gain=0.0).batch_sizes
    assert rc == 0 and "kept the equal split: the optimum" in out and str(list(optimum)) in out
    assert "< min gain 5%" in out
    rc, out, _ = _run(["plan", "--profile", str(path), "--global-batch", "1024", "--min-gain", "0"], capsys)
    assert rc == 0 and "kept the equal split" not in out


def test_a_split_kept_for_noise_is_not_called_below_min_gain() -> None:
    # A plan kept equal because the profile was too noisy to trust a 1.68x optimum must not read
    # "only 68.2% faster (< min gain 5%)": without the quality report at hand the summary gives the noise reason.
    from dataclasses import replace

    import planner
    from planner.cli.cmd_plan import format_plan
    from planner.solve import kept_equal_split

    equal = planner.evaluate(planner.Profile.load(MINIMAL), [256, 256], num_workers=[0, 0])
    kept = replace(equal, solver={**equal.solver, "kept_for": "profile noise", "profile_noise": 0.9,
                                  "optimum_batch_sizes": [400, 112],
                                  "optimum_step_time_s": equal.predicted.step_time_s / 1.682})
    assert kept_equal_split(kept) is None
    text = format_plan(kept)
    assert "min gain" not in text
    assert "kept the equal split: the optimum [400, 112] is predicted 1.68x as fast, inside the profile's own noise" \
        in text and "(measurements off by up to 90%)" in text


def test_a_batchnorm_profile_plans_at_least_two_samples_a_rank(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A launch-bound fast rank beside a slow one: the optimum is lopsided. For a model with BatchNorm (the profile's
    meta.has_batchnorm) `planner plan` keeps 2 samples on the slow rank unless --min-batch says otherwise, so the
    plan is one `planner train` runs (it refuses a BatchNorm rank of 1)."""
    from dataclasses import replace

    from tests.planner._profiles import linear_profile

    prof = linear_profile([0.00001, 0.01], fixed_s=0.05)
    for bn in (False, True):
        path = tmp_path / f"bn{bn}.json"
        replace(prof, meta={"has_batchnorm": bn}).save(path)
        rc, _, _ = _run(["plan", "--profile", str(path), "--global-batch", "128", "--min-gain", "0", "--out",
                         str(tmp_path / "plan.json")], capsys)
        assert rc == 0
        assert min(r["batch_size"] for r in json.loads((tmp_path / "plan.json").read_text())["ranks"]) == (2 if bn else 1)
    rc, _, _ = _run(["plan", "--profile", str(tmp_path / "bnTrue.json"), "--global-batch", "128", "--min-gain", "0",
                     "--min-batch", "1", "--out", str(tmp_path / "plan.json")], capsys)
    assert rc == 0 and min(r["batch_size"] for r in json.loads((tmp_path / "plan.json").read_text())["ranks"]) == 1
