"""The trainer samples each rank's device state at every epoch end into the run log, and the report reads it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from planner.cli import main
from planner.runlog import read_run_log


def test_every_epoch_record_carries_the_ranks_state(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log, prof = tmp_path / "run.jsonl", tmp_path / "p.json"
    assert main(["train", "--auto", "--quick", "--device", "cpu", "--model", "mlp", "--global-batch", "32",
                 "--num-samples", "256", "--epochs", "2", "--data-on-device", "--log-file", str(log),
                 "--profile-out", str(prof), "--plan-out", str(tmp_path / "plan.json")]) == 0
    run = read_run_log(log)
    assert [e.epoch for e in run.epochs] == [0, 1]
    for e in run.epochs:
        (state,) = e.device_state
        assert state is not None and state.window_s is not None and state.window_s > 0
        assert state.other_processes is None and state.sm_clock_mhz is None  # a CPU rank: no NVML, no guess
        if hasattr(os, "sched_getaffinity"):
            assert state.cpu_affinity == tuple(sorted(os.sched_getaffinity(0)))
    assert main(["validate", str(log)]) == 0
    capsys.readouterr()
    assert main(["report", "--profile", str(prof), "--log", str(log), "--out", str(tmp_path / "r.html")]) == 0
    assert "Device and host state while profiled" in capsys.readouterr().out
