"""benchmarks/step_log_segments.py on session 10's raw `--step-log` files (docs/results, 2x H100)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._scripts import benchmark

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def test_the_loader_case_runs_at_its_prediction_once_the_fill_is_over() -> None:
    seg = benchmark("step_log_segments").segments(str(RESULTS / "h100x2_train_auto_replan_s10c_loader_r1"),
                                                  [(2, 30), (60, 100)])
    assert seg["predicted_step_ms"] == pytest.approx(117.0, abs=0.1)
    epoch2 = seg["epochs"][2]
    fill, steady = epoch2["segments"]
    assert steady["mean_ms"] == pytest.approx(116.6, abs=0.1)  # within 0.5% of the prediction
    assert fill["mean_ms"] > 1.15 * steady["mean_ms"]
    # step 28, the end of the 28-worker rank's first cycle: its loader was 0.66 s late
    stall = {s[0]: s for s in epoch2["stalls"]}[28]
    assert stall[2] > 600 and stall[3] < 1  # rank 0 waited for data, rank 1 did not


def test_missing_step_logs_are_refused() -> None:
    with pytest.raises(SystemExit, match=r"no /nonexistent/run_steps0\.jsonl"):
        benchmark("step_log_segments").segments("/nonexistent/run", [(0, 10)])
