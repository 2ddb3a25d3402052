"""The report's epoch-start finding (reports.measured.fill_line) on session 10's raw run logs (2x H100).

200-step epochs with 28 + 2 loader workers, recorded by the session's first fill rule: `planner train` read the pace
after each epoch's 144-step fill -- which was the drain, the workers idle (the rule now leaves the drain out too and
finds no steady middle in such epochs) -- and the fill cost 9-26 s an epoch beyond it.  The finding reads the fields
as recorded.  100-step epochs carry no fill fields set, and older logs none at all: neither gets the finding."""

from __future__ import annotations

from pathlib import Path

from planner.runlog import read_run_log
from reports.measured import fill_line

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def test_the_fill_of_long_epochs_is_reported_with_its_cost() -> None:
    line = fill_line(read_run_log(RESULTS / "h100x2_train_auto_replan_s10d_loader_r1_run.jsonl"))
    assert line is not None
    assert "first 144 steps" in line and "13.5 s beyond the steady pace" in line  # epochs 1 and 2: 11.9, 15.1 s
    assert "rank 0 has 28" in line and "--max-workers-per-rank" in line


def test_no_finding_without_a_steady_part_or_fill_fields() -> None:
    assert fill_line(read_run_log(RESULTS / "h100x2_train_auto_replan_s10c_loader_r1_run.jsonl")) is None
    assert fill_line(read_run_log(RESULTS / "h100x2_train_auto_replan_s9_loader_r1_run.jsonl")) is None
