"""benchmarks/loader_queue_sim.py: the DataLoader delivery model, on made-up numbers and on a session 13 step log."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._scripts import benchmark

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def test_workers_slower_than_the_loop_make_it_wait_their_difference() -> None:
    sim = benchmark("loader_queue_sim").simulate
    # 2 workers at 300 ms a batch deliver two every 300 ms; the loop steps in 100 ms: after the first batch it waits
    # 100 ms before every other step, 50 ms a step on average
    waits = sim([300.0] * 40, [100.0] * 40, workers=2, prefetch=2)
    assert waits[0] == pytest.approx(300.0) and sum(waits[1:]) / 39 == pytest.approx(50.0, abs=2.6)
    assert waits[2] == pytest.approx(100.0) and waits[3] == pytest.approx(0.0, abs=1e-9)
    # a loop slower than its workers never waits once started
    assert max(sim([300.0] * 40, [200.0] * 40, workers=2, prefetch=2)[1:]) == pytest.approx(0.0, abs=1e-9)
    # a pin thread slower than the loop paces it: 120 ms a batch against 100 ms steps
    assert sim([10.0] * 40, [100.0] * 40, workers=4, prefetch=2, pin_ms=120.0)[-1] == pytest.approx(20.0, abs=1e-6)


def test_session_13s_quiet_launch_has_no_wait_from_its_workers_or_a_serial_pin() -> None:
    rows = benchmark("loader_queue_sim").replay(RESULTS / "h100x2_train_auto_replan_s13b_loaderDP_r1_steps0.jsonl",
                                                workers=28, prefetch=4, pin_ms=105.0)
    assert [r["model_wait_ms"] for r in rows] == [0.0, 0.0, 0.0, 0.0]
    assert [r["measured_wait_ms"] for r in rows][2] == pytest.approx(4.5, abs=0.1)  # what the rank saw


def test_long_waits_are_matched_to_the_collections_that_began_in_their_steps(tmp_path: Path) -> None:
    import json

    log = tmp_path / "steps0.jsonl"
    epoch = {"epoch": 2, "data_wait_ms": [0.1, 150.0, 0.2, 60.0], "step_time_ms": [100, 250, 100, 160],
             "gc": {"collections": [40, 3, 1], "pauses": [[120.0, 140.0, 2], [380.0, 6.0, 1]]}}
    log.write_text(json.dumps(epoch) + "\n")
    (row,) = benchmark("loader_queue_sim").waits_in_gc(log)
    # the full collection began at 120 ms, inside step 1 (100-350 ms); the short one in step 2, which did not wait;
    # step 3 (450-610 ms) waited 60 ms with none
    assert row == {"epoch": 2, "long_waits_ms": 210.0, "in_gc_ms": 150.0, "gc_pauses": 2, "gc_ms": 146.0}
