"""What the own-loop form adds per step and what it leaves behind, asserted by counts (never by wall-clock speed):
StepTimer reads its clock five times a step on the host clock, the planned sampler hands out its batches with one
``tolist`` a block, and a PlannedRun that re-planned and finished leaves no thread in the process (a thread still
running at interpreter exit is how a process aborts after its training finished).  benchmarks/own_loop_cost.py
measures the same costs in seconds."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import planner
from runtime import PlannedRun
from runtime.sampler import HeteroBatchSampler
from runtime.timing import StepTimer

REPO = Path(__file__).resolve().parents[2]
CLOCK_READS_PER_STEP = 5
"""data_start, data_end, compute_start, compute_end (host clock) and step_end: one read each."""


def test_step_timer_reads_the_clock_five_times_a_step() -> None:
    reads = 0

    def clock() -> float:
        nonlocal reads
        reads += 1
        return reads * 1e-3

    timer = StepTimer("cpu", clock=clock)
    steps = 50
    for _ in timer.iter_data(range(steps)):
        timer.compute_start()
        timer.compute_end()  # the gradient hook's call
        timer.compute_end()  # the after-backward fallback: ignored, no clock read
        timer.step_end()
    # the failed fetch that ends the epoch reads the clock once more (data_start), and belongs to no step
    assert reads == CLOCK_READS_PER_STEP * steps + 1
    assert timer.num_steps == steps


def test_planned_sampler_converts_each_block_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per batch the sampler slices a Python list; it never builds a tensor or calls tolist per step."""
    calls = 0
    real = torch.Tensor.tolist

    def counting(self: torch.Tensor) -> object:
        nonlocal calls
        calls += 1
        return real(self)

    sampler = HeteroBatchSampler(4096, [64, 64], 0, seed=0)
    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    batches = list(sampler)
    assert len(batches) == 32 and all(len(b) == 64 for b in batches)
    assert calls == 1  # 4096 samples are one block (runtime.sampler._BLOCK_POSITIONS)


def _one_rank_plan(tmp: Path) -> tuple[Path, Path]:
    compute = (planner.ComputePoint(batch_size=4, step_time_s=0.004), planner.ComputePoint(batch_size=16,
                                                                                           step_time_s=0.016))
    profile = planner.Profile(hosts=(planner.HostProfile(name="h", cpu_cores=2),),
                              ranks=(planner.RankProfile(rank=0, host="h", device="cpu", compute=compute),))
    plan = planner.evaluate(profile, [16], num_workers=[0])
    profile.save(tmp / "profile.json")
    plan.save(tmp / "plan.json")
    return tmp / "plan.json", tmp / "profile.json"


@pytest.mark.parametrize("workers", [0, 2])
def test_a_finished_planned_run_leaves_no_thread(tmp_path: Path, workers: int) -> None:
    plan, profile = _one_rank_plan(tmp_path)
    before = set(threading.enumerate())
    data = TensorDataset(torch.randn(100, 8), torch.randn(100, 1))
    model = torch.nn.Linear(8, 1)
    run = PlannedRun(plan, profile=profile, replan=True, log_file=tmp_path / "run.jsonl")
    loader = DataLoader(data, batch_sampler=run.sampler_for(len(data), "cpu"), num_workers=workers)
    run.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a re-plan may change the loader workers the framework owns: it says so
        for epoch in range(3):
            for x, y in run.epoch(epoch, loader, last=epoch == 2):
                loss = F.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    assert run._finished and len(run.decisions) == 2
    for t in set(threading.enumerate()) - before:
        if t.name == "QueueFeederThread":  # the DataLoader closes its index queues as it shuts down: they end soon after
            t.join(timeout=30)
    left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert left == [], [t.name for t in left]


@pytest.mark.subprocess
def test_benchmark_help_names_an_example() -> None:
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "own_loop_cost.py"), "--help"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "own_loop_cost.py --model mlp --pairs 5" in out


def test_benchmark_record_names_count_up(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import own_loop_cost
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    stem = "cpux2_mlp_own-loop-cost"
    assert own_loop_cost._next_record(tmp_path, stem).name == f"{stem}_01.json"
    (tmp_path / f"{stem}_01.json").write_text(json.dumps({}))
    (tmp_path / f"{stem}_07.json").write_text(json.dumps({}))
    assert own_loop_cost._next_record(tmp_path, stem).name == f"{stem}_08.json"
