"""benchmarks/loader_summary.py on a recorded run log: the model fed with each epoch's own measurements.

Session 6, 2x H100, `planner train --auto --replan --emulate-slowdown 1=3` with the real DataLoader
(docs/results/h100x2_train_auto_replan_s6_skew_r2_run.jsonl): the plan's prediction missed by ~20% per rank while
the step, as the larger of the ranks' median compute and loader period, matched the measured step within 3.4%.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import ModuleType

import pytest

from tests._scripts import benchmark

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "docs" / "results" / "h100x2_train_auto_replan_s6_skew_r2_run.jsonl"


def _module() -> ModuleType:
    return benchmark("loader_summary")


def test_the_inputs_model_explains_the_recorded_epochs(tmp_path: Path) -> None:
    shutil.copy(RUN, tmp_path / "skew_r2_run.jsonl")
    summary = _module().summarize(tmp_path)
    launch = summary["launches"]["skew_r2"]
    by_epoch = {e["epoch"]: e for e in launch["epochs"]}
    # epoch 2: rank 1's median compute 182.4 ms beats both loaders' periods (147, 163 ms); the step ran 188.6 ms
    assert by_epoch[2]["inputs_model_step_s"] == pytest.approx(0.1824, abs=5e-4)
    assert by_epoch[2]["inputs_model_error"] == pytest.approx(0.034, abs=0.002)
    assert launch["inputs_model_errors"] == pytest.approx([-0.019, 0.034], abs=0.002)  # epochs 1 and 2
    assert summary["cases"]["skew"]["inputs_model_error"]["median"] == pytest.approx(0.0075, abs=0.002)


def test_a_launch_stopped_before_its_steady_epoch_is_counted_apart(tmp_path: Path) -> None:
    """Session 10 call 2 (2x H100): the call's budget stopped skew_r3 after epoch 1; the case's medians are over
    the two launches that reached epoch 2, and the third is named, not counted."""
    for r in (1, 2, 3):
        shutil.copy(ROOT / "docs" / "results" / f"h100x2_train_auto_replan_s10b_skew_r{r}_run.jsonl",
                    tmp_path / f"skew_r{r}_run.jsonl")
    case = _module().summarize(tmp_path)["cases"]["skew"]
    assert case["launches"] == 2 and case["incomplete"] == ["skew_r3"]
    assert len(case["plan_changes"]) == 2


def test_the_fill_is_reported_beside_the_steady_ratio(tmp_path: Path) -> None:
    """Session 10 call 4 (2x H100, 200-step epochs, 28 + 2 workers): every epoch's 144-step fill cost 9-26 s."""
    shutil.copy(ROOT / "docs" / "results" / "h100x2_train_auto_replan_s10d_loader_r1_run.jsonl",
                tmp_path / "loader_r1_run.jsonl")
    summary = _module().summarize(tmp_path)
    epochs = summary["launches"]["loader_r1"]["epochs"]
    assert [e["fill_steps"] for e in epochs] == [144, 144, 144]
    assert [round(e["fill_excess_s"], 1) for e in epochs] == [26.1, 11.9, 15.1]
    assert summary["cases"]["loader"]["fill_excess_s"]["median"] == pytest.approx(15.1, abs=0.05)
