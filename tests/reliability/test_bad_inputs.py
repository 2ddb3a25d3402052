"""Every CLI command given a bad input: exit 2, one line on stderr naming the problem, no traceback, no output.

The corpus lives in tests/data/bad/ (one defect per file, next to two valid ``args_good_*`` files and one valid
memory-capped profile that are bad only together with a CLI argument). Commands run in-process through
``planner.cli.main`` (exactly what the console script runs); ``test_real_process_*`` checks the actual
``python -m planner`` entry point for the commands that import torch, where a stray warning or a traceback on
stderr would show.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from planner.cli import main

REPO = Path(__file__).resolve().parents[2]
BAD = REPO / "tests" / "data" / "bad"
GOOD_PROFILE = BAD / "args_good_profile.json"
GOOD_PLAN = BAD / "args_good_plan.json"
CAPPED_PROFILE = BAD / "args_memory_capped_profile.json"
FIXTURES = "tests.reliability._fixtures"

# file -> words every command's one-line error must contain
PROFILES = {
    "profile_truncated.json": "not valid JSON",
    "profile_empty_file.json": "not valid JSON",
    "profile_not_utf8.json": "codec can't decode",
    "profile_top_level_list.json": "expected a JSON object at the top level",
    "profile_is_a_plan.json": "'kind' is \"plan\", expected 'profile'",
    "profile_wrong_version.json": "unsupported version 2",
    "profile_missing_hosts.json": "missing required field 'hosts'",
    "profile_missing_compute.json": "ranks[0]: missing required field 'compute'",
    "profile_empty_compute.json": "ranks[0].compute: must not be empty",
    "profile_zero_ranks.json": "ranks: must not be empty",
    "profile_nan_step_time.json": "compute[1].step_time_s: must be a finite number, got nan",
    "profile_inf_loader.json": "loader.sec_per_sample: must be a finite number, got inf",
    "profile_negative_step_time.json": "compute[2].step_time_s: must be > 0",
    "profile_zero_step_time.json": "compute[0].step_time_s: must be > 0",
    "profile_string_step_time.json": "step_time_s: expected a number",
    "profile_duplicate_ranks.json": "rank ids must be 0..1 each exactly once, got [0, 0]",
    "profile_rank_gap.json": "rank ids must be 0..1 each exactly once, got [0, 2]",
    "profile_negative_rank.json": "ranks[0].rank: must be >= 0",
    "profile_unknown_host.json": "'node9' is not in profile.hosts",
    "profile_typo_field.json": "compute[0]: missing required field 'step_time_s'",
    "profile_zero_cores.json": "cpu_cores: must be >= 1",
    "profile_negative_peak_bytes.json": "peak_bytes: must be >= 0",
    "profile_bool_batch.json": "batch_size: expected an integer",
    "profile_deeply_nested.json": "its JSON is nested too deeply",  # was a RecursionError traceback
    "profile_huge_step_time.json": "step_time_s is 1.7e+308 s, more than 1e+06 s",  # passed, then overflowed
    # What validate accepted and report or plan could not survive: one loader bounds them for every command.
    "profile_10k_char_device_name.json": "device_name: \"HHHHH",  # cut, with its length (a 10 MB one took 4.6 GB)
    "profile_300_char_device_name.json": "is longer than 256 characters",
    "profile_subnormal_step_time.json": "step_time_s: 1e-320 is below the smallest normal number",
    "profile_picosecond_step_time.json": "step_time_s is 1e-12 s, less than 1e-09 s",
    "profile_cores_beyond_int64.json": "cpu_cores: 10000000000000000000 is beyond the 64-bit integer range",
    "profile_billion_cores.json": "cpu_cores: must be <= 65,536, got 1,000,000,000",
    "profile_lone_surrogate_in_name.json": "holds '\\ud800' at character 5, half of a UTF-16 pair",
    "profile_1e300_capacity_bytes.json": "capacity_bytes: 1e+300 is beyond the 64-bit integer range",  # int(1e300)
}
PLANS = {
    "plan_truncated.json": "not valid JSON",
    "plan_empty_file.json": "not valid JSON",
    "plan_is_a_profile.json": "'kind' is \"profile\", expected 'plan'",
    "plan_wrong_version.json": "unsupported version 99",
    "plan_missing_fingerprint.json": "missing required field 'fingerprint'",
    "plan_missing_predicted.json": "missing required field 'predicted'",
    "plan_missing_batch_size.json": "ranks[0]: missing required field 'batch_size'",
    "plan_zero_ranks.json": "ranks: must not be empty",
    "plan_batches_dont_sum.json": "rank batch sizes sum to 16 but global_batch is 20",
    "plan_wrong_fingerprint.json": "the plan was edited by hand",
    "plan_nan_step_time.json": "predicted.step_time_s: must be a finite number, got nan",
    "plan_inf_rank_step_time.json": "predicted_step_time_s: must be a finite number, got inf",
    "plan_negative_step_time.json": "predicted_step_time_s: must be >= 0",
    "plan_world_size_mismatch.json": "plan.world_size is 2 but plan.ranks lists 1 ranks",
    "plan_duplicate_ranks.json": "must list ranks 0..1 in order, got [0, 0]",
    "plan_batch_below_min.json": "batch_size 16 is below min_batch 32",
    "plan_bad_bottleneck.json": '"gpu" is not one of compute, loader, memory',
    "plan_negative_workers.json": "num_workers: must be >= 0",
    "plan_for_two_ranks.json": "",  # valid on its own: see OVERRIDES
    "plan_deeply_nested.json": "its JSON is nested too deeply",
    "plan_bad_ddp_setting.json": "plan.meta.ddp.bucket_cap_mb must be a number of MiB in [1, 1024], got 0",
    "plan_million_rank_world_size.json": "world_size: must be <= 65,536, got 1,000,000",
}
# (file, command) -> other words, or None where the file is valid for that command (validate reads any kind)
OVERRIDES: dict[tuple[str, str], str | None] = {
    ("profile_top_level_list.json", "validate"): "'kind' must be \"profile\" or \"plan\"",
    ("profile_is_a_plan.json", "validate"): None,
    ("plan_is_a_profile.json", "validate"): None,
    ("plan_for_two_ranks.json", "validate"): None,
    ("plan_for_two_ranks.json", "report"): "the plan has 2 ranks but the profile has 1",
    ("plan_for_two_ranks.json", "train"): "the plan is for 2 rank(s) but 1 were launched",
}


def _argv(command: str, kind: str, path: Path, out: Path) -> list[str]:
    """The command line, with every output it can write pointed into `out` (which must stay empty)."""
    f = str(path)
    train = ["train", "--device", "cpu", "--epochs", "1", "--num-samples", "64", "--log-file", str(out / "run.jsonl"),
             "--checkpoint", str(out / "ckpt"), "--trace-file", str(out / "trace.jsonl")]
    if kind == "profile":
        return {
            "validate": ["validate", f],
            "plan": ["plan", "--profile", f, "--global-batch", "16", "--out", str(out / "plan.json")],
            "report": ["report", "--profile", f, "--global-batch", "16", "--out", str(out / "r.html"),
                       "--json", str(out / "r.json")],
            "train": [*train, "--plan", str(GOOD_PLAN), "--profile", f, "--replan"],
        }[command]
    return {
        "validate": ["validate", f],
        "report": ["report", "--profile", str(GOOD_PROFILE), "--plan", f, "--out", str(out / "r.html"),
                   "--json", str(out / "r.json")],
        "train": [*train, "--plan", f],
    }[command]


def _check(argv: list[str], needle: str, out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(argv)
    _, err = capsys.readouterr()
    assert rc == 2, f"exit {rc} for {argv}: {err}"
    assert err.count("\n") == 1 and err.endswith("\n"), f"not one line: {err!r}"
    assert "Traceback" not in err
    assert needle in err, f"{needle!r} not in {err!r}"
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*")) if out.exists() else []
    assert left == [], f"output left behind: {left}"


CASES = [(f, "profile", c) for f in PROFILES for c in ("validate", "plan", "report", "train")]
CASES += [(f, "plan", c) for f in PLANS for c in ("validate", "report", "train")]


@pytest.mark.parametrize(("name", "kind", "command"), CASES, ids=[f"{c}-{f[:-5]}" for f, _, c in CASES])
def test_bad_file(name: str, kind: str, command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    needle = OVERRIDES.get((name, command), (PROFILES | PLANS)[name])
    out = tmp_path / "out"
    out.mkdir()  # outputs go into existing folders; this one must stay empty
    if needle is None:  # valid for this command: it must succeed and say so
        assert main(_argv(command, kind, BAD / name, out)) == 0
        return
    _check(_argv(command, kind, BAD / name, out), needle, out, capsys)


# Bad command-line arguments, on valid files. {out} is a folder that must stay empty.
ARG_CASES: dict[str, tuple[list[str], str]] = {
    "plan-batch-over-memory": (["plan", "--profile", str(CAPPED_PROFILE), "--global-batch", "100000",
                                "--out", "{out}/plan.json"], "exceeds the sum of memory caps 200"),
    "report-batch-over-memory": (["report", "--profile", str(CAPPED_PROFILE), "--global-batch", "100000",
                                  "--out", "{out}/r.html"], "exceeds the sum of memory caps 200"),
    "plan-zero-global-batch": (["plan", "--profile", str(GOOD_PROFILE), "--global-batch", "0",
                                "--out", "{out}/plan.json"], "argument --global-batch/--global_batch: must be >= 1, got 0"),
    "plan-zero-min-batch": (["plan", "--profile", str(GOOD_PROFILE), "--global-batch", "16", "--min-batch", "0",
                             "--out", "{out}/plan.json"], "argument --min-batch/--min_batch: must be >= 1, got 0"),
    "plan-missing-profile": (["plan", "--profile", str(BAD / "no_such_file.json"), "--global-batch", "16",
                              "--out", "{out}/plan.json"], "profile file not found"),
    "report-batch-differs-from-plan": (["report", "--profile", str(GOOD_PROFILE), "--plan", str(GOOD_PLAN),
                                        "--global-batch", "17", "--out", "{out}/r.html"],
                                       "--global-batch 17 differs from the plan's global batch 16"),
    "report-log-is-not-a-log": (["report", "--profile", str(GOOD_PROFILE), "--global-batch", "16", "--log",
                                 str(BAD / "plan_truncated.json"), "--out", "{out}/r.html"],
                                "no start, epoch or replan events"),
    "train-batch-differs-from-plan": (["--global-batch", "17"], "--global-batch 17 differs from the plan's 16"),
    "train-unknown-model": (["--model", "nope"], "--model: unknown model 'nope'"),
    "train-unknown-dataset": (["--dataset", "nope"], "--dataset: unknown dataset 'nope'"),
    "train-missing-dataset-dir": (["--dataset", "cifar10:/no/such/dir"], "does not exist (datasets are never"),
    "train-unimportable-factory": (["--model", "no_such_module:factory"], "cannot import 'no_such_module'"),
    "train-factory-not-a-model": (["--model", f"{FIXTURES}:not_a_model"], "the factory returned str"),
    "train-zero-samples": (["--num-samples", "0"], "argument --num-samples: must be >= 1, got 0"),
    "train-negative-samples": (["--num-samples", "-3"], "argument --num-samples: must be >= 1, got -3"),
    "train-negative-epochs": (["--epochs", "-1"], "argument --epochs: must be >= 1, got -1"),
    "train-negative-checkpoint-every": (["--checkpoint-every", "-2"], "argument --checkpoint-every: must be >= 0"),
    "train-resume-without-checkpoint-dir": (["--resume"], "--resume needs --checkpoint DIR"),
    "train-no-cuda": (["--device", "cuda:0"], "CUDA is not available"),
    "train-replan-without-profile": (["--replan"], "--replan with --plan needs --profile"),
}


@pytest.mark.parametrize("case", sorted(ARG_CASES))
def test_bad_argument(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv, needle = ARG_CASES[case]
    out = tmp_path / "out"
    out.mkdir()
    if case.startswith("train-"):
        if case == "train-no-cuda":
            import torch

            if torch.cuda.is_available():
                pytest.skip("a CUDA device is visible")
        # options given later win in argparse, so the defaults come first and the case's flags after them
        argv = ["train", "--plan", str(GOOD_PLAN), "--device", "cpu", "--epochs", "1", "--num-samples", "64",
                "--log-file", "{out}/run.jsonl", *argv]
    _check([a.replace("{out}", str(out)) for a in argv], needle, out, capsys)


def test_unreadable_checkpoint_is_refused_before_anything_is_written(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "checkpoint.pt").write_bytes(b"not a checkpoint\x00\x01")
    out = tmp_path / "out"
    out.mkdir()
    _check(["train", "--plan", str(GOOD_PLAN), "--device", "cpu", "--model", f"{FIXTURES}:model", "--dataset",
            f"{FIXTURES}:dataset", "--checkpoint", str(ckpt), "--resume", "--log-file", str(out / "run.jsonl")],
           "not a readable checkpoint (UnpicklingError", out, capsys)
    assert [p.name for p in ckpt.iterdir()] == ["checkpoint.pt"]  # the bad file is kept for the user to inspect


@pytest.mark.parametrize("command", ["train", "profile"])
def test_empty_factory_dataset(command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    argv = (["train", "--plan", str(GOOD_PLAN), "--device", "cpu", "--log-file", str(out / "run.jsonl")]
            if command == "train" else ["profile", "--device", "cpu", "--quick", "--out", str(out / "p.json")])
    _check([*argv, "--model", f"{FIXTURES}:model", "--dataset", f"{FIXTURES}:empty_dataset"], "empty", out, capsys)


def test_dataset_smaller_than_one_global_step_is_accepted_and_padded(tmp_path: Path) -> None:
    # Not an error: with drop_last=False (the trainer's choice, like DistributedSampler's default) an epoch of
    # N < B samples is one partial step, padded by wrap-around, so every rank still gets its planned count.
    from runtime.sampler import HeteroBatchSampler

    batches = list(HeteroBatchSampler(5, [7, 5], 0, shuffle=False)) + list(HeteroBatchSampler(5, [7, 5], 1,
                                                                                            shuffle=False))
    assert len(batches) == 2 and sorted({i for b in batches for i in b}) == [0, 1, 2, 3, 4]
    assert main(["train", "--plan", str(GOOD_PLAN), "--device", "cpu", "--epochs", "1", "--num-samples", "5",
                 "--model", "mlp", "--trace-file", str(tmp_path / "t.jsonl")]) == 0
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 1


def test_corpus_is_complete() -> None:
    files = {p.name for p in BAD.iterdir()}
    args_files = {p.name for p in (GOOD_PROFILE, GOOD_PLAN, CAPPED_PROFILE)}
    assert files == set(PROFILES) | set(PLANS) | args_files, "every file in tests/data/bad has a row here"
    assert len(files) >= 30
    assert "NaN" in (BAD / "profile_nan_step_time.json").read_text()  # the bare token, as a careless tool writes


def _real(argv: list[str]) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK")}
    return subprocess.Popen([sys.executable, "-m", "planner", *argv], cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.subprocess
def test_real_process_train_and_profile(tmp_path: Path) -> None:
    """The console entry point itself: torch imported, nothing but the one error line on stderr."""
    out = tmp_path / "out"
    out.mkdir()
    procs = {
        "train-plan": (_real(["train", "--plan", str(BAD / "plan_nan_step_time.json"), "--device", "cpu",
                              "--log-file", str(out / "run.jsonl")]), "must be a finite number, got nan"),
        "train-world-size": (_real(["train", "--plan", str(BAD / "plan_for_two_ranks.json"), "--device", "cpu",
                                "--checkpoint", str(out / "ck")]), "the plan is for 2 rank(s) but 1 were launched"),
        "profile-model": (_real(["profile", "--model", "nope", "--device", "cpu", "--out", str(out / "p.json")]),
                          "unknown model 'nope'"),
    }
    try:
        for name, (proc, needle) in procs.items():
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 2, (name, err)
            assert err.count("\n") == 1 and "Traceback" not in err and needle in err, (name, err)
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert list(out.iterdir()) == []


@pytest.mark.parametrize(("name", "kind"), [(f, "profile") for f in PROFILES] + [(f, "plan") for f in PLANS])
def test_validate_refuses_a_bad_file_with_the_line_the_loading_command_prints(
        name: str, kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One loader: `validate` gives the same verdict and the same words as `plan` and `report` (the file's kind
    stands for "input" where the file cannot be read far enough to know it)."""
    if OVERRIDES.get((name, "validate"), "") != "" or (name, "report") in OVERRIDES:
        pytest.skip("a file valid for one command and not another (OVERRIDES)")
    f = str(BAD / name)
    others = ([["plan", "--profile", f, "--global-batch", "16"], ["report", "--profile", f, "--global-batch", "16",
                                                                 "--out", str(tmp_path / "r.html")]]
              if kind == "profile" else
              [["report", "--profile", str(GOOD_PROFILE), "--plan", f, "--out", str(tmp_path / "r.html")]])
    lines = []
    for argv in (["validate", f], *others):
        assert main(argv) == 2, argv
        lines.append(capsys.readouterr().err)
    said = lines[0].replace("input file", f"{kind} file")
    assert all(line == said for line in lines[1:]), lines
