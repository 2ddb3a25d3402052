"""NaN/inf never reach the solver; a re-plan that would starve a rank is refused with a logged reason.

Already proven elsewhere (not repeated here): the JSON readers refuse NaN/inf/negative times at every CLI entry
point (tests/reliability/test_bad_inputs.py, with the bare ``NaN`` token in the files), the Replanner refuses
non-finite or negative stats and a candidate below min_batch (tests/runtime/test_replan.py). This module adds the
Python API entry points and the trainer's own log of a refused re-plan.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import planner
from planner.errors import ValidationError
from planner.profile import ComputePoint, HostProfile, Profile, RankProfile
from runtime.replan import Replanner
from runtime.sampler import HeteroBatchSampler

BAD = Path(__file__).resolve().parents[1] / "data" / "bad"


@pytest.mark.parametrize("name", ["profile_nan_step_time.json", "profile_inf_loader.json"])
def test_profile_api_refuses_nan(name: str) -> None:
    with pytest.raises(ValidationError, match="must be a finite number"):
        planner.Profile.load(BAD / name)
    with pytest.raises(ValidationError, match="must be a finite number"):
        Profile.from_dict(json.loads((BAD / name).read_text()))


@pytest.mark.parametrize("name", ["plan_nan_step_time.json", "plan_inf_rank_step_time.json"])
def test_plan_api_and_sampler_refuse_nan(name: str) -> None:
    with pytest.raises(ValidationError, match="must be a finite number"):
        planner.Plan.load(BAD / name)
    with pytest.raises(ValidationError, match="must be a finite number"):
        HeteroBatchSampler.from_plan(str(BAD / name), 0, 100)


def _coded_profile(t: float) -> Profile:
    """A profile built in code (no JSON reader in the way) with one measurement replaced by t."""
    return Profile(hosts=(HostProfile(name="n", cpu_cores=4),), ranks=tuple(
        RankProfile(rank=i, host="n", device="cpu",
                    compute=(ComputePoint(batch_size=4, step_time_s=0.01),
                             ComputePoint(batch_size=32, step_time_s=t if i else 0.05))) for i in range(2)))


@pytest.mark.parametrize("t", [math.nan, math.inf, -1.0, 0.0])
def test_a_profile_built_in_code_with_a_bad_time_is_refused_at_construction(t: float) -> None:
    # ComputePoint checks itself, so no path -- JSON or code -- hands the solver a NaN, inf or negative time.
    with pytest.raises(ValidationError, match="step_time_s"):
        _coded_profile(t)


@pytest.mark.parametrize("t", [math.nan, math.inf, -1.0])
def test_a_bad_time_cannot_be_put_into_a_built_profile(t: float) -> None:
    # solve/evaluate have no check of their own: they rely on no Profile ever holding a bad time. A built profile
    # is frozen, and `replace` (the one way to change a field) runs the same check again, so none can get one.
    good = _coded_profile(0.05)
    point = good.ranks[1].compute[1]
    with pytest.raises(ValidationError, match="step_time_s"):
        replace(point, step_time_s=t)
    with pytest.raises(ValidationError, match="step_time_s"):
        replace(good.ranks[1], compute=(good.ranks[1].compute[0], ComputePoint(batch_size=32, step_time_s=t)))
    with pytest.raises(AttributeError):  # frozen: no assignment in place either
        point.step_time_s = t  # type: ignore[misc]


def test_replan_that_would_starve_a_rank_is_refused_and_the_reason_logged(tmp_path: Path) -> None:
    # The refusal itself is tested in tests/runtime/test_replan.py::test_min_batch_is_never_starved; this checks
    # what the trainer writes to its run log for it (decision.to_log(), one JSON line, no NaN) and that the
    # report's reader gets the reason back.
    from planner.runlog import read_run_log

    profile = planner.Profile.load(Path(planner.__file__).parent / "examples" / "minimal_profile.json")
    plan = planner.solve(profile, global_batch=512, min_batch=16)

    def careless(profile: Profile, *, global_batch: int, min_batch: int, **_: Any) -> planner.Plan:
        return planner.evaluate(profile, [global_batch - 1, 1])

    rp = Replanner(profile, plan, smoothing=1.0, solve_fn=careless)
    stats = [planner.StepStats(rank=r.rank, epoch=0, num_steps=50, batch_size=r.batch_size,
                               num_workers=r.num_workers, data_wait_s=0.0,
                               compute_s=r.predicted_step_time_s * (1.0 if r.rank == 0 else 50.0),
                               step_time_s=r.predicted_step_time_s * 50.0, compute_s_std=0.0) for r in plan.ranks]
    decision = rp.decide(stats, epoch=0)
    assert not decision.adopted and rp.plan.batch_sizes == plan.batch_sizes  # kept (its prediction re-made)
    line = json.dumps(decision.to_log(), allow_nan=False)
    assert "rank 1 at 1 below min batch 16: refused" in json.loads(line)["reason"]
    log = tmp_path / "run.jsonl"
    start = {"event": "start", "time": 0.0, "world_size": 2, "global_batch": 512, "strategy": "plan",
             "plan": plan.to_dict()}
    log.write_text(json.dumps(start) + "\n" + line + "\n")
    run = read_run_log(log)
    assert any("below min batch 16" in str(r) for r in run.replans)


def test_nan_stats_never_move_the_model() -> None:
    # The Replanner-level test (tests/runtime/test_replan.py) covers each field; here: a whole epoch of NaN from
    # one rank leaves the next solve's profile exactly the original.
    profile = planner.Profile.load(Path(planner.__file__).parent / "examples" / "minimal_profile.json")
    plan = planner.solve(profile, global_batch=512)
    rp = Replanner(profile, plan)
    good = planner.StepStats(rank=0, epoch=0, num_steps=50, batch_size=plan.ranks[0].batch_size,
                             num_workers=plan.ranks[0].num_workers, data_wait_s=0.0, compute_s=0.06,
                             step_time_s=0.07, compute_s_std=0.001)
    bad = replace(good, rank=1, batch_size=plan.ranks[1].batch_size, compute_s=math.nan, step_time_s=math.nan)
    d = rp.decide([good, bad], epoch=0)
    assert not d.adopted and "non-finite" in d.reason
    assert rp.profile.to_dict() == profile.to_dict()
