"""Re-planning at epoch boundaries: update the per-rank model from what the ranks measured, re-solve, adopt.

Three parts, one module each:

    model.py      the correction model (pure): per-rank EMA scale factors, the two-point shape correction,
                  loader costs raised when the loader fell behind, and the corrected ``planner.Profile``
    policy.py     the adoption policy (pure, numbers only): threshold, noise, confirm-below, revert of a plan
                  that measured slower, the bar on moves toward reverted batches
    exchange.py   the collective step: all-gather stats, rank 0 decides, broadcast, every rank checks the
                  fingerprint (JSON over tensors, never pickle)

``replanner.py`` joins them (``Replanner.decide`` per epoch, ``Replanner.step`` across ranks, the checkpoint
state); ``decision.py`` holds ``ReplanDecision`` and its log record.  Each module's docstring gives its formulas.

    rp = Replanner(profile, plan)                       # smoothing=DEFAULT_SMOOTHING (0.8; why: model.py)
    decision = rp.step(local_stats, epoch)              # same decision on every rank
    sampler.set_batch_sizes(decision.batch_sizes, decision.plan.accumulation_steps)  # before the next epoch
"""

from __future__ import annotations

from runtime.replan.decision import ReplanDecision
from runtime.replan.model import DEFAULT_SMOOTHING
from runtime.replan.replanner import Replanner

__all__ = ["DEFAULT_SMOOTHING", "ReplanDecision", "Replanner"]
