"""The Replanner learns the exposed communication its ranks' curves cannot hold (runtime/replan/model.py)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

import planner
from planner.runlog import read_run_log
from planner.solve import exposed_comm_s
from planner.stats import StepStats
from runtime.replan import Replanner
from tests.runtime._plans import linear_cpu_profile

ROOT = Path(__file__).resolve().parents[2]
HOG_RUN = ROOT / "tests" / "data" / "h200x1_two_ranks_gloo_cpu_hog_resnet50_run.jsonl"
"""Own loop on PlannedRun, two gloo ranks sharing one H200 (ResNet-50, bf16, the PIL pipeline in loader workers),
a CPU hog on rank 1's cores from epoch 3: the all-reduce, reduced on the CPU, went from ~25 to ~85 ms a step."""


def _stats(plan: planner.Plan, epoch: int, compute_s: tuple[float, ...], extra_s: float) -> list[StepStats]:
    """Every rank computes ``compute_s[i]``; the step waits ``extra_s`` more after the slowest (exposed comm)."""
    step = max(compute_s) + extra_s
    return [StepStats(rank=r.rank, epoch=epoch, num_steps=40, batch_size=r.batch_size, num_workers=r.num_workers,
                      data_wait_s=0.0, compute_s=compute_s[r.rank], step_time_s=step,
                      compute_s_std=0.01 * compute_s[r.rank]) for r in plan.ranks]


def test_a_step_longer_than_every_rank_is_learned_as_exposed_communication() -> None:
    # Both ranks compute what the profile says; every step then waits 50 ms more (a slow all-reduce).
    profile = linear_cpu_profile([0.004, 0.004])
    plan = planner.solve(profile, global_batch=32, min_batch=2)
    assert plan.batch_sizes == (16, 16)
    rp = Replanner(profile, plan)
    predicted_before = plan.predicted.step_time_s
    d = rp.decide(_stats(plan, 0, (0.064, 0.064), 0.050), 0)
    assert not d.adopted and rp.plan.batch_sizes == (16, 16)  # the same seconds at every split: no move
    miss = 0.064 + 0.050 - predicted_before
    assert rp._model.exposed_extra_s == pytest.approx(0.8 * miss)  # smoothing 0.8 of the miss
    assert d.repredicted is not None and "its prediction is now" in d.reason
    assert rp.plan.predicted.step_time_s == pytest.approx(predicted_before + 0.8 * miss)
    # The next epoch closes the rest of the way, and the state carries it to a resumed run.
    rp.decide(_stats(rp.plan, 1, (0.064, 0.064), 0.050), 1)
    assert rp._model.exposed_extra_s == pytest.approx(0.96 * miss)
    again = Replanner(profile, plan)
    again.load_state_dict(json.loads(json.dumps(rp.state_dict())))
    assert again._model.exposed_extra_s == rp._model.exposed_extra_s
    assert again.profile.comm == rp.profile.comm


def test_a_step_shorter_than_predicted_never_takes_the_profiles_term_below_zero() -> None:
    profile = linear_cpu_profile([0.004, 0.004])
    plan = planner.solve(profile, global_batch=32, min_batch=2)
    rp = Replanner(profile, plan)
    for epoch in range(4):
        rp.decide(_stats(rp.plan, epoch, (0.040, 0.040), 0.0), epoch)  # faster than profiled, no wait at all
        assert rp._model.exposed_extra_s == 0.0
        assert exposed_comm_s(rp.profile) == exposed_comm_s(profile)


def test_a_state_with_a_bad_exposed_term_is_refused() -> None:
    profile = linear_cpu_profile([0.004, 0.004])
    plan = planner.solve(profile, global_batch=32, min_batch=2)
    rp = Replanner(profile, plan)
    state = rp.state_dict()
    for bad in (-0.01, float("nan"), "1", True):
        with pytest.raises(planner.ValidationError, match="exposed_extra_s"):
            Replanner(profile, plan).load_state_dict({**state, "exposed_extra_s": bad})


def test_the_recorded_cpu_hog_run_is_predicted_once_its_split_has_run() -> None:
    # Replayed in order from the run's first state: the same decisions as the run (one move, at epoch 3), and
    # from the second epoch after it the prediction in force is within 11% of each measured step (median 6%),
    # where the run's own predictions, without the exposed term, missed by 32-37%.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from replan_replay import logged_stats

    log = read_run_log(HOG_RUN)
    steps = {e.epoch: e.step_time_s for e in log.epochs}
    batches = {e.epoch: e.batch_sizes for e in log.epochs}
    rp = Replanner.from_description(log.replanner, log.start_plan)
    rp.load_state_dict(log.replans[0].inputs["state"])
    errors = {}
    for r in log.replans:
        d = rp.decide([logged_stats(s) for s in r.inputs["stats"]], r.epoch)
        assert d.adopted == r.adopted and tuple(rp.plan.batch_sizes) == tuple(batches[r.epoch + 1])
        errors[r.epoch + 1] = steps[r.epoch + 1] / rp.plan.predicted.step_time_s - 1
    adopted = [r.epoch for r in log.replans if r.adopted]
    assert adopted == [3]
    after = [errors[e] for e in errors if e >= adopted[0] + 2]
    assert len(after) == 4 and max(abs(x) for x in after) < 0.11
    assert statistics.median(abs(x) for x in after) < 0.06
    in_force, logged = log.start_plan.predicted.step_time_s, {}
    for r in log.replans:  # the run's own predictions: the plan each decision left (re-predicted or not)
        in_force = r.plan.predicted.step_time_s if r.plan is not None else in_force
        logged[r.epoch + 1] = steps[r.epoch + 1] / in_force - 1
    assert all(logged[e] > 0.30 for e in logged if e >= adopted[0] + 2)
    assert rp._model.exposed_extra_s > 0.030
