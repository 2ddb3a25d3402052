"""Applying a plan to DDP: sampler, exact gradient weighting, step timing, re-planning, reference trainer.

Cross-rank contract: every rank builds the same HeteroBatchSampler layout from (plan, dataset length, seed,
epoch), so each knows every rank's batch (and micro-batch) sizes at every step without communicating; all ranks
run the same number of optimizer steps; collectives happen in the same order on every rank (agreement check
first, then DDP's all-reduces -- one per optimizer step -- then the re-plan exchange at epoch ends).
"""

from __future__ import annotations

from runtime.accumulate import MicroStep, micro_steps
from runtime.compress import COMPRESSIONS
from runtime.replan import ReplanDecision, Replanner
from runtime.run import PlannedRun
from runtime.safety import check_agreement, check_batchnorm
from runtime.sampler import HeteroBatchSampler, HeteroDistributedSampler
from runtime.timing import StepTimer
from runtime.weighting import StepWeights, accumulation_weight, loss_scale, register_weighted_hook, step_weights

DDP_PLANNER_PACKAGE = "runtime"
"""Marks this package as ddp-planner's: planner.shadow.require_runtime tells it from a user's own ``runtime``."""

__all__ = [
    "COMPRESSIONS",
    "HeteroBatchSampler",
    "HeteroDistributedSampler",
    "MicroStep",
    "PlannedRun",
    "ReplanDecision",
    "Replanner",
    "StepTimer",
    "StepWeights",
    "accumulation_weight",
    "check_agreement",
    "check_batchnorm",
    "loss_scale",
    "micro_steps",
    "register_weighted_hook",
    "step_weights",
]
