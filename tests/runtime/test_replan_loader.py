"""The recorded 2x H100 loader run replayed through the Replanner: with the contended loader model and each rank's
own compute (runtime.timing's peer attribution), the starving rank sheds work at once."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

import planner
from planner.runlog import read_run_log
from runtime.replan import Replanner

RUN = Path(__file__).resolve().parents[2] / "docs" / "results" / "h100x2_resnet50_train_auto_replan_loader_s3"


def _replay(epoch: int, *, own: bool) -> tuple[planner.Plan, list[planner.StepStats]]:
    """The run's first plan and one epoch's stats; ``own``: rank 1's compute as the peer attribution reports it
    (the run logged its median; its mean carried the steps rank 0 reached late)."""
    plan = planner.Plan.load(f"{RUN}_plan.json")
    stats = list(read_run_log(f"{RUN}_run.jsonl").epochs[epoch].ranks)
    if own:
        s = stats[1]
        assert s.compute_s_median is not None and s.compute_s_mad is not None
        stats[1] = replace(s, compute_s=s.compute_s_median, compute_s_std=1.4826 * s.compute_s_mad,
                           interference_s=s.compute_s - s.compute_s_median)
    return plan, [replace(s, epoch=0) for s in stats]


@pytest.mark.parametrize("epoch", [1, 2, 3])
def test_the_loader_bound_rank_sheds_work_at_the_first_boundary(epoch: int) -> None:
    plan, stats = _replay(epoch, own=True)
    profile = planner.Profile.load(f"{RUN}_profile.json")
    d = Replanner(profile, plan).decide(stats, epoch=0)
    assert d.adopted, d.reason
    assert d.new_plan is not None and d.new_plan.batch_sizes[0] < plan.batch_sizes[0] - 20
    assert d.predicted_gain is not None and d.predicted_gain >= 0.05


def test_a_peer_stretched_compute_would_have_hidden_the_gain() -> None:
    """Epoch 2 as logged (rank 1's mean 189 ms, 135 ms its own): rank 1 looks slow, the move looks small."""
    plan, stats = _replay(2, own=False)
    d = Replanner(planner.Profile.load(f"{RUN}_profile.json"), plan).decide(stats, epoch=0)
    assert not d.adopted and d.predicted_gain is not None and d.predicted_gain < 0.05
