"""`planner train` and an own loop run one protocol (runtime.run.PlannedRun): one epoch on a fake clock gives both
the same run-log records and the same re-plan decision.

Each rank's model advances a fake clock by its per-sample cost in the forward -- the only place time passes -- and
both paths' step timers read that clock, so the two loops measure the same steps whatever the host is doing.  The
profile says both ranks cost 1 ms a sample; rank 1 really costs 3 ms, so the first epoch end re-plans.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import planner
from tests._dist import run_distributed
from tests.runtime._plans import linear_cpu_profile

COST_S = (0.001, 0.003)
"""Seconds per sample of each rank's forward on the fake clock (the profile says 0.001 for both)."""
SAMPLES, GLOBAL_BATCH, FEATURES, CLASSES = 192, 16, 8, 4


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class ClockedNet(torch.nn.Module):
    """A linear classifier whose forward takes ``cost_s`` per sample of the fake clock."""

    def __init__(self, clock: FakeClock, cost_s: float) -> None:
        super().__init__()
        self.clock, self.cost_s = clock, cost_s
        self.fc = torch.nn.Linear(FEATURES, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.t += self.cost_s * x.shape[0]
        return self.fc(x)


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _trainer_path(rank: int, world: int, clock: FakeClock, plan: planner.Plan, profile: planner.Profile,
                  log: Path) -> None:
    from planner.cli.distenv import DistEnv
    from planner.cli.train import train
    from planner.cli.train_config import TrainConfig
    from profiler.workloads.specs import Workload

    data = TensorDataset(torch.randn(SAMPLES, FEATURES), torch.randint(0, CLASSES, (SAMPLES,)))
    workload = Workload(model_fn=lambda: ClockedNet(clock, COST_S[rank]), dataset=data, num_classes=CLASSES,
                        sample_shape=(FEATURES,), loss_fn=F.cross_entropy, name="clocked@tensors",
                        has_batchnorm=False)
    cfg = TrainConfig(epochs=2, replan=True, log_path=str(log), data_on_device=True, quiet=True, seed=0)
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    train(cfg, env, plan, profile, workload)


def _own_loop_path(rank: int, clock: FakeClock, plan: planner.Plan, profile: planner.Profile, log: Path) -> None:
    from runtime import PlannedRun, register_weighted_hook

    data = TensorDataset(torch.randn(SAMPLES, FEATURES), torch.randint(0, CLASSES, (SAMPLES,)))
    torch.manual_seed(0)
    model = DDP(ClockedNet(clock, COST_S[rank]))
    run = PlannedRun(plan, profile=profile, replan=True, log_file=log, seed=0, quiet=True)
    # Loaded in the loop (no workers), as the trainer's path here: both may take a plan's workers, as the
    # trainer does (a loop that keeps its workers re-plans at them: runtime.replan.Replanner's follow_workers).
    run.follows_workers = True
    sampler = run.sampler_for(len(data), "cpu")
    loader = DataLoader(data, batch_sampler=sampler)
    register_weighted_hook(model, sampler)
    run.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(2):
        for x, y in run.epoch(epoch, loader, last=epoch == 1):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()


def _both(rank: int, world: int, out: str) -> None:
    import runtime.run
    from runtime.timing import StepTimer

    clock = FakeClock()
    runtime.run.StepTimer = functools.partial(StepTimer, clock=clock)  # type: ignore[misc]
    profile = linear_cpu_profile((0.001, 0.001))
    plan = planner.solve(profile, global_batch=GLOBAL_BATCH)
    _trainer_path(rank, world, clock, plan, profile, Path(out) / "trainer.jsonl")
    _own_loop_path(rank, clock, plan, profile, Path(out) / "own.jsonl")


# What only one of the loops knows, or the host's real clock measures: left out of the comparison.
_UNSHARED = {"time", "loss", "wall_s", "device_state", "dataset_size"}


def _comparable(record: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in record.items() if k not in _UNSHARED}
    if out.get("diagnosis"):  # the cause is shared; its evidence quotes the host-measured device state
        out["diagnosis"] = [{k: v for k, v in d.items() if k != "evidence"} for d in out["diagnosis"]]
    if isinstance(out.get("plan"), dict):  # the solver's own wall time is the host's
        out["plan"] = {**out["plan"], "solver": {**out["plan"].get("solver", {}), "solve_time_s": None}}
    return out


@pytest.mark.distributed
def test_trainer_and_own_loop_write_the_same_records_and_decide_alike(tmp_path: Path) -> None:
    run_distributed(_both, 2, str(tmp_path), timeout_s=200)
    trainer, own = _records(tmp_path / "trainer.jsonl"), _records(tmp_path / "own.jsonl")
    assert [r["event"] for r in trainer] == [r["event"] for r in own] == ["start", "replan", "epoch", "epoch", "end"]
    start = next(r for r in trainer if r["event"] == "start")
    assert start["plan"]["ranks"][0]["batch_size"] == start["plan"]["ranks"][1]["batch_size"] == 8
    decided = next(r for r in trainer if r["event"] == "replan")
    assert decided["adopted"] and decided["new_batch_sizes"][0] > decided["new_batch_sizes"][1]  # rank 1 is slow
    for a, b in zip(trainer, own, strict=True):
        assert _comparable(a) == _comparable(b), a["event"]
    epochs = [r for r in own if r["event"] == "epoch"]
    assert epochs[0]["samples"] == epochs[1]["samples"] == SAMPLES  # each epoch covers the dataset once
    # 3 ms a sample at batch 8 on rank 1: the synchronous step is its 24 ms on the fake clock.
    assert epochs[0]["step_time_s"] == pytest.approx(0.024)
