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


def test_an_epoch_holding_the_runs_drain_is_not_a_clean_wall_reading(tmp_path: Path) -> None:
    """Session 12 call 2 (2x H100, 3 streamed epochs of 240 steps): the run's last 112 steps, the loaders' drain,
    fall in epoch 2, whose wall ratio (0.896-0.975) they flatter; epoch 1 is all steady (0.951-0.958) but before
    the acceptance's epochs, so no clean wall reading is given."""
    for r in (1, 2, 3):
        shutil.copy(ROOT / "docs" / "results" / f"h100x2_train_auto_replan_s12b_loader_r{r}_run.jsonl",
                    tmp_path / f"loader_r{r}_run.jsonl")
    summary = _module().summarize(tmp_path)
    for r in (1, 2, 3):
        launch = summary["launches"][f"loader_r{r}"]
        assert [e["drain_steps"] for e in launch["epochs"]] == [0, 0, 112]
        assert launch["clean_wall_ratio_median"] is None
    case = summary["cases"]["loader"]
    assert case["clean_wall_ratio"] is None
    assert case["steady_wall_ratio"]["median"] == pytest.approx(0.952, abs=0.001)


def test_a_steady_epoch_without_fill_or_drain_gives_the_clean_wall_reading(tmp_path: Path) -> None:
    """The same launch as if it had run one epoch more (the drain moved out of epoch 2): epoch 2's wall ratio
    becomes the clean reading."""
    import json

    src = ROOT / "docs" / "results" / "h100x2_train_auto_replan_s12b_loader_r2_run.jsonl"
    lines = []
    for line in src.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "epoch":
            for r in rec["ranks"]:
                r["drain_steps"] = 0
        lines.append(json.dumps(rec))
    (tmp_path / "loader_r2_run.jsonl").write_text("\n".join(lines) + "\n")
    launch = _module().summarize(tmp_path)["launches"]["loader_r2"]
    epoch2 = launch["epochs"][2]
    assert epoch2["drain_steps"] == 0 and epoch2["fill_steps"] == 0
    assert launch["clean_wall_ratio_median"] == pytest.approx(epoch2["wall_ratio"]) == pytest.approx(0.952, abs=0.001)


def test_the_epoch_that_refills_an_adopted_re_plan_is_not_a_clean_wall_reading(tmp_path: Path) -> None:
    """Session 13 call 3 (2x H100, loaderDP_r2): the Replanner adopted [469, 43] -> [475, 37] after epoch 1; epoch 2
    started the new plan's loader stream from empty workers (0.570 by the wall clock) and is no steady reading;
    epoch 3 holds the drain, so the launch gives no clean reading at all."""
    shutil.copy(ROOT / "docs" / "results" / "h100x2_train_auto_replan_s13c_loaderDP_r2_run.jsonl",
                tmp_path / "loaderDP_r2_run.jsonl")
    launch = _module().summarize(tmp_path)["launches"]["loaderDP_r2"]
    assert [e["refill"] for e in launch["epochs"]] == [False, False, True, False]
    assert launch["epochs"][2]["wall_ratio"] == pytest.approx(0.570, abs=0.001)
    assert launch["plan_changes"] == 1 and launch["clean_wall_ratio_median"] is None


def test_per_rank_errors_are_read_over_the_clean_epochs_when_there_are_some(tmp_path: Path) -> None:
    """Session 13 call 2's first launch (4 streamed epochs of 120 steps): epoch 3 holds 112 steps of drain, where
    rank 1 reads -14% or so; the per-rank errors come from epoch 2 alone, as the report's table reads them."""
    shutil.copy(ROOT / "docs" / "results" / "h100x2_train_auto_replan_s13b_loaderDP_r1_run.jsonl",
                tmp_path / "loaderDP_r1_run.jsonl")
    launch = _module().summarize(tmp_path)["launches"]["loaderDP_r1"]
    assert launch["rank_error_epochs"] == [2]
    assert launch["steady_rank_errors"] == pytest.approx([0.044, 0.021], abs=0.001)
