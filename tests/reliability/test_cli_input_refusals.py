"""Every input a user can type either works or is refused in one line before any work starts.

Each case runs the real CLI (``planner.cli.main``, what the console script runs) and asserts: exit 2, exactly one
line on stderr, no traceback, the words that say what is wrong, every input byte-for-byte unchanged, nothing new
in the output folder, and -- where the command measures, trains or benchmarks -- that it was refused *before*
that work: the function that would start it is replaced by one that fails the test (``_no_work``), and the wall
time is bounded (generously, 20 s: the box is shared; profiling alone takes longer).

The cases that are not errors (``--force``, a log with missing times, two runs in one log, a 10^6-skewed
cluster, a closed or full stdout) assert their documented behaviour. docs/RELIABILITY.md maps each case to its
test here.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from planner.cli import main

REPO = Path(__file__).resolve().parents[2]
BAD = REPO / "tests" / "data" / "bad"
GOOD_PROFILE = BAD / "args_good_profile.json"  # 1 rank
GOOD_PLAN = BAD / "args_good_plan.json"  # 1 rank, global batch 16
CAPPED = BAD / "args_memory_capped_profile.json"  # 1 rank, memory cap 200
MINIMAL = REPO / "planner" / "examples" / "minimal_profile.json"  # 2 ranks
FIX = "tests.reliability._fixtures"
LONG = "a" * 300
MAX_S = 20.0


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else f"<{p.stat().st_mode:o}>"


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): _digest(p) if not p.is_symlink() else f"-> {os.readlink(p)}"
            for p in sorted(folder.rglob("*"))}


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A folder with copies of the inputs and every awkward node an output could be pointed at."""
    for src in (GOOD_PROFILE, GOOD_PLAN, CAPPED, MINIMAL):
        (tmp_path / src.name).write_bytes(src.read_bytes())
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "target.json").write_text("keep me\n")
    os.symlink(tmp_path / "target.json", tmp_path / "link.json")
    (tmp_path / "old.jsonl").write_text('{"event": "start"}\n{"event": "epoch"}\n{"event": "end"}\n')
    return tmp_path


def _no_work(monkeypatch: pytest.MonkeyPatch, *targets: str) -> None:
    """Replace the functions that start the real work: reaching one fails the test."""
    import importlib

    for target in targets:
        module, _, name = target.rpartition(".")

        def fail(*_a: Any, _t: str = target, **_k: Any) -> None:
            raise AssertionError(f"{_t} ran: the refusal came after the work started")

        monkeypatch.setattr(importlib.import_module(module), name, fail)


def refused(argv: list[str], needle: str, work: Path, capsys: pytest.CaptureFixture[str]) -> str:
    before = _snapshot(work)
    t0 = time.monotonic()
    rc = main([a.replace("{w}", str(work)) for a in argv])
    elapsed = time.monotonic() - t0
    _, err = capsys.readouterr()
    assert rc == 2, f"exit {rc}: {err}"
    assert err.count("\n") == 1 and err.endswith("\n"), f"not one line: {err!r}"
    assert "Traceback" not in err
    assert needle in err, f"{needle!r} not in {err!r}"
    assert _snapshot(work) == before, "an input was modified or an output left behind"
    assert elapsed < MAX_S, f"refused only after {elapsed:.1f} s"
    return err


PROFILE_RUN = ("profiler.run.profile_this_rank", "profiler.run.profile_devices")
BENCH_RUN = ("planner.cli.launch.spawn",)
TRAIN_RUN = ("planner.cli.distenv.init_from_env",)
TRAIN_AFTER_SETUP = ("planner.cli.train.train", "planner.cli.autoplan.auto_plan")
DEMO_RUN = ("planner.cli.demo._run_stage",)
PROFILE = ["profile", "--model", "mlp", "--device", "cpu", "--quick"]
BENCH = ["bench", "--device", "cpu", "--nproc", "2", "--model", "mlp"]
TRAIN = ["train", "--plan", "{w}/args_good_plan.json", "--device", "cpu", "--epochs", "1", "--num-samples", "64"]

# id -> (argv, words of the one error line, functions that must not run)
CASES: dict[str, tuple[list[str], str, tuple[str, ...]]] = {
    # 3, 4, 5: `plan --out`
    "plan-out-is-the-profile": (["plan", "--profile", "{w}/minimal_profile.json", "--global-batch", "64", "--out",
                                 "{w}/minimal_profile.json"], "is the --profile input: writing it would destroy it",
                                ()),
    "plan-out-is-the-profile-via-dot": (["plan", "--profile", "{w}/minimal_profile.json", "--global-batch", "64",
                                         "--out", "{w}/./minimal_profile.json"], "is the --profile input", ()),
    "plan-out-folder": (["plan", "--profile", "{w}/minimal_profile.json", "--global-batch", "64", "--out", "{w}/dir"],
                        "is a folder, not a regular file", ()),
    "plan-out-unwritable-folder": (["plan", "--profile", "{w}/minimal_profile.json", "--global-batch", "64", "--out",
                                    "/sys/plan.json"], "cannot write in folder '/sys'", ()),
    "plan-out-300-characters": (["plan", "--profile", "{w}/minimal_profile.json", "--global-batch", "64", "--out",
                                 "{w}/" + LONG], "the file name is 300 bytes", ()),
    "plan-out-fifo": (["plan", "--profile", "{w}/minimal_profile.json", "--global-batch", "64", "--out", "{w}/fifo"],
                      "is a FIFO (named pipe), not a regular file", ()),
    "plan-out-symlink": (["plan", "--profile", "{w}/minimal_profile.json", "--global-batch", "64", "--out",
                          "{w}/link.json"], "is a symbolic link", ()),
    "plan-out-empty": (["plan", "--profile", "{w}/minimal_profile.json", "--global-batch", "64", "--out", ""],
                       "--out: the path is empty", ()),
    "plan-out-missing-folder": (["plan", "--profile", "{w}/minimal_profile.json", "--global-batch", "64", "--out",
                                 "{w}/nope/plan.json"], "does not exist; create it first", ()),
    # 9: numbers
    "plan-global-batch-2**63": (["plan", "--profile", "{w}/minimal_profile.json", "--global-batch", str(2**63)],
                                "argument --global-batch/--global_batch: must be <= 2147483647", ()),
    # 7: a forced split over a cap
    # (with accumulation allowed, the default, 300 on a cap of 200 runs as 2 x 150)
    "plan-from-batches-over-memory-cap": (["plan", "--profile", "{w}/args_memory_capped_profile.json",
                                           "--global-batch", "300", "--from-batches", "300",
                                           "--max-accumulation-steps", "1", "--out",
                                           "{w}/plan.json"],
                                          "rank 0 gets 300 samples, over its memory cap of 200", ()),
    "plan-from-batches-over-max-batch-per-rank": (["plan", "--profile", "{w}/args_memory_capped_profile.json",
                                                   "--global-batch", "100", "--from-batches", "100",
                                                   "--max-batch-per-rank", "50"],
                                                  "over --max-batch-per-rank 50", ()),
    "plan-force-without-from-batches": (["plan", "--profile", "{w}/minimal_profile.json", "--global-batch", "64",
                                         "--force"], "--force only applies to --from-batches", ()),
    # 3, 5, 9: `report`
    "report-out-is-the-profile": (["report", "--profile", "{w}/minimal_profile.json", "--global-batch", "64",
                                   "--out", "{w}/minimal_profile.json"], "is the --profile input", ()),
    "report-json-is-the-plan": (["report", "--profile", "{w}/args_good_profile.json", "--plan",
                                 "{w}/args_good_plan.json", "--out", "{w}/r.html", "--json",
                                 "{w}/args_good_plan.json"], "--json", ()),
    "report-out-is-the-log": (["report", "--profile", "{w}/args_good_profile.json", "--global-batch", "16", "--log",
                               "{w}/old.jsonl", "--out", "{w}/old.jsonl"], "is the --log input", ()),
    "report-out-folder": (["report", "--profile", "{w}/minimal_profile.json", "--global-batch", "64", "--out",
                           "{w}/dir"], "is a folder, not a regular file", ()),
    "report-out-and-json-the-same": (["report", "--profile", "{w}/minimal_profile.json", "--global-batch", "64",
                                      "--out", "{w}/r.html", "--json", "{w}/r.html"], "--out and --json both name",
                                     ()),
    "report-min-batch-0": (["report", "--profile", "{w}/minimal_profile.json", "--global-batch", "64",
                            "--min-batch", "0", "--out", "{w}/r.html"], "argument --min-batch/--min_batch: must be >= 1",
                           ()),
    # 3, 4, 9: `profile` -- refused before a single step is measured
    "profile-out-folder": ([*PROFILE, "--out", "{w}/dir"], "is a folder, not a regular file", PROFILE_RUN),
    "profile-out-unwritable-folder": ([*PROFILE, "--out", "/sys/p.json"], "cannot write in folder", PROFILE_RUN),
    "profile-out-300-characters": ([*PROFILE, "--out", "{w}/" + LONG], "the file name is 300 bytes", PROFILE_RUN),
    "profile-out-fifo": ([*PROFILE, "--out", "{w}/fifo"], "is a FIFO", PROFILE_RUN),
    "profile-out-symlink": ([*PROFILE, "--out", "{w}/link.json"], "is a symbolic link", PROFILE_RUN),
    "profile-image-size-0": ([*PROFILE, "--image-size", "0", "--out", "{w}/p.json"],
                             "argument --image-size: must be >= 1, got 0", PROFILE_RUN),
    "profile-emulate-slowdown-missing-rank": ([*PROFILE, "--emulate-slowdown", "5=3", "--out", "{w}/p.json"],
                                              "rank 5 does not exist in a job of 1 rank(s)", PROFILE_RUN),
    # 3, 9: `bench` -- refused before a rank is launched
    "bench-json-folder": ([*BENCH, "--json", "{w}/dir"], "is a folder, not a regular file", BENCH_RUN),
    "bench-json-unwritable-folder": ([*BENCH, "--json", "/sys/b.json"], "cannot write in folder", BENCH_RUN),
    "bench-json-300-characters": ([*BENCH, "--json", "{w}/" + LONG], "the file name is 300 bytes", BENCH_RUN),
    "bench-timeout-0": ([*BENCH, "--timeout", "0"], "argument --timeout: must be > 0, got 0", BENCH_RUN),
    "bench-global-batch-0": ([*BENCH, "--global-batch", "0"], "argument --global-batch: must be >= 1", BENCH_RUN),
    "bench-steps-0": ([*BENCH, "--steps", "0"], "argument --steps: must be >= 1, got 0", BENCH_RUN),
    "bench-emulate-slowdown-missing-rank": ([*BENCH, "--emulate-slowdown", "5=3"],
                                            "rank 5 does not exist in a job of 2 rank(s)", BENCH_RUN),
    # 2, 5, 8, 9: `train` -- refused before the process group, a profile or a step
    "train-log-file-is-the-plan": ([*TRAIN, "--log-file", "{w}/args_good_plan.json"], "is the --plan input",
                                   TRAIN_RUN),
    "train-log-file-is-a-folder": ([*TRAIN, "--log-file", "{w}/dir"], "is a folder, not a regular file", TRAIN_RUN),
    "train-checkpoint-is-a-file": ([*TRAIN, "--checkpoint", "{w}/target.json"], "is a regular file, not a folder",
                                   TRAIN_RUN),
    "train-log-file-holds-another-run": ([*TRAIN, "--log-file", "{w}/old.jsonl"],
                                         "already holds 3 line(s) of another run", TRAIN_RUN),
    "train-emulate-slowdown-missing-rank": ([*TRAIN, "--emulate-slowdown", "5=3"],
                                            "rank 5 does not exist in a job of 1 rank(s)", TRAIN_RUN),
    "train-lr-negative": ([*TRAIN, "--lr", "-1"], "argument --lr: must be > 0, got -1", TRAIN_RUN),
    "train-lr-nan": ([*TRAIN, "--lr", "nan"], "argument --lr: must be a finite number", TRAIN_RUN),
    "train-image-size-0": ([*TRAIN, "--image-size", "0"], "argument --image-size: must be >= 1, got 0", TRAIN_RUN),
    "train-max-steps-per-epoch-0": ([*TRAIN, "--max-steps-per-epoch", "0"],
                                    "argument --max-steps-per-epoch: must be >= 1, got 0", TRAIN_RUN),
    "train-global-batch-2**63": (["train", "--auto", "--global-batch", str(2**63), "--device", "cpu"],
                                 "must be <= 2147483647", TRAIN_RUN),
    "train-allow-changes-without-resume": ([*TRAIN, "--allow-resume-changes"], "only applies to --resume",
                                           TRAIN_RUN),
    "train-factory-returns-none": ([*TRAIN, "--model", f"{FIX}:model", "--dataset", f"{FIX}:none_dataset"],
                                   "the factory returned NoneType, not a dataset", TRAIN_AFTER_SETUP),
    "train-factory-returns-int": ([*TRAIN, "--model", f"{FIX}:model", "--dataset", f"{FIX}:int_dataset"],
                                  "the factory returned int, not a dataset", TRAIN_AFTER_SETUP),
    "train-factory-returns-list-of-ints": ([*TRAIN, "--model", f"{FIX}:model", "--dataset",
                                            f"{FIX}:list_of_ints_dataset"],
                                           "samples must be (tensor, label) pairs, got int", TRAIN_AFTER_SETUP),
    "train-auto-batchnorm-global-batch-below-2-per-rank": (["train", "--auto", "--global-batch", "1", "--device",
                                                            "cpu", "--model", "cifar_cnn", "--num-samples", "64"],
                                                           "(a BatchNorm model needs 2 per rank)",
                                                           TRAIN_AFTER_SETUP),
    # `demo`
    "demo-out-is-a-file": (["demo", "--out", "{w}/target.json"], "is a regular file, not a folder", DEMO_RUN),
    "demo-emulate-slowdown-missing-rank": (["demo", "--out", "{w}/demo", "--emulate-slowdown", "5=3"],
                                           "rank 5 does not exist in a job of 2 rank(s)", DEMO_RUN),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_in_one_line_before_any_work(case: str, work: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    argv, needle, guarded = CASES[case]
    _no_work(monkeypatch, *guarded)
    refused(argv, needle, work, capsys)


def test_train_auto_global_batch_below_min_batch_is_refused_before_profiling(
        work: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # `train --auto --global-batch 2 --min-batch 2` on 2 ranks is refused before the profile is measured.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    _no_work(monkeypatch, *TRAIN_RUN)
    refused(["train", "--auto", "--global-batch", "2", "--min-batch", "2", "--device", "cpu"],
            "--global-batch 2 cannot give each of 2 rank(s) the min batch 2: use --global-batch >= 4", work, capsys)


@pytest.mark.slow
def test_fresh_run_into_a_folder_holding_a_checkpoint_is_refused(work: Path, capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    ck = work / "ck"
    assert main([*[a.replace("{w}", str(work)) for a in TRAIN], "--model", f"{FIX}:model", "--dataset",
                 f"{FIX}:dataset", "--checkpoint", str(ck)]) == 0
    capsys.readouterr()
    _no_work(monkeypatch, *TRAIN_RUN)
    refused([*TRAIN, "--model", f"{FIX}:model", "--dataset", f"{FIX}:dataset", "--checkpoint", str(ck)],
            "already holds a checkpoint (epoch 1 step 0); pass --resume to continue it", work, capsys)


# -- documented behaviour instead of an error ----------------------------------------------------------------
def test_force_writes_the_plan_with_an_oom_warning_and_the_report_leads_with_it(
        work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = work / "forced.json"
    # One micro-step allowed: 300 samples on a 200-sample cap cannot fit (with accumulation they would, as 2 x 150).
    rc = main(["plan", "--profile", str(CAPPED), "--global-batch", "300", "--from-batches", "300", "--force",
               "--max-accumulation-steps", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 0 and out.exists()
    assert err.count("\n") == 1 and "warning: --force: rank 0 gets 300 samples" in err and "out of memory" in err
    assert main(["validate", str(out)]) == 0  # a valid file, and says what it holds
    assert "over its cap, expect out-of-memory: rank 0 (300 > 200)" in capsys.readouterr().out
    rc = main(["report", "--profile", str(CAPPED), "--plan", str(out), "--out", str(work / "r.html"), "--json",
               str(work / "r.json")])
    assert rc == 0, capsys.readouterr().err
    findings = json.loads((work / "r.json").read_text())["findings"]
    assert findings["lines"][0].startswith("Out of memory ahead: rank 0 gets 300 (cap 200)")
    assert findings["over_cap_ranks"] == [0]


def _log_with_missing_times(path: Path, plan: Any) -> None:
    from planner.runlog import EndRecord, EpochRecord, RunLogWriter, StartRecord
    from planner.stats import StepStats

    nan = float("nan")
    with RunLogWriter(path) as w:
        w.write(StartRecord(time=0.0, world_size=2, global_batch=plan.global_batch, plan=plan))
        ranks = tuple(StepStats(rank=i, epoch=0, num_steps=5, batch_size=b, num_workers=1, data_wait_s=0.001,
                                compute_s=nan if i == 1 else 0.05, step_time_s=0.06)
                      for i, b in enumerate(plan.batch_sizes))
        w.write(EpochRecord(epoch=0, plan_fingerprint=plan.fingerprint, samples_per_s=nan, step_time_s=nan,
                            loss=nan, batch_sizes=plan.batch_sizes, predicted_step_time_s=(nan, 0.06), ranks=ranks))
        w.write(EndRecord(time=1.0, epochs=1))


def test_a_log_with_missing_times_reports_dashes_not_nan(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Our own writer logs a time it could not measure as null; the reader refused such a log ("expected a number,
    # got null") or showed "nan" cells, and dropping the null shifted rank 1's prediction onto rank 0.
    import planner

    plan = planner.solve(planner.Profile.load(MINIMAL), global_batch=512)
    log = work / "run.jsonl"
    _log_with_missing_times(log, plan)
    rc = main(["report", "--profile", str(MINIMAL), "--log", str(log), "--out", str(work / "r.html")])
    out, err = capsys.readouterr()
    assert rc == 0 and err == "", err
    page = (work / "r.html").read_text()
    assert "nan" not in out.lower() and ">nan<" not in page.lower() and "nan%" not in page.lower()
    rows = [line.split() for line in out[out.index("Run log, epoch 0"):].splitlines()[3:5]]
    # rank, predicted, measured, error, loader (not timed in this log: "-")
    assert rows[0] == ["0", "-", "51.00", "-", "-"]  # rank 0's prediction was null: "-", not rank 1's 60.00
    assert rows[1] == ["1", "60.00", "-", "-", "-"]  # rank 1 keeps its own prediction; its compute time was null


def test_a_3_rank_log_on_a_2_rank_profile_is_refused_and_a_warning_never_precedes_the_error(
        work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import planner
    from tests.reports._fixtures import three_rank_profile, write_run_log

    log = write_run_log(work / "run3.jsonl", planner.solve(three_rank_profile(), global_batch=700))
    # The plan was solved from another profile: that alone is a warning; with the bad log it must not be printed.
    other = planner.solve(planner.Profile.load(MINIMAL).scaled([1.0, 2.0]), global_batch=512)
    other.save(work / "other_plan.json")
    err = refused(["report", "--profile", str(MINIMAL), "--plan", "{w}/other_plan.json", "--log", str(log), "--out",
                   "{w}/r.html"], "is from a run of 3 rank(s) but the profile has 2", work, capsys)
    assert "warning" not in err


def test_a_log_holding_two_runs_reports_the_last_one_with_a_warning(work: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    import planner
    from planner.runlog import read_run_log
    from tests.reports._fixtures import write_run_log

    plan = planner.solve(planner.Profile.load(MINIMAL), global_batch=512)
    a, b = write_run_log(work / "a.jsonl", plan, truncated_tail=False), write_run_log(work / "b.jsonl", plan)
    both = work / "both.jsonl"
    both.write_text(a.read_text() + b.read_text())
    log = read_run_log(both)
    assert log.runs == 2 and len(log.epochs) == 2  # the last run's two epochs, not four
    rc = main(["report", "--profile", str(MINIMAL), "--log", str(both), "--out", str(work / "r.html")])
    err = capsys.readouterr().err
    assert rc == 0 and err.count("\n") == 1 and "holds 2 runs" in err and "reads the last one" in err


def test_a_million_fold_skew_prints_real_numbers(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # "0 samples/s = 8.73x the equal split (0)": a rate under 1 sample/s was printed with no digits.
    from tests.planner._profiles import linear_profile

    prof = linear_profile([1.0, 3000.0], cores=8)  # equal split: 96,000 s per step, 0.000667 samples/s
    prof.save(work / "skew.json")
    rc = main(["report", "--profile", str(work / "skew.json"), "--global-batch", "64", "--out", str(work / "r.html")])
    out = capsys.readouterr().out
    assert rc == 0
    finding = next(line for line in out.splitlines() if "The plan gives" in line)
    assert " 0 samples/s" not in finding and "(0)" not in finding, finding
    assert "the equal split (0.000667)" in finding, finding  # three significant digits of a small rate


# -- stdout that closes or fills up: the real process --------------------------------------------------------
def _planner(argv: list[str], **popen: Any) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    return subprocess.Popen([sys.executable, "-m", "planner", *argv], cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"},
                            stderr=subprocess.PIPE, text=True, **popen)


@pytest.mark.subprocess
def test_stdout_closed_by_the_reader_loses_nothing_but_text(work: Path) -> None:
    # `planner plan ... | head -1`: the pipe closes before the table is printed; the plan file is still written.
    proc = _planner(["plan", "--profile", str(MINIMAL), "--global-batch", "64", "--out", str(work / "p.json")],
                    stdout=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.close()  # before the child (still importing) writes a byte
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and err == "", err
    assert json.loads((work / "p.json").read_text())["kind"] == "plan"


@pytest.mark.subprocess
def test_stdout_on_a_full_device_is_one_line_after_the_files_are_written(work: Path) -> None:
    # stdout redirected to /dev/full (opened for writing, never replaced: this is not an --out path)
    with open("/dev/full", "w") as full:
        proc = _planner(["plan", "--profile", str(MINIMAL), "--global-batch", "64", "--out", str(work / "p.json")],
                        stdout=full)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "cannot write to standard output (No space left on device)" in err
    assert (work / "p.json").exists()


def test_every_listed_input_mistake_has_a_case() -> None:
    """Each input mistake docs/RELIABILITY.md section 7 lists maps to a case here."""
    must: dict[str, Callable[[str], bool]] = {
        "output is an input": lambda c: "is-the" in c, "folder": lambda c: "folder" in c,
        "unwritable": lambda c: "unwritable" in c, "300 characters": lambda c: "300" in c,
        "fifo": lambda c: "fifo" in c, "symlink": lambda c: "symlink" in c, "empty --out": lambda c: "empty" in c,
        "2**63": lambda c: "2**63" in c, "factory": lambda c: "factory-returns" in c,
        "missing rank": lambda c: "missing-rank" in c, "over a cap": lambda c: "over-" in c,
    }
    for what, match in must.items():
        assert any(match(c) for c in CASES), what
