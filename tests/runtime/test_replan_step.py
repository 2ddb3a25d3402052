"""Replanner.step across ranks: JSON only (no pickle), errors reach every rank, disagreement raises everywhere."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import planner
from planner.errors import ValidationError
from runtime.replan import Replanner
from tests.runtime.test_replan import _profile, _stats


class _FailingLoad(Replanner):
    """A rank that cannot take on rank 0's state (what a corrupt payload or a version skew would do)."""

    def load_state_dict(self, state: Any) -> None:
        raise RuntimeError("cannot load")


def _no_pickle(*_: Any, **__: Any) -> None:
    raise AssertionError("a pickle-based object collective was used")


def _crash(*_: Any, **__: Any) -> planner.Plan:
    raise RuntimeError("solver crashed")


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same state, the plan compared by fingerprint (each rank solved its own first plan: the solver's timing
    in ``plan.solver`` differs between them)."""
    rest = lambda s: {k: v for k, v in s.items() if k != "plan"}  # noqa: E731
    return rest(a) == rest(b) and a["plan"]["fingerprint"] == b["plan"]["fingerprint"]


def _worker(rank: int, world_size: int, out_dir: str) -> None:
    # Peers' data is never unpickled: the object collectives are not even reachable.
    dist.all_gather_object = _no_pickle
    dist.broadcast_object_list = _no_pickle
    profile = _profile()
    plan = planner.solve(profile, global_batch=512)

    # 1. A real slowdown: the same decision everywhere, through the JSON exchange.
    rp = Replanner(profile, plan)
    d = rp.step(_stats(profile, plan, 0, slow=(1.0, 3.0))[rank], 0)
    assert d.adopted and rp.plan.fingerprint == d.plan.fingerprint
    record = {"log": d.to_log(), "scale": list(rp.scale_factors), "state": rp.state_dict()}

    # 2. Ranks that run different plans: refused on rank 0, the same ValidationError on every rank.
    mine = plan if rank == 0 else planner.evaluate(profile, [300, 212])
    with pytest.raises(ValidationError, match="ranks run different plans"):
        Replanner(profile, mine).step(_stats(profile, mine, 0)[rank], 0)

    # 3. The solver crashing on rank 0: every rank keeps the plan, with the same warning, and trains on.
    rp = Replanner(profile, plan, solve_fn=_crash if rank == 0 else planner.solve)
    before = rp.state_dict()
    d = rp.step(_stats(profile, plan, 0, slow=(1.0, 3.0))[rank], 0)
    assert not d.adopted and d.plan.fingerprint == plan.fingerprint
    assert d.warning == "re-plan failed, keeping the plan: RuntimeError: solver crashed"
    assert _same_state(rp.state_dict(), before)  # as before the failed decision, on every rank
    record["crash"] = {"warning": d.warning, "line": d.line()}

    # 4. A rank that cannot follow rank 0's decision: every rank keeps the plan it ran, the same decision
    # everywhere, the state as before it.
    rp = (_FailingLoad if rank == 1 else Replanner)(profile, plan)
    before = rp.state_dict()
    d = rp.step(_stats(profile, plan, 0, slow=(1.0, 3.0))[rank], 0)
    assert not d.adopted and d.plan.fingerprint == plan.fingerprint and rp.plan.fingerprint == plan.fingerprint
    assert d.warning is not None and "error on rank 1: RuntimeError: cannot load" in d.warning
    assert _same_state(rp.state_dict(), before)
    record["load"] = {"log": d.to_log(), "warning": d.warning}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))


@pytest.mark.distributed
def test_step_exchanges_json_and_fails_on_every_rank_together(tmp_path: Path) -> None:
    from tests._dist import run_distributed

    run_distributed(_worker, 2, str(tmp_path), timeout_s=90.0)
    r0, r1 = (json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2))
    assert r0 == r1  # same log, same model, same policy state on both ranks


def test_step_without_a_process_group_is_decide() -> None:
    profile = _profile()
    one = planner.Profile(hosts=profile.hosts, ranks=(profile.rank(0),))
    plan = planner.solve(one, global_batch=64)
    a, b = Replanner(one, plan), Replanner(one, plan)
    stats = planner.StepStats(rank=0, epoch=0, num_steps=50, batch_size=64, num_workers=plan.ranks[0].num_workers,
                              data_wait_s=0.0, compute_s=0.02, step_time_s=0.021, compute_s_std=0.001)
    la, lb = a.step(stats, 0).to_log(), b.decide([stats], 0).to_log()
    # The measured step differs from the profile's, so the re-solve sizes the loader workers to it (their spare
    # share follows the step); the batch stays, with no gain to adopt.
    assert la == lb and not la["adopted"] and "[64] -> [64], loader workers" in la["reason"]
