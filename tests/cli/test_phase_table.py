"""benchmarks/phase_table.py: did a rank start its long steps ahead of its peers (each step's ``lead_ms``)?"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests._scripts import benchmark

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def _write(prefix: Path, rank: int, compute: list[float], lead: list[float | None], epoch: int = 1,
           host: list[float] | None = None) -> None:
    rec = {"epoch": epoch, "rank": rank, "compute_ms": compute, "lead_ms": lead, "step_time_ms": [100.0] * len(lead)}
    if host is not None:
        rec["host_compute_ms"] = host
    with open(f"{prefix}_steps{rank}.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")


def test_long_steps_started_early_are_counted_and_correlate(tmp_path: Path) -> None:
    prefix = tmp_path / "skew_r1"
    # rank 0 starts steps 2 and 5 20 ms before its peer, and those run 30 ms long; step 0 has no lead
    _write(prefix, 0, [96, 96, 126, 96, 97, 127, 96, 96], [None, 1, 1, 1, 1, 1, 1, 1],
           host=[40, 40, 40, 40, 40, 126, 40, 40])  # step 5's span was closed late by the host
    _write(prefix, 1, [97] * 8, [None, 1, 21, 2, 1, 21, 1, 9])
    (row,) = benchmark("phase_table").epoch_rows(str(prefix))
    assert row["steps"] == 7 and row["compute_median_ms"] == 96
    assert (row["long"], row["early_long"], row["early_all"]) == (2, 2, 3)  # step 7: early by 8 ms, not long
    assert row["corr"] > 0.9 and row["host_long"] == 1
    # the peer's view: it never started early, and none of its steps ran long
    (peer,) = benchmark("phase_table").epoch_rows(str(prefix), rank=1)
    assert (peer["long"], peer["early_all"]) == (0, 0)


def test_logs_without_leads_give_no_rows() -> None:
    # session 15's step logs predate lead_ms
    assert benchmark("phase_table").epoch_rows(str(RESULTS / "h100x2_train_auto_replan_s15d_skewS_r1")) == []
    assert benchmark("phase_table").epoch_rows("/nonexistent/run") == []


def test_the_table_prints_a_row_per_epoch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prefix = tmp_path / "loader_r1"
    for epoch in (1, 2):
        _write(prefix, 0, [116, 117, 116, 150], [None, 2, 2, 2], epoch)
        _write(prefix, 1, [14, 14, 15, 14], [None, 3, 2, 30], epoch)
    mod = benchmark("phase_table")
    argv, sys.argv = sys.argv, ["phase_table.py", str(prefix), "--json", str(tmp_path / "out.json")]
    try:
        assert mod.main() == 0
    finally:
        sys.argv = argv
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("| loader_r1")]
    assert lines == ["| loader_r1 | 1 | 3 | 117 | 1 | 1 | 1 | 1.0 | 0 |", "| loader_r1 | 2 | 3 | 117 | 1 | 1 | 1 | 1.0 | 0 |"]
    assert len(json.loads((tmp_path / "out.json").read_text())[str(prefix)]) == 2
