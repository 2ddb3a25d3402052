"""Each warning once per command, and an ideal that no run of its split beats.

`planner plan` runs in-process (its stdout and stderr captured); `planner train --auto` prints the same summary
(``format_plan``) after the same warnings, and `planner bench` filters its ranks' stderr through ``OnceLines``,
both checked here without a launch.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from planner import Profile, evaluate, solve
from planner.cli import main
from planner.cli.bench import OnceLines, bounded_ideal
from planner.cli.cmd_plan import format_plan
from planner.quality import check_profile, solve_within_noise

ROOT = Path(__file__).resolve().parents[2]
NOISY = ROOT / "tests" / "data" / "noisy_cpu_profile.json"  # 2 CPU ranks measured on a busy box: 5 warnings
MEMORY = ROOT / "tests" / "data" / "h200x2_resnet50_slowdown_3x_profile.json"  # 2x H200, memory measured


def test_plan_says_each_quality_finding_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--profile", str(NOISY), "--global-batch", "64"]) == 0
    out, err = capsys.readouterr()
    issues = check_profile(Profile.load(NOISY)).issues
    assert len(issues) >= 3 and "kept the equal split" in out  # the summary explains the kept split...
    for issue in issues:
        assert (out + err).count(issue.what) == 1, issue.what  # ...and points to the warning instead of repeating it
    assert "see its warning above" in out
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == len(set(lines))


def test_the_auto_summary_cites_the_warnings_it_follows() -> None:
    """`planner train --auto` prints quality.warning_lines() (planner.cli.autoplan) and then format_plan."""
    profile = Profile.load(NOISY)
    quality = check_profile(profile)
    plan = solve_within_noise(profile, global_batch=64, quality=quality)
    text = "\n".join(quality.warning_lines()) + "\n" + format_plan(plan, profile, quality)
    for issue in quality.issues:
        assert text.count(issue.what) == 1, issue.what


def test_bench_stderr_says_each_warning_and_note_once() -> None:
    sink = io.StringIO()
    stream = OnceLines(sink)
    for _ in range(3):  # three strategy runs, each printing the trainer's set-up warning and a rank's note
        print("warning: an epoch of 4 steps is shorter than one cycle of rank 1's 3 workers", file=stream)
        print("rank 1: loader: 3 workers x 1 prefetched batch", file=stream, flush=True)
        print("[bench   3s] strategy plan (3/4)", file=stream)
    stream.write("[bench   4s] live line without its newline")
    print("note: something new", file=stream)
    assert sink.getvalue().splitlines() == [
        "warning: an epoch of 4 steps is shorter than one cycle of rank 1's 3 workers",
        "rank 1: loader: 3 workers x 1 prefetched batch",
        "[bench   3s] strategy plan (3/4)", "[bench   3s] strategy plan (3/4)", "[bench   3s] strategy plan (3/4)",
        "[bench   4s] live line without its newlinenote: something new"]


def test_a_run_faster_than_the_standalone_steps_bounds_them() -> None:
    # Alone, rank 1 read 300 ms; inside a run of the same split every step took 100 ms (400 samples/s at B = 40).
    ideal, alone, bounded = bounded_ideal([30, 10], [0.1, 0.3], [400.0])
    assert alone == [0.1, 0.1] and bounded == [1]
    assert ideal == pytest.approx(400.0) and ideal >= 400.0 * (1 - 1e-12)  # never below the run
    ideal, alone, bounded = bounded_ideal([30, 10], [0.1, 0.05], [250.0])  # the run was slower: nothing bounded
    assert alone == [0.1, 0.05] and bounded == [] and ideal == pytest.approx(500.0)
    assert bounded_ideal([30, 10], [0.1, 0.3], [])[2] == []  # no run of that split: the measurement stands


@pytest.mark.parametrize("path", [NOISY, MEMORY])
def test_a_predicted_ideal_is_never_below_its_plan(path: Path) -> None:
    profile = Profile.load(path)
    B = 4096 if path == MEMORY else 64  # above the H200s' memory caps: accumulation
    plans = [solve(profile, global_batch=B, min_gain=0.0), evaluate(profile, [B // 2, B // 2])]
    for plan in plans:
        p = plan.predicted
        assert p.ideal_samples_per_s >= p.samples_per_s, (plan.batch_sizes, p)
