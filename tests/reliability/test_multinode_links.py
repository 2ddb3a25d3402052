"""The all-reduce's host groups and link model (planner.comm_model), and per-host worker budgets, in-process."""

from __future__ import annotations

from dataclasses import replace

import pytest

import planner
from planner.cli.cmd_plan import format_plan
from planner.comm_model import allreduce_links, host_groups, ring_allreduce_s
from planner.loader import worker_budgets
from planner.options import SolveOptions
from planner.profile import CommProfile, HostProfile
from tests.reliability.test_no_hangs import two_rank_profile


def three_ranks_two_hosts() -> planner.Profile:
    """Ranks 0 and 1 on host a (4 cores), rank 2 on host b (2 cores): nodes of 2 + 1 ranks."""
    base = two_rank_profile()
    r0, r1 = base.by_rank
    ranks = (replace(r0, host="a"), replace(r1, rank=1, host="a"), replace(r1, rank=2, host="b"))
    return planner.Profile(hosts=(HostProfile(name="a", cpu_cores=4), HostProfile(name="b", cpu_cores=2)),
                           ranks=ranks, model=base.model, comm=CommProfile(backend="gloo", allreduce_s=0.010),
                           meta={"allreduce_by_host_s": {"a": 0.003, "b": 0.0}})


def test_host_groups_links_and_budgets() -> None:
    assert host_groups(["a", "a", "b", "a"]) == [("a", [0, 1, 3]), ("b", [2])]
    # A ring spanning hosts runs at the slowest link's pace; within one host at the intra-host link's.
    assert ring_allreduce_s(100.0, [2, 2], 100.0, 10.0) == pytest.approx(2 * 3 / 4 * 100 / 10)
    assert ring_allreduce_s(100.0, [4], 100.0, 10.0) == pytest.approx(2 * 3 / 4 * 100 / 100)
    assert ring_allreduce_s(100.0, [1], 100.0, 10.0) == 0.0

    profile = three_ranks_two_hosts()
    links = allreduce_links(profile)
    assert links == {"host_groups": [{"host": "a", "ranks": [0, 1]}, {"host": "b", "ranks": [2]}],
                     "spans_hosts": True, "allreduce_s": 0.010, "intra_host_allreduce_s": {"a": 0.003, "b": 0.0},
                     "inter_host_s": pytest.approx(0.007)}
    one_host = planner.Profile(hosts=profile.hosts[:1], ranks=tuple(replace(r, host="a") for r in profile.ranks),
                               model=profile.model)
    assert allreduce_links(one_host) is None

    # Each host's loader workers come from its own cores less a reserve per rank of that host.
    assert worker_budgets(profile, SolveOptions(cpu_reserve_per_rank=1)) == {"a": 2, "b": 1}
    plan = planner.evaluate(profile, [5, 5, 2])
    assert plan.meta["allreduce"]["spans_hosts"] is True  # the plan carries its links (meta: not fingerprinted)
    for host, ranks in host_groups([r.host for r in plan.ranks]):
        assert sum(plan.ranks[i].num_workers for i in ranks) <= {"a": 2, "b": 1}[host]
    text = format_plan(plan, profile)
    assert text.splitlines()[0].split()[:2] == ["rank", "host"]
    assert "all-reduce spans 2 hosts: a [0,1], b [2]; 10.00 ms over the job, 7.00 ms of it for crossing hosts" in text
    assert planner.Plan.from_dict(plan.to_dict()).meta == plan.meta  # the JSON round trip keeps it
