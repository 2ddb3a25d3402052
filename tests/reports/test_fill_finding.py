"""The report's epoch-start finding (reports.measured.fill_line) on recorded run logs (2x H100).

200-step epochs with 28 + 2 loader workers, recorded by an earlier fill rule: `planner train` read the pace
after each epoch's 144-step fill -- which was the drain, the workers idle (the rule now leaves the drain out too and
finds no steady middle in such epochs) -- and the fill cost 9-26 s an epoch beyond it.  The finding reads the fields
as recorded.  100-step epochs carry no fill fields set, and older logs none at all: neither gets the finding."""

from __future__ import annotations

from pathlib import Path

from planner.runlog import read_run_log
from reports.measured import fill_line, wall_line

RESULTS = Path(__file__).resolve().parents[2] / "tests" / "data"


def test_the_fill_of_long_epochs_is_reported_with_its_cost() -> None:
    line = fill_line(read_run_log(RESULTS / "h100x2_resnet50_loader_skew_474_38_200_step_epochs_run.jsonl"))
    assert line is not None
    assert "first 144 steps" in line and "13.5 s beyond the steady pace" in line  # epochs 1 and 2: 11.9, 15.1 s
    assert "rank 0 has 28" in line and "--max-workers-per-rank" in line


def test_no_finding_without_a_steady_part_or_fill_fields() -> None:
    assert fill_line(read_run_log(RESULTS / "h100x2_resnet50_loader_skew_471_41_run.jsonl")) is None
    assert fill_line(read_run_log(RESULTS / "h100x2_resnet50_loader_skew_16_worker_cap_455_57_run.jsonl")) is None


def test_the_wall_clock_is_set_beside_the_timed_pace() -> None:
    """The 200-step epochs: the timed pace (the drain's, then) read ~4,150-4,400 samples/s, the wall clock
    2,580-3,170 (epochs 1-2); the finding says so with the seconds per epoch the timed pace leaves out."""
    import json
    from dataclasses import replace

    log = read_run_log(RESULTS / "h100x2_resnet50_loader_skew_474_38_200_step_epochs_run.jsonl")
    assert all(e.wall_s is None for e in log.epochs)  # recorded before the run log carried the wall clock
    steps = [json.loads(x) for x in (RESULTS / "h100x2_resnet50_loader_skew_474_38_200_step_epochs_epoch0_steps.jsonl").read_text()
             .splitlines()]
    walled = tuple(replace(e, wall_s=sum(s["step_time_ms"]) / 1e3, samples=200 * 512)  # the step log's wall clock
                   for e, s in zip(log.epochs, steps, strict=True))
    line = wall_line(replace(log, epochs=walled))
    assert line is not None and line.startswith("By the wall clock the epochs ran 2,69")  # median of 2,812 and 2,577
    assert "below the timed pace of 4,16" in line
    assert wall_line(log) is None  # no wall times, no finding
