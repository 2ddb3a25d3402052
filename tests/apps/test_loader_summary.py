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
