"""The run log reader, findings on loaders, and `planner report` end to end (HTML, --json, exit codes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner import Plan, Profile, solve
from planner.cli import main
from planner.errors import ValidationError
from planner.profile import HostProfile
from planner.runlog import read_run_log
from planner.solve import SolveOptions
from reports.analysis import analyze
from tests.reports._fixtures import linear_rank, three_rank_profile, write_run_log

EXAMPLE = Path(__file__).resolve().parents[2] / "planner" / "examples" / "minimal_profile.json"


def test_run_log_tolerates_extra_keys_unknown_events_and_a_truncated_tail(tmp_path: Path) -> None:
    plan = solve(three_rank_profile(), global_batch=700)
    log = read_run_log(write_run_log(tmp_path / "run.jsonl", plan))
    assert (log.world_size, log.global_batch, log.num_skipped_lines) == (3, 700, 1)
    assert log.start_plan is not None and log.start_plan.fingerprint == plan.fingerprint
    assert [e.epoch for e in log.epochs] == [0, 1]
    assert log.epochs[0].batch_sizes == (400, 200, 100)
    assert log.epochs[0].measured_busy_s == pytest.approx([0.4, 0.4, 0.5])  # rank 2 ran 25% slow in epoch 0
    assert [(r.epoch, r.adopted, r.predicted_gain) for r in log.replans] == [(0, False, 0.008), (1, True, 0.12)]


def test_run_log_rejects_a_broken_middle_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"event": "start", "world_size": 2}\nnot json\n{"event": "end"}\n')
    with pytest.raises(ValidationError, match=r"bad.jsonl:2: not a JSON line"):
        read_run_log(p)


def test_loader_starved_rank_and_the_workers_it_needs() -> None:
    # Rank 1: 1 ms/sample compute but 10 ms/sample loading on a 2-core host (1 worker after the reserve).
    prof = Profile(
        hosts=(HostProfile(name="a", cpu_cores=16), HostProfile(name="b", cpu_cores=2)),
        ranks=(linear_rank(0, 0.001, host="a"), linear_rank(1, 0.001, host="b", loader_s=0.01)),
    )
    plan = solve(prof, global_batch=110)
    # Rank 1 is fed at 100 samples/s by one worker: b1 = 10 takes 0.1 s, as does b0 = 100 of compute.
    assert plan.batch_sizes == (100, 10)
    assert plan.ranks[1].bottleneck == "loader"
    rep = analyze(prof, plan, SolveOptions())
    (need,) = rep.findings.loader_starved
    assert (need.rank, need.num_workers, need.workers_needed, need.host_worker_budget) == (1, 1, 10, 1)
    assert any("Loader-starved on b" in line and "rank 1 needs 10 (has 1)" in line for line in rep.findings.lines)


def test_cli_writes_html_json_and_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, js = tmp_path / "r" / "report.html", tmp_path / "r" / "report.json"
    out.parent.mkdir()  # outputs go into existing folders (planner/paths.py)
    rc = main(["report", "--profile", str(EXAMPLE), "--global-batch", "512", "--out", str(out), "--json", str(js)])
    assert rc == 0
    page = out.read_text()
    # Self-contained: figures inline, nothing fetched.
    assert page.count('<img src="data:image/png;base64,') == 6  # no log: every figure but predicted-vs-measured
    for needle in ("http://", "https://", "<script", "<link", "src=\"/", "url("):
        assert needle not in page
    data = json.loads(js.read_text())
    ref = solve(Profile.load(EXAMPLE), global_batch=512)
    assert data["throughput"]["plan_samples_per_s"] == ref.predicted.samples_per_s
    assert data["throughput"]["equal_split_samples_per_s"] == ref.predicted.equal_split_samples_per_s
    assert [r["batch_size"] for r in data["ranks"]] == list(ref.batch_sizes)
    printed = capsys.readouterr().out
    assert "Findings:" in printed and "what-if" in printed and f"wrote {out}" in printed


def test_cli_with_plan_and_log(tmp_path: Path) -> None:
    prof_path = tmp_path / "p.json"
    three_rank_profile().save(prof_path)
    plan = solve(three_rank_profile(), global_batch=700)
    plan.save(tmp_path / "plan.json")
    log = write_run_log(tmp_path / "run.jsonl", plan)
    out, js = tmp_path / "report.html", tmp_path / "report.json"
    rc = main(["report", "--profile", str(prof_path), "--plan", str(tmp_path / "plan.json"), "--log", str(log),
               "--out", str(out), "--json", str(js), "--quiet"])
    assert rc == 0
    page = out.read_text()
    # No rank has a memory cap, so no memory figure; the log adds predicted vs measured.
    assert page.count("<img ") == 6 and 'id="fig-log"' in page and 'id="fig-memory"' not in page
    assert "Predicted vs measured" in page and "rank 2 slowed down" in page
    data = json.loads(js.read_text())
    assert data["log"]["epochs"][0]["measured_busy_s"] == pytest.approx([0.4, 0.4, 0.5])
    # A log alone is enough: the report takes the plan the run started with.
    assert main(["report", "--profile", str(prof_path), "--log", str(log), "--out", str(out), "--quiet"]) == 0


def test_cli_user_errors_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--profile", str(EXAMPLE), "--out", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert "needs --plan PATH or --global-batch B" in err and err.count("\n") == 1
    plan = solve(Profile.load(EXAMPLE), global_batch=512)
    plan.save(tmp_path / "plan.json")
    assert main(["report", "--profile", str(EXAMPLE), "--plan", str(tmp_path / "plan.json"), "--global-batch", "256",
                 "--out", str(tmp_path / "r.html")]) == 2
    assert "differs from the plan's global batch 512" in capsys.readouterr().err
    other = tmp_path / "three.json"
    three_rank_profile().save(other)
    assert main(["report", "--profile", str(other), "--plan", str(tmp_path / "plan.json"),
                 "--out", str(tmp_path / "r.html")]) == 2
    assert "the plan has 2 ranks but the profile has 3" in capsys.readouterr().err
    assert not (tmp_path / "r.html").exists()


@pytest.mark.subprocess
def test_report_module_does_not_import_matplotlib_or_torch_at_import_time() -> None:
    import subprocess
    import sys

    code = ("import sys, reports, planner.cli.cmd_report; "
            "bad = [m for m in ('matplotlib', 'torch') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert res.returncode == 0, res.stdout + res.stderr


def test_plan_round_trip_through_the_report_is_unchanged(tmp_path: Path) -> None:
    plan = solve(three_rank_profile(), global_batch=700)
    rep = analyze(three_rank_profile(), Plan.from_dict(plan.to_dict()), SolveOptions())
    assert rep.plan_fingerprint == plan.fingerprint


def test_a_kept_equal_split_is_a_finding() -> None:
    from tests.planner._profiles import linear_profile

    prof = linear_profile([0.000002, 0.0000015], fixed_s=0.0074, cores=8)
    plan = solve(prof, global_batch=1024)
    assert plan.batch_sizes == (512, 512)
    optimum = solve(prof, global_batch=1024, min_gain=0.0).batch_sizes
    lines = analyze(prof, plan, SolveOptions()).findings.lines
    assert any(f"The equal split was kept: the optimum {list(optimum)}" in line and "min gain of 5%" in line
               for line in lines), lines
    # a plan that moved off the equal split says nothing of the kind
    assert not any("was kept" in line for line in analyze(Profile.load(EXAMPLE), solve(Profile.load(EXAMPLE),
                                                                              global_batch=512), SolveOptions()).findings.lines)


def test_loader_starved_remedy_names_the_cap_only_where_it_binds() -> None:
    """A 2x H100 compute-skew profile (32 cores): capped at 16 workers rank 0 is starved and the finding says to
    raise --max-workers-per-rank; uncapped (the default) rank 0 is not starved, and a rank the host's cores starve
    is not told to raise a cap it does not have."""
    results = Path(__file__).resolve().parents[2] / "tests" / "data"
    prof = Profile.from_dict(json.loads((results / "h100x2_resnet50_compute_skew_16_worker_cap_repeat_profile.json").read_text()))
    capped_opts = SolveOptions(max_workers_per_rank=16, min_batch=2)
    capped = analyze(prof, solve(prof, global_batch=512, options=capped_opts), capped_opts)
    line = next(x for x in capped.findings.lines if x.startswith("Loader-starved"))
    assert "rank 0 needs" in line and "(has 16)" in line and "raise --max-workers-per-rank" in line
    free = analyze(prof, solve(prof, global_batch=512, min_batch=2), SolveOptions(min_batch=2))
    assert not any(n.rank == 0 for n in free.findings.loader_starved)
    small = Profile(hosts=(HostProfile(name="b", cpu_cores=2),),
                    ranks=(linear_rank(0, 0.001, host="b", loader_s=0.01),))
    line = next(x for x in analyze(small, solve(small, global_batch=110), SolveOptions()).findings.lines
                if x.startswith("Loader-starved"))
    assert "--max-workers-per-rank" not in line
