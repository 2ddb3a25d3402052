"""benchmarks/prediction_suite.py's records and the PERFORMANCE table summarize_bench makes of them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests._scripts import benchmark

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"

sb = benchmark("summarize_bench")


def _record(case: str, error: float, *, card: str = "cpux1", held_out: bool = True,
            source: str = "real") -> dict[str, Any]:
    predicted = 0.1
    return {"record": 1, "kind": "prediction", "source": source, "case": case, "card": card, "model": "mlp",
            "global_batch": 32, "batch_sizes": [32], "held_out": held_out, "predicted_step_s": predicted,
            "measured_step_s": predicted * (1 + error), "error": error, "code": "abc1234"}


def test_the_table_has_one_row_per_case_with_median_p95_and_max_of_abs_error(tmp_path: Path) -> None:
    errors = [0.10, -0.30, 0.05, 0.20, -0.02]
    for i, e in enumerate(errors):
        (tmp_path / f"cpux1_prediction_cpu-alone_{i + 1:02d}.json").write_text(json.dumps(_record("cpu-alone", e)))
    (tmp_path / "cpux2_prediction_cpu-slowdown_01.json").write_text(
        json.dumps(_record("cpu-slowdown", 0.4, card="cpux2", held_out=False, source="emulated: rank 1 2x")))
    table = sb.prediction_table(tmp_path)
    rows = [line for line in table.splitlines() if line.startswith("| cpux")]
    assert len(rows) == 2
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[:4] == ["cpux1", "cpu-alone", "mlp", "5 (5)"]
    assert cells[4:8] == ["+5.0%", "10.0%", "30.0%", "30.0%"]  # median signed, median |e|, p95 |e| (5 rows: max)
    assert cells[8] == "-" and cells[9] == "real"
    slow = [c.strip() for c in rows[1].strip("|").split("|")]
    assert slow[3] == "1 (0)" and slow[9] == "emulated"


def test_the_drift_column_is_the_median_over_the_rows_with_a_control(tmp_path: Path) -> None:
    for i, (e, corrected) in enumerate([(0.5, 0.02), (0.3, -0.04), (0.1, None)]):
        r = _record("cpu-alone", e)
        if corrected is not None:
            r["error_drift_corrected"] = corrected
        (tmp_path / f"cpux1_prediction_cpu-alone_{i + 1:02d}.json").write_text(json.dumps(r))
    row = next(line for line in sb.prediction_table(tmp_path).splitlines() if line.startswith("| cpux1"))
    assert [c.strip() for c in row.strip("|").split("|")][8] == "3.0% (2)"


def test_p95_is_the_nearest_rank() -> None:
    assert sb._p95([float(i) for i in range(1, 101)]) == 95.0
    assert sb._p95([3.0]) == 3.0


def test_no_records_says_which_script_makes_them(tmp_path: Path) -> None:
    assert "prediction_suite.py" in sb.prediction_table(tmp_path)


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*_prediction_*.json")), ids=lambda p: p.name)
def test_each_recorded_row_holds_its_error_and_provenance(path: Path) -> None:
    r = json.loads(path.read_text())
    assert r["kind"] == "prediction" and path.name.startswith(f"{r['card']}_prediction_{r['case']}_")
    assert math.isclose(r["error"], r["measured_step_s"] / r["predicted_step_s"] - 1)
    assert math.isclose(r["measured_samples_per_s"], r["global_batch"] / r["measured_step_s"])
    assert r["torch"] and r["code"] and r["devices"] and r["source"].split(":")[0] in ("real", "emulated")
    assert len(r["rounds_step_s"]) >= 3 and r["notes"]
    if "control_batch" in r:  # an alone row: its drift is the control's measured / profiled step
        assert r["control_batch"] in r["profiled_batch_sizes"][0] and len(r["control_rounds_step_s"]) >= 3
        assert math.isclose(r["error_drift_corrected"],
                            r["measured_step_s"] / (r["predicted_step_s"] * r["drift"]) - 1)
