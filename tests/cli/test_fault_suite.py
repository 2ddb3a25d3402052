"""benchmarks/fault_suite.py: how a run is scored from its run log's diagnoses, the seeded schedule, the confusion
table docs/PERFORMANCE.md is generated with, and the GPU form's dry run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests._scripts import BENCHMARKS, benchmark

sys.path.insert(0, str(BENCHMARKS))  # fault_suite imports its sibling scripts by name, as when run
fs = benchmark("fault_suite")
sb = benchmark("summarize_bench")


def _epoch(epoch: int, *diag: tuple[int, str]) -> dict[str, Any]:
    return {"epoch": epoch, "diagnosis": [{"rank": r, "cause": c, "measured_s": 0.2, "predicted_s": 0.1,
                                           "evidence": ""} for r, c in diag]}


def _run(fault: str, rank: int, at: int | None, *epochs: dict[str, Any]) -> Any:
    run = fs.Run(index=1, fault=fault, fault_rank=rank, fault_epoch=at)
    run.epochs = list(epochs)
    return run


def test_the_first_epoch_naming_the_faults_rank_from_the_fault_on_is_the_answer() -> None:
    run = _run("cpu-hog", 1, 3, _epoch(0), _epoch(1), _epoch(2), _epoch(3), _epoch(4, (1, "cpu-cotenant")),
               _epoch(5, (1, "inside-step")))
    s = fs.score(run)
    assert (s["named"], s["correct"], s["detected_epoch"], s["delay_epochs"]) == ("cpu-cotenant", True, 4, 1)
    assert s["false_alarms"] == []


def test_alarms_before_the_fault_or_on_the_other_rank_are_false() -> None:
    run = _run("step", 0, 3, _epoch(1, (1, "cpu-cotenant")), _epoch(3, (0, "inside-step"), (1, "late-peer")))
    s = fs.score(run)
    assert s["named"] == "inside-step" and s["delay_epochs"] == 0
    assert [a["epoch"] for a in s["false_alarms"]] == [1, 3]
    quiet = fs.score(_run("none", 1, None, _epoch(0), _epoch(1)))
    assert (quiet["named"], quiet["correct"], quiet["false_alarms"]) == ("none", True, [])
    missed = fs.score(_run("loader", 1, 2, _epoch(2), _epoch(3)))
    assert (missed["named"], missed["correct"], missed["delay_epochs"]) == ("none", False, None)


def test_the_schedule_is_seeded_and_holds_every_fault() -> None:
    a = fs.schedule(fs.CPU_FAULTS, 5, 5, 6, seed=0)
    b = fs.schedule(fs.CPU_FAULTS, 5, 5, 6, seed=0)
    assert [(r.fault, r.fault_rank, r.fault_epoch) for r in a] == [(r.fault, r.fault_rank, r.fault_epoch) for r in b]
    assert sorted(r.fault for r in a) == sorted([*fs.CPU_FAULTS * 5, *["none"] * 5])
    assert all(r.fault_epoch is None if r.fault == "none" else 2 <= r.fault_epoch <= 4 for r in a)


def test_the_confusion_table_counts_named_causes_by_injected_fault() -> None:
    meta = {"devices": ["CPU x86_64", "CPU x86_64"]}
    runs = [_run("cpu-hog", 1, 3, _epoch(3, (1, "cpu-cotenant"))), _run("cpu-hog", 0, 2, _epoch(2)),
            _run("none", 0, None, _epoch(1, (0, "cpu-cotenant")))]
    recs = [{"meta": meta, "fault": r.fault, "scores": fs.score(r)} for r in runs]
    table = sb.fault_confusion(recs).splitlines()
    assert table[0] == ("| machine | injected (right answer) | runs | named cpu-cotenant | named none | correct | "
                        "delay (epochs) | runs with false alarms (CPU co-tenant) | of them after epoch 0 | crashed |")
    assert table[2] == "| cpux2 | cpu-hog (cpu-cotenant) | 2 | 1 | 1 | 1/2 | 0 | 0 (0) | 0 | 0 |"
    assert table[3] == "| cpux2 | none (none) | 1 | 0 | 1 | 1/1 | - | 1 (1) | 1 | 0 |"
    assert sb.fault_confusion([]).startswith("No records yet")


def test_the_gpu_form_dry_runs_on_cpu(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert fs.main(["--device", "cuda", "--dry-run", "--runs-per-fault", "1", "--no-fault-runs", "1"]) == 0
    out = capsys.readouterr().out
    assert "gpu-cotenant on rank" in out and "cotenant.py --device cuda:" in out and "--devices cuda:0,cuda:1" in out
