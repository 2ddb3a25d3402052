"""benchmarks/loader_check_vs_train.py on recorded launches: the check's cost against training's, per rank-epoch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from loader_check_vs_train import main, rows  # noqa: E402

RESULTS = ROOT / "docs" / "results"


def test_each_clean_epoch_at_the_checked_split_is_set_against_the_check() -> None:
    # s18a r1 kept its checked split [392, 120] for 5 epochs: epochs 1-3 are clean (0 fills, 4 drains)
    got = rows(str(RESULTS / "h200x2_train_auto_replan_s18a_skewS_r1_profile.json"))
    assert [(e, r) for _, e, r, *_ in got] == [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    name, _, _, check, train, model = got[0]
    assert name == "h200x2_train_auto_replan_s18a_skewS_r1"
    assert check == pytest.approx(4.513e-3, rel=1e-3) and train == pytest.approx(4.545e-3, rel=1e-3)
    assert 0.5 < model <= 1.0  # training's load at most the check's (every worker busy)


def test_a_launch_without_a_check_gives_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert rows(str(RESULTS / "h100x2_train_auto_replan_s14b_skew_r1_profile.json")) == []
    assert main([str(RESULTS / "h100x2_train_auto_replan_s14b_skew_r1_profile.json")]) == 1
    assert "no rank-epoch" in capsys.readouterr().out
