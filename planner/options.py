"""SolveOptions: the one carrier of the solver's settings, from the CLI to the plan and back.

Everything that solves or evaluates (``planner.solve``, ``planner.evaluate``, the Replanner, the report's
what-ifs, the trainer) takes a ``SolveOptions``; a plan records the options it was solved with in
``plan.solver["options"]``, and ``Plan.options`` reads them back, so a re-plan or a report re-solves under the
same settings as the plan it starts from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from planner.errors import ValidationError

Mode = Literal["ddp", "fsdp"]
MODES: tuple[str, ...] = ("ddp", "fsdp")
DEFAULT_MAX_ACCUMULATION_STEPS = 64
"""Most micro-steps per optimizer step the planner hands one rank. Beyond ~64 a rank spends most of its step on
per-micro-step overhead the curves do not see (launches, the loader's per-batch work): a global batch that needs
more is better served by more devices or a smaller global batch, which the error then says."""

BATCHNORM_MIN_BATCH = 2
"""Smallest local batch (and micro-batch) for a model with BatchNorm: in training mode it normalizes each channel over
the batch, and one sample has no variance (torch raises "Expected more than 1 value per channel").  The sweep, the
plan and the auto modes all take at least this many samples a rank for such a model."""

DEFAULT_MIN_GAIN = 0.05
"""Predicted gain below which solve() keeps the equal split: predictions carry a few percent of error (measured in
docs/PERFORMANCE.md), and on flat, launch-bound curves a gain of 2% can mean a lopsided split such as [1022, 2] that
ran 16% slower than equal on 2x H200 (ResNet-18, 32x32). The same 5% the Replanner asks before it changes a plan."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SolveOptions:
    """Settings of the program (docs/DESIGN.md, Solver model); every field has the CLI flag of the same name."""

    min_batch: int = 1
    """Smallest local batch any rank may get (2 or more for BatchNorm models)."""
    max_batch_per_rank: int | None = None
    """User cap on every rank's batch per optimizer step (all its micro-batches together), on top of the memory
    caps: no accumulation gets a rank past it."""
    max_micro_batch: int | None = None
    """User cap on what one forward+backward holds on every rank, on top of the memory caps the profile measured:
    a memory cap you state (a CPU profile measures none).  A rank whose share is larger runs gradient accumulation."""
    memory_headroom: float = 0.10
    """Fraction of device memory kept free when deriving the memory cap from the fit."""
    cpu_reserve_per_rank: int = 1
    """Cores per rank kept for the training process itself (not given to loader workers)."""
    max_workers_per_rank: int | None = None
    """Upper bound on loader workers per rank.  None (the default): no bound of its own -- the host's worker budget
    (its cores less ``cpu_reserve_per_rank`` per rank, shared by the host's ranks) is the limit, and the profile's
    scaling curve is measured up to the host's cores, so a loader-bound rank may take the cores its neighbours'
    loaders do not need.  A fixed cap of 16 (torchvision's reference ImageNet recipe) is too low: on 2x H100
    with 32 cores, 16 left rank 0 loader-bound with 12 cores idle ("rank 0 needs 22 workers, has 16; the host can
    give 30"); uncapped, the plans put it at its GPU's pace (docs/PERFORMANCE.md)."""
    time_limit_s: float = 20.0
    """HiGHS time limit per MILP call."""
    min_gain: float = DEFAULT_MIN_GAIN
    """Keep the equal split unless the optimum is predicted this much faster (0.05 = 5%); 0 = always the optimum."""
    mode: Mode = "ddp"
    """How ranks accumulate gradients: "ddp" lets every rank run its own number of micro-steps per optimizer step
    (no_sync on all but the last); "fsdp" runs the same number K on every rank (each forward all-gathers)."""
    max_accumulation_steps: int = DEFAULT_MAX_ACCUMULATION_STEPS
    """Most micro-steps (gradient accumulation) per optimizer step on one rank; 1 = never accumulate, so the sum
    of the memory caps bounds the global batch."""
    batch_multiple: int = 1
    """Every rank's batch and every micro-batch a multiple of this (planner/_multiple.py): a model compiled with
    static shapes or captured in CUDA graphs then runs few shapes.  The global batch must be a multiple of it."""

    def worker_cap(self, host_budget: int, rank_max: int | None = None) -> int:
        """Most loader workers one rank may get: the least of --max-workers-per-rank, the rank's own cap
        (``rank_max``, the profile's loader.max_workers) and its host's worker budget; at least 1."""
        caps = [c for c in (self.max_workers_per_rank, rank_max) if c is not None]
        return max(1, min([host_budget, *caps]))

    def __post_init__(self) -> None:
        for name in ("min_batch", "cpu_reserve_per_rank", "max_accumulation_steps", "batch_multiple"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValidationError(f"{name} must be an integer, got {v!r}")
        if self.min_batch < 1:
            raise ValidationError(f"min_batch must be >= 1, got {self.min_batch}")
        if self.max_batch_per_rank is not None and (
                isinstance(self.max_batch_per_rank, bool) or not isinstance(self.max_batch_per_rank, int)
                or self.max_batch_per_rank < 1):
            raise ValidationError(f"max_batch_per_rank must be an integer >= 1, got {self.max_batch_per_rank!r}")
        if self.max_micro_batch is not None and (
                isinstance(self.max_micro_batch, bool) or not isinstance(self.max_micro_batch, int)
                or self.max_micro_batch < 1):
            raise ValidationError(f"max_micro_batch must be an integer >= 1, got {self.max_micro_batch!r}")
        if not 0.0 <= self.memory_headroom < 1.0:
            raise ValidationError(f"memory_headroom must be in [0, 1), got {self.memory_headroom}")
        if self.cpu_reserve_per_rank < 0:
            raise ValidationError(f"cpu_reserve_per_rank must be >= 0, got {self.cpu_reserve_per_rank}")
        if self.max_workers_per_rank is not None and (
                isinstance(self.max_workers_per_rank, bool) or not isinstance(self.max_workers_per_rank, int)
                or self.max_workers_per_rank < 1):
            raise ValidationError(f"max_workers_per_rank must be an integer >= 1, got {self.max_workers_per_rank!r}")
        if not self.time_limit_s > 0:
            raise ValidationError(f"time_limit_s must be > 0, got {self.time_limit_s}")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValidationError(f"min_gain must be in [0, 1), got {self.min_gain}")
        if self.mode not in MODES:
            raise ValidationError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.max_accumulation_steps < 1:
            raise ValidationError(f"max_accumulation_steps must be >= 1, got {self.max_accumulation_steps}")
        if self.batch_multiple < 1:
            raise ValidationError(f"batch_multiple must be >= 1 (1: any batch), got {self.batch_multiple}")

    def to_dict(self) -> dict[str, Any]:
        """JSON form, as stored in ``plan.solver["options"]``."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, path: str = "options") -> SolveOptions:
        """Read ``to_dict``'s form back; keys this version does not know (a newer writer's) are ignored."""
        if not isinstance(data, Mapping):
            raise ValidationError(f"{path}: expected an object of solve options, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except (TypeError, ValidationError) as e:
            raise ValidationError(f"{path}: {e}") from None

    def with_overrides(self, overrides: Mapping[str, Any]) -> SolveOptions:
        """A copy with the named fields changed; an unknown name is a ValidationError listing the known ones."""
        known = {f.name for f in fields(self)}
        bad = sorted(set(overrides) - known)
        if bad:
            raise ValidationError(f"unknown solve option(s) {', '.join(bad)}; known: {', '.join(sorted(known))}")
        return replace(self, **overrides) if overrides else self


def resolve_options(options: SolveOptions | None, overrides: Mapping[str, Any]) -> SolveOptions:
    """``options`` (default ``SolveOptions()``) with keyword overrides applied: the keyword form of the API
    (``solve(profile, global_batch=512, min_batch=2)``) and the carrier form (``options=SolveOptions(...)``) meet
    here, and may be combined (the keywords win)."""
    return (options if options is not None else SolveOptions()).with_overrides(overrides)
