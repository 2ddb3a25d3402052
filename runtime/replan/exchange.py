"""The re-plan exchange at an epoch end (``Replanner.step``): every rank leaves with the same decision.

    1. all_gather_json   every rank's StepStats.to_dict() and the fingerprint of the plan it ran
    2. decide_on_rank0   rank 0 checks the fingerprints agree, runs ``Replanner.decide`` and sends the decision
                         and its state dict; ranks that ran different plans are a launch mistake, raised on every
                         rank (no rank is left waiting)
    3. every other rank loads rank 0's state and rebuilds the decision from it (nothing is decided twice, so
       the ranks cannot drift apart through the solver's own nondeterminism)
    4. all_gather_json   every rank's fingerprint of the plan it will run

A re-plan never ends the training.  ``decide`` itself never raises (a failure inside keeps the plan, with a
warning); when step 3 fails on some rank (a corrupt payload, a version skew) or step 4 finds the ranks disagree,
every rank restores the state it had before step 2 and returns the same kept decision, built from what every rank
holds alike (the gathered stats, the plan they all ran, the gathered errors), its warning naming the rank and the
error.  The ranks agreed on the plan before deciding (step 2's check), so they agree on it after.

Everything crosses as JSON (runtime/collectives.py says why not pickle).  Four collectives per epoch, in the
same order on every rank; without a process group ``decide`` runs locally.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from planner.errors import ValidationError
from planner.stats import StepStats
from runtime.collectives import all_gather_json, decide_on_rank0, is_distributed
from runtime.replan.decision import ReplanDecision

if TYPE_CHECKING:  # the Replanner imports this module to run its step
    from runtime.replan.replanner import Replanner


def exchange_decision(replanner: Replanner, local_stats: StepStats, epoch: int, group: Any = None) -> ReplanDecision:
    """All-gather every rank's stats, decide on rank 0, broadcast; every rank returns the same decision."""
    if not is_distributed(group):
        return replanner.decide([local_stats], epoch)
    rank = dist.get_rank(group)
    gathered = all_gather_json({"stats": local_stats.to_dict(), "plan_fingerprint": replanner.plan.fingerprint},
                               group)
    # StepStats(**...) rather than from_dict: a NaN measurement must reach decide(), which refuses it with the
    # rank's name and keeps the run going; from_dict would raise and stop every rank.
    stats = [StepStats(**g["stats"]) for g in gathered]
    before = replanner._snapshot()
    own: ReplanDecision | None = None

    def decide() -> dict[str, Any]:
        nonlocal own
        fps = [g["plan_fingerprint"] for g in gathered]
        if len(set(fps)) != 1:
            raise ValidationError(f"ranks run different plans (fingerprints {fps}): re-planning refused")
        own = replanner.decide(stats, epoch)
        try:
            return {"decision": own.to_wire(), "state": replanner.state_dict()}
        except Exception as e:  # cannot be sent: keep the plan here too, and send that
            replanner._restore(before)
            own = replanner.failed(stats, epoch, f"rank 0 could not send its decision: {type(e).__name__}: {e}")
            return {"decision": own.to_wire(), "state": replanner.state_dict()}

    old = replanner.plan
    payload = decide_on_rank0(decide, group)

    try:
        if own is None:  # not rank 0: follow its decision and take on its model, so the next epoch starts equal
            replanner.load_state_dict(payload["state"])
            own = ReplanDecision.from_wire(payload["decision"], old)
        check = own.plan.fingerprint
    except Exception as e:  # reported through the gather below so that every rank keeps the plan together
        check = f"error on rank {rank}: {type(e).__name__}: {e}"
    checks = all_gather_json(check, group)
    if len(set(checks)) != 1:
        # Every rank the same: back to the state before this epoch's decision, the plan every rank ran kept.
        replanner._restore(before)
        errors = [c for c in checks if c.startswith("error on rank")]
        why = "; ".join(errors) if errors else f"ranks disagree on the plan after re-planning: fingerprints {checks}"
        return replanner.failed(stats, epoch, f"RuntimeError: {why}")
    assert own is not None  # the checks agree, so this rank has a fingerprint, not an error
    return own
