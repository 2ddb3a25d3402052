"""`planner train --help` lists what a user needs; `--help-all` adds the advanced options, which parse as before."""

from __future__ import annotations

import re

import pytest

from planner.cli import main

MAX_OPTIONS = 32
"""Option lines `planner train --help` may print (-h and --help-all included)."""
ADVANCED = ("--replan-threshold", "--loader-check-s", "--gpu-normalize", "--weighting", "--data-on-device",
            "--max-steps-per-epoch", "--restart-loader-each-epoch", "--emulate-slowdown",
            "--emulate-slowdown-from-epoch", "--emulate-loader", "--emulate-memory")


def _options(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    out = capsys.readouterr().out
    return [m.group(1) for m in re.finditer(r"^  (-[-\w]+)", out, re.M)]


def test_help_lists_what_a_user_needs_and_help_all_the_rest(capsys: pytest.CaptureFixture[str]) -> None:
    short = _options(["train", "--help"], capsys)
    assert len(short) <= MAX_OPTIONS and short[:2] == ["-h", "--help-all"]
    assert {"--plan", "--auto", "--global-batch", "--replan", "--log-file", "--resume"} <= set(short)
    assert not set(ADVANCED) & set(short)
    full = _options(["train", "--help-all"], capsys)
    assert set(short) < set(full) and set(ADVANCED) <= set(full)


def test_bench_has_the_same_split(capsys: pytest.CaptureFixture[str]) -> None:
    short = _options(["bench", "--help"], capsys)
    full = _options(["bench", "--help-all"], capsys)
    assert len(short) <= MAX_OPTIONS and "--sweep-slowdown" not in short and "--sweep-slowdown" in full


def test_an_advanced_option_parses_and_is_checked_as_any_other(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from planner.cli.cmd_train import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--auto", "--global-batch", "64", "--replan-threshold", "0.1", "--emulate-slowdown", "1=3"])
    assert args.replan_threshold == 0.1 and args.emulate_slowdown == "1=3"
    assert main(["train", "--plan", "p.json", "--replan-threshold", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--replan-threshold" in err and "Traceback" not in err


@pytest.mark.parametrize("gone", ["--pin-ahead", "--no-pin-memory", "--loader-nice"])
def test_switches_measured_not_to_help_are_refused_in_one_line(gone: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--plan", "p.json", gone]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and gone in err
