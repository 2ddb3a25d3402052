"""benchmarks/resolve_recorded.py: re-solving a recorded plan's profile with and without the solver's worker move."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests._scripts import benchmark

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def test_the_worker_move_changes_session_15s_skew_plan_and_leaves_the_loader_case(tmp_path: Path) -> None:
    for name in ("h100x2_train_auto_replan_s15a_skew_r3", "h100x2_train_auto_replan_s16c_loader_r1"):
        for part in ("plan", "profile"):
            shutil.copy(RESULTS / f"{name}_{part}.json", tmp_path / f"{name}_{part}.json")
    (tmp_path / "orphan_plan.json").write_text("{}")  # a plan without its profile is skipped
    rows = {r["plan"]: r for r in benchmark("resolve_recorded").compare(tmp_path, "move")}
    assert sorted(rows) == ["h100x2_train_auto_replan_s15a_skew_r3_plan.json",
                            "h100x2_train_auto_replan_s16c_loader_r1_plan.json"]
    skew = rows["h100x2_train_auto_replan_s15a_skew_r3_plan.json"]
    assert (skew["before"], skew["before_workers"]) == ([387, 125], [22, 8])
    assert (skew["after"], skew["after_workers"]) == ([393, 119], [23, 7])
    assert skew["after_step_ms"] < 0.98 * skew["before_step_ms"]
    loader = rows["h100x2_train_auto_replan_s16c_loader_r1_plan.json"]
    assert loader["before"] == loader["after"] == [474, 38]
