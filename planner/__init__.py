"""ddp-planner core: profile and plan types, curve fitting and the MILP that splits a global batch.

This package imports numpy and scipy only (no torch): plans can be made and checked anywhere.

    >>> import planner
    >>> profile = planner.Profile.load("profile.json")          # doctest: +SKIP
    >>> plan = planner.solve(profile, global_batch=512)          # doctest: +SKIP
    >>> plan.batch_sizes                                         # doctest: +SKIP
    (400, 112)
"""

from __future__ import annotations

from planner.curves import Envelope, fit_envelope, fit_memory, memory_cap
from planner.errors import PlanError, ValidationError
from planner.options import SolveOptions
from planner.plan import Plan, Predicted, RankPlan
from planner.profile import (
    CommProfile,
    ComputePoint,
    HostProfile,
    LoaderPoint,
    LoaderProfile,
    MemoryPoint,
    MemoryProfile,
    ModelInfo,
    Profile,
    RankProfile,
)
from planner.solve import calibrate_overhead, equal_split, evaluate, solve
from planner.stats import StepStats

__version__ = "0.3.0.dev0"

__all__ = [
    "CommProfile",
    "ComputePoint",
    "Envelope",
    "HostProfile",
    "LoaderPoint",
    "LoaderProfile",
    "MemoryPoint",
    "MemoryProfile",
    "ModelInfo",
    "Plan",
    "PlanError",
    "Predicted",
    "Profile",
    "RankPlan",
    "RankProfile",
    "SolveOptions",
    "StepStats",
    "ValidationError",
    "calibrate_overhead",
    "equal_split",
    "evaluate",
    "fit_envelope",
    "fit_memory",
    "memory_cap",
    "solve",
]
