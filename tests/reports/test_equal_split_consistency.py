"""The report's equal split is the plan's equal split: one worker rule (planner.solve.equal_split_workers)."""

from __future__ import annotations

from dataclasses import replace

import pytest

import planner
from planner.profile import LoaderProfile
from reports import analyze, options_for
from tests.planner._profiles import linear_profile


def test_report_equal_split_uses_the_plans_worker_rule() -> None:
    # Rank 1's loader is measured to scale to 2 workers only (loader.max_workers), below --max-workers-per-rank:
    # the plan's equal split gives it 2 workers; a report that applied the CLI cap alone would give it more and
    # predict a faster equal split than the plan does.
    base = linear_profile([0.001, 0.001], loader_s=[0.0005, 0.008], cores=32)
    r1 = base.rank(1)
    assert r1.loader is not None
    profile = replace(base, ranks=(base.rank(0), replace(r1, loader=LoaderProfile(sec_per_sample=0.008,
                                                                                  max_workers=2))))
    plan = planner.solve(profile, global_batch=256)
    rep = analyze(profile, plan, options_for(plan), dataset_size=10_000)
    slowest = max(row.equal_split_step_time_s for row in rep.ranks)
    assert plan.predicted.equal_split_step_time_s == pytest.approx(slowest + plan.predicted.comm_s)
