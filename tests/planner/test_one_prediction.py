"""One prediction: a plan's per-rank step, its step and samples/s, the run log's per-rank predictions and the
report's run-log table are the same numbers (planner.solve.rank_step_s, planner.plan.synchronous_step_s).

The case is the memory-capped cluster with co-tenants: ranks 0-1 capped (they accumulate), ranks 2-3 slower,
whose forward and backward the all-reduce stretches under DDP (span factors); a plan table that said one number
for rank 3 and a report table another was the bug."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import planner
from planner.cli import main
from planner.plan import Plan, synchronous_step_s
from planner.runlog import (
    EndRecord,
    EpochRecord,
    RunLogWriter,
    StartRecord,
    predicted_step_times,
    read_run_log,
)
from planner.stats import StepStats
from reports.measured import measured_splits

SIZES = (16, 64, 128, 256, 512, 1024)
OPTIMIZER_S = 0.004


def _profile(path: Path) -> Path:
    ranks = []
    for i, (per_sample, cap) in enumerate([(0.00030, 200), (0.00030, 200), (0.00060, None), (0.00066, None)]):
        r: dict[str, Any] = {"rank": i, "host": "n0", "device": f"cuda:{i}", "optimizer_step_s": OPTIMIZER_S,
                             "compute": [{"batch_size": b, "step_time_s": 0.012 + per_sample * b} for b in SIZES]}
        if cap is not None:
            r["memory"] = {"max_batch_size": cap}
        ranks.append(r)
    planner.Profile.from_dict({
        "version": 1, "kind": "profile", "hosts": [{"name": "n0", "cpu_cores": 64}], "ranks": ranks,
        "comm": {"backend": "nccl", "exposed_s": 0.0147, "span_factors": [1.0, 1.0, 1.12, 1.15]},
    }).save(path)
    return path


def _table_column(text: str, header: str, column: str) -> list[str]:
    """The column ``column`` of the aligned table that follows the line starting with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    head = next(i for i in range(start, len(lines)) if column in lines[i])
    names = re.split(r"\s{2,}", lines[head].strip())
    out = []
    for line in lines[head + 1:]:
        if not line.strip() or set(line.strip()) <= set("-+ |"):
            if out:
                break
            continue
        out.append(re.split(r"\s{2,}", line.strip())[names.index(column)])
    return out


def _log(path: Path, plan: Plan) -> Path:
    """A synthetic run log as the writers make it: each epoch's record carries ``predicted_step_times(plan)``."""
    with RunLogWriter(path) as log:
        log.write(StartRecord(time=0.0, world_size=plan.world_size, global_batch=plan.global_batch, plan=plan,
                              dataset_size=plan.global_batch * 20))
        for epoch in range(3):
            ranks = tuple(StepStats(rank=r.rank, epoch=epoch, num_steps=20, batch_size=r.batch_size,
                                    num_workers=r.num_workers, data_wait_s=0.0, compute_s=0.97 * r.timer_busy_s,
                                    step_time_s=plan.predicted.step_time_s * 1.01,
                                    compute_s_std=0.01 * r.timer_busy_s) for r in plan.ranks)
            log.write(EpochRecord(epoch=epoch, plan_fingerprint=plan.fingerprint,
                                  samples_per_s=plan.global_batch / (plan.predicted.step_time_s * 1.01),
                                  step_time_s=plan.predicted.step_time_s * 1.01, loss=1.0,
                                  batch_sizes=plan.batch_sizes, ranks=ranks,
                                  predicted_step_time_s=predicted_step_times(plan)))
        log.write(EndRecord(time=1.0, epochs=3))
    return path


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_plan_table_run_log_and_report_carry_one_prediction(tmp_path: Path, mode: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    prof = _profile(tmp_path / "profile.json")
    assert main(["plan", "--profile", str(prof), "--global-batch", "4096", "--mode", mode, "--min-gain", "0",
                 "--out", str(tmp_path / "plan.json")]) == 0
    plan_out = capsys.readouterr().out
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.accumulates and plan.mode == mode
    if mode == "fsdp":
        assert len(set(plan.accumulation_steps)) == 1
    else:  # the capped ranks accumulate, the co-tenants' ranks run one micro-step: their stretch applies
        assert plan.accumulation_steps[2:] == (1, 1) and plan.ranks[3].predicted_step_time_s > max(
            plan.ranks[3].predicted_compute_s or 0.0, plan.ranks[3].predicted_loader_s or 0.0)

    # The plan: one per-rank number, the step and samples/s made of it.
    per_rank = [r.predicted_step_time_s for r in plan.ranks]
    assert per_rank == [r.timer_busy_s for r in plan.ranks]
    assert all(r.predicted_busy_s is None for r in plan.ranks)
    assert plan.predicted.step_time_s == synchronous_step_s(per_rank, plan.predicted.comm_s)
    assert plan.predicted.samples_per_s == plan.global_batch / plan.predicted.step_time_s
    shown = [f"{1000 * t:.2f}" for t in per_rank]
    assert _table_column(plan_out, "", "step ms") == shown
    assert f"{plan.predicted.samples_per_s:12.1f} samples/s" in plan_out

    # The run log: the records carry the plan's numbers exactly, and its step is the plan's step.
    log = read_run_log(_log(tmp_path / "run.jsonl", plan))
    for e in log.epochs:
        assert e.predicted_step_time_s == tuple(per_rank)
        assert synchronous_step_s(e.predicted_step_time_s, plan.predicted.comm_s) == plan.predicted.step_time_s
    (split,) = measured_splits(log, plan.predicted.comm_s)
    assert split.predicted_step_time_s == plan.predicted.step_time_s

    # The report: its plan table and its run-log table print the plan table's numbers.
    assert main(["report", "--profile", str(prof), "--plan", str(tmp_path / "plan.json"), "--log",
                 str(tmp_path / "run.jsonl"), "--out", str(tmp_path / "report.html")]) == 0
    report_out = capsys.readouterr().out
    assert _table_column(report_out, "", "step ms") == shown
    assert _table_column(report_out, "Run log, epoch", "predicted ms") == shown
    html = (tmp_path / "report.html").read_text()
    for t in shown:
        assert f"{t}" in html
