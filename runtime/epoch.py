"""What one epoch end knows on every rank, and the rules that read it: a loader's fill and drain, unsteady epochs.

``runtime.run.PlannedRun`` gathers an ``EpochEnd`` at each epoch end (one collective), the Replanner judges it,
and the run log records it -- for `planner train`, the framework adapters and own loops alike, so the report and
the re-planner see the same numbers whichever loop ran.

A DataLoader pipeline has two edges no steady pace lives in.  When its iterator starts, each of ``W`` workers
builds up to ``prefetch`` batches at once, and the loop can take ``W * (prefetch + 1)`` batches faster than the
loader delivers them (the fill); at the end every batch is already handed out and the workers fall idle while the
loop runs on batches built before (the drain, ``W * prefetch`` steps).  ``StepTimer.epoch_summary`` leaves both out
of the steady middle it reports when the epoch is long enough to hold one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from planner.devstate import DeviceState
from planner.plan import Plan
from planner.stats import StepStats
from runtime.replan import ReplanDecision

DEFAULT_PREFETCH = 2
"""torch's DataLoader ``prefetch_factor`` when it has workers and none is given."""


def loader_drain_steps(workers: int, prefetch: int = DEFAULT_PREFETCH) -> int:
    """Steps after which a loader-bound rank no longer runs on batches its workers built ahead of time.

    At an epoch start (or whenever the loop paused) each of ``workers`` workers holds up to ``prefetch`` ready
    batches, and all of them are mid-build: ``workers * (prefetch + 1)`` batches the rank can take faster than its
    loader delivers them.  A timed window that opens before they are spent measures the buffer, not the loader:
    on 2x H200, a rank given 2 workers never waited for data in a 15-step window right after the epoch boundary,
    and the plan "ran" 21% faster than its loader allows."""
    return max(1, workers * (prefetch + 1))


def loader_fill_drain(workers: int, prefetch: int = DEFAULT_PREFETCH) -> tuple[int, int]:
    """(fill, drain): the steps at an epoch's start in which a loader of ``workers`` workers fills its pipeline
    (``loader_drain_steps``: every worker building its prefetch at once), and at its end in which it drains
    (``workers x prefetch``: every batch already handed out, the workers falling idle) -- what the step timer
    leaves out of an epoch's steady middle (runtime.timing, ``StepTimer.epoch_summary``).  (0, 0) without workers:
    a loop that loads its own batches has no pipeline to fill, so its first epoch is as steady as the others."""
    if workers <= 0:
        return 0, 0
    return loader_drain_steps(workers, prefetch), workers * prefetch


def unsteady_start(*, streamed: bool, fresh: bool, first: bool, fill: int, fill_steps: Sequence[int]) -> str | None:
    """Why an epoch's times cannot judge a re-plan (None when they can): it began a new loader stream and held no
    steady window after the fill (every rank's ``fill_steps`` 0: runtime.timing ``epoch_summary``).

    Streamed (one loader iterator across epochs), the epochs before a re-plan ran on a full pipeline and the one
    after it refills it: judged on it, the new plan (on trial) and the model would carry the refill.  The run's
    first epoch, when its loaders' fill took all of it, likewise: judged on it, the start plan's fill is compared
    with another split's steady pace (2x H100, 80-step epochs: epoch 0 ran 130 ms a step in the fill, a 10.7%
    gain was adopted on it, and the new split ran 119.7 ms where the start split ran 101 ms in the other
    launches).  A loop that starts a new iterator every epoch (``streamed`` False: own loops, the frameworks)
    refills every epoch, before and after a re-plan alike, so the comparison is fair and every epoch is judged.
    ``fill``: the epoch's fill steps (``loader_fill_drain``); ``first``: the run's first epoch (its start epoch
    when resumed)."""
    if not (streamed and fresh) or any(fill_steps):
        return None
    if not first:
        return "this epoch refilled the loaders after the re-plan"
    return "the loaders filled their pipelines through all of this first epoch, leaving no steady window" if fill > 0 else None


@dataclass(frozen=True, kw_only=True, slots=True)
class EpochEnd:
    """One epoch as every rank knows it after the epoch-end exchange (``PlannedRun.gather``): the same on every
    rank, and what the Replanner, the run log's epoch record and the printed lines are made from."""

    epoch: int
    plan: Plan
    """The plan this epoch ran (its batch sizes and predictions)."""
    batch_sizes: tuple[int, ...]
    stats: tuple[StepStats, ...]
    """Every rank's step statistics, in rank order."""
    step_time_s: float | None
    """The synchronous step: the slowest rank's step-to-step interval (None: no rank timed a step)."""
    samples_per_s: float | None
    """The global batch over ``step_time_s``."""
    loss: float | None
    """The sample-weighted mean loss over every rank's epoch (None: not given by every rank, or not finite)."""
    samples: int | None
    """Samples trained this epoch, all ranks (None: not known)."""
    wall_s: float | None
    """The slowest rank's wall time from the epoch's start to its end."""
    device_states: tuple[DeviceState | None, ...]
    """Every rank's device and host state sampled at the epoch end (None: that rank has no sampler)."""
    extras: tuple[Any, ...] = ()
    """Every rank's ``extra`` payload (JSON), in rank order: what a client exchanges with the epoch's stats."""
    unsteady: str | None = None
    """Why the epoch cannot judge a re-plan (``unsteady_start``), else None."""
    decision: ReplanDecision | None = None
    """The Replanner's decision at this epoch end (``PlannedRun.conclude``); None when none was made."""
    note: str | None = None
    """What happened instead of a decision, when re-planning is on ("not judged: ...")."""
