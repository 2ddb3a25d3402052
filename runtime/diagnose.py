"""Why a rank is slow, said live: at each epoch end, every rank measured slower than the plan in force predicted for
it beyond the epoch's noise, with one named cause chosen from what was measured.

Runs once per epoch on what the epoch end already gathered (every rank's StepStats and device state, the plan's
per-rank prediction): no per-step work, no extra exchange.  ``PlannedRun`` prints its one line on rank 0
(``quiet=True`` silences it) and writes the same list in the epoch record's ``diagnosis``.

Slow.  A rank's measured own time per step (``StepStats.busy_s``: compute plus data wait, the whole step where the
loader paced it) against its prediction (``RankPlan.timer_busy_s``), error = measured / predicted - 1, is slow when
the error exceeds ``max(MIN_SLOW_FRAC, 3 standard errors of the mean step)`` -- the standard error from the epoch's
own per-step spread (the robust compute sigma, or the step time's std where the loader paced the rank) over the
steps averaged -- and, with peers, when its error against the rank nearest its prediction ((1 + error) / (1 + least
error) - 1: a box-wide slowdown moves every rank alike and names no one) exceeds that tolerance and 3 standard
deviations of that relative error over the rank's last epochs on plan (``drift_frac``: the drift from epoch to
epoch, which on a shared host, other jobs loading its cores by the epoch, the steps' spread does not show; alone,
the drift of its own error).

Cause, first that holds:

  1. a device-state fact a reference lacks (planner.evidence.compare, the rules ``planner report`` uses; the
     references, in turn: the rank nearest its prediction this epoch, then this rank's own state at the last epoch
     it ran on plan -- load that roams over the host's cores can load both ranks' cores over an epoch yet slow only
     one; with neither every fact counts): host memory nearly full -> ``memory``; other processes on its GPU, MIG, MPS ->
     ``gpu-cotenant``; throttle reasons, low SM/memory clock, a lower power limit, heat -> ``clocks``; other
     processes' CPU on its cores, steal, overlapping or fewer cores, host load -> ``cpu-cotenant``; PCIe, NUMA, an
     emulated slowdown -> ``device-other``;
  2. ``loader``: the loader paced the rank (data wait above ``LOADER_WAIT_FRAC`` of its step) and the wait is at
     least half of the excess over the prediction;
  3. ``late-peer``: its time lost to late peers (``interference_s``) is at least half of the excess, or another
     slow rank waited least -- the least-wait rule: in a synchronous step the rank that reaches the all-reduce last
     waits least (``step_time_s - busy_s``) while the others wait for it, so of several slow ranks the one waiting
     least is the culprit and a rank that waited on it by more than its own excess is its victim;
  4. ``inside-step``: its compute is slower and no counter explains it (``planner.evidence.INSIDE_STEP``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from planner.devstate import DeviceState
from planner.evidence import INSIDE_STEP, Evidence, checked, compare
from planner.runlog import EpochRecord
from planner.stats import LOADER_WAIT_FRAC, Diagnosis, StepStats

MIN_SLOW_FRAC = 0.05
"""A rank more than 5% over its prediction (and over the epoch's noise) is slow: below the 10-20% a co-tenant or a
starved loader costs, above what a plan corrected by the run's own epochs misses by on a quiet machine."""
NOISE_SE = 3.0
"""Standard errors of the epoch's mean step that an excess must also beat."""
MIN_STEPS = 3
"""Ranks that averaged fewer steps are not judged (no spread to judge them by)."""
DRIFT_EPOCHS = 8
"""The rank's errors at its last this many epochs on plan measure how far its error drifts from epoch to epoch."""

_KIND_CAUSE = (
    ("memory", ("host-memory",)),
    ("gpu-cotenant", ("co-tenant", "mig", "mps")),
    ("clocks", ("throttle", "sm-clock", "mem-clock", "power-limit", "thermal")),
    ("cpu-cotenant", ("cpu-load", "steal", "cpu-overlap", "few-cores", "host-load")),
    ("device-other", ("pcie", "numa", "emulated")),
)
"""Evidence kinds (planner.evidence.Evidence.kind) by the cause they name, the first group that explains wins."""


def noise_frac(st: StepStats, predicted_s: float) -> float:
    """``NOISE_SE`` standard errors of the rank's mean step, as a fraction of its prediction."""
    sigma = (st.step_time_s_std or 0.0) if st.loader_paced else st.compute_s_sigma
    if st.num_steps <= 0 or predicted_s <= 0 or not math.isfinite(sigma):
        return math.inf
    return NOISE_SE * sigma / math.sqrt(st.num_steps) / predicted_s


def drift_frac(errors: Sequence[float]) -> float:
    """``NOISE_SE`` standard deviations of a rank's error over its last ``DRIFT_EPOCHS`` epochs on plan (0 with
    fewer than 2): the epoch-to-epoch noise a step's own spread does not show (other jobs on a shared host load its
    cores by the epoch, not by the step)."""
    xs = [e for e in errors[-DRIFT_EPOCHS:] if math.isfinite(e)]
    if len(xs) < 2:
        return 0.0
    mean = sum(xs) / len(xs)
    return NOISE_SE * math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


def relative_errors(judged: Mapping[int, tuple[StepStats, float, float]]) -> dict[int, float]:
    """Each rank's error against the rank nearest its prediction: (1 + error) / (1 + least error) - 1."""
    least = min(e for _, _, e in judged.values())
    return {r: (1 + e) / (1 + least) - 1 for r, (_, _, e) in judged.items()}


def _judged(stats: Sequence[StepStats], predicted_s: Sequence[float]) -> dict[int, tuple[StepStats, float, float]]:
    out = {}
    for st in stats:
        pred = predicted_s[st.rank] if st.rank < len(predicted_s) else math.nan
        if st.num_steps >= MIN_STEPS and math.isfinite(pred) and pred > 0 and st.busy_s > 0:
            out[st.rank] = (st, pred, st.busy_s / pred - 1)
    return out


def errors_of(stats: Sequence[StepStats], predicted_s: Sequence[float]) -> dict[int, float]:
    """The error ``diagnose``'s drift is taken over, per rank: against the rank nearest its prediction when there
    are peers (a box-wide shift moves every rank alike and is no drift), measured / predicted - 1 alone."""
    judged = _judged(stats, predicted_s)
    return relative_errors(judged) if len(judged) > 1 else {r: e for r, (_, _, e) in judged.items()}


def _wait(st: StepStats) -> float:
    """Seconds per step the rank spent beyond its own time: waiting for peers in the synchronous step."""
    return max(0.0, st.step_time_s - st.busy_s)


def _state_cause(ev: list[Evidence]) -> str | None:
    kinds = {e.kind for e in ev if e.explains}
    return next((cause for cause, group in _KIND_CAUSE if kinds & set(group)), None)


def diagnose(stats: Sequence[StepStats], predicted_s: Sequence[float],
             states: Sequence[DeviceState | None] = (),
             on_plan_states: Sequence[DeviceState | None] = (),
             on_plan_errors: Mapping[int, Sequence[float]] | None = None) -> tuple[Diagnosis, ...]:
    """The epoch's slow ranks with their causes (module docstring); () when every rank ran on plan.

    ``stats``: every rank's StepStats; ``predicted_s``: the plan's per-rank prediction, by rank;
    ``states``: every rank's epoch-end device state, by rank (None: not sampled); ``on_plan_states``: each rank's
    state at the last epoch it ran on plan (the reference of a rank without peers); ``on_plan_errors``: each rank's
    ``errors_of`` at its epochs on plan after the run's first, oldest first (``drift_frac``; the first compares with
    the profile, whose age the Replanner then corrects)."""
    judged = _judged(stats, predicted_s)
    if not judged:
        return ()
    ref = min(judged, key=lambda r: judged[r][2])
    gaps = relative_errors(judged) if len(judged) > 1 else {r: e for r, (_, _, e) in judged.items()}
    slow = {}
    for rank, (st, pred, err) in judged.items():
        tol = max(MIN_SLOW_FRAC, noise_frac(st, pred))
        if err > tol and gaps[rank] > max(tol, drift_frac((on_plan_errors or {}).get(rank, ()))):
            slow[rank] = (st, pred, err)
    if not slow:
        return ()
    culprit = min(slow, key=lambda r: _wait(slow[r][0]))

    def state(seq: Sequence[DeviceState | None], rank: int) -> DeviceState | None:
        return seq[rank] if rank < len(seq) else None

    out = []
    for rank, (st, pred, _err) in sorted(slow.items()):
        excess = st.busy_s - pred
        s = state(states, rank)
        refs = [(state(states, ref), f"rank {ref}")] if ref != rank and state(states, ref) is not None else []
        if state(on_plan_states, rank) is not None or not refs:
            refs.append((state(on_plan_states, rank), "its last epoch on plan"))
        ev: list[Evidence] = []
        cause = None
        for ref_state, ref_name in refs:  # the peer first; then the rank itself while it ran on plan
            if s is None or s.is_empty:
                break
            found_ev = compare(s, ref_state, ref_name=ref_name, is_cpu=True)
            cause = _state_cause(found_ev)
            if cause is not None or not ev:
                ev = found_ev
            if cause is not None:
                break
        facts = [e.text for e in ev if e.explains]
        context = [e.text for e in ev if not e.explains] + (checked(s, {e.kind for e in ev}) if s else [])
        wait_ms = f"data wait {1000 * st.data_wait_s:.1f} ms of a {1000 * st.step_time_s:.1f} ms step"
        if cause is None and st.data_wait_s > LOADER_WAIT_FRAC * st.step_time_s and st.data_wait_s >= 0.5 * excess:
            cause, facts = "loader", [f"its loader paced it: {wait_ms}"]
        elif cause is None and (st.interference_s >= 0.5 * excess or (
                rank != culprit and _wait(st) - _wait(slow[culprit][0]) > excess)):
            late = culprit if culprit != rank else None
            who = f"rank {late} reached the all-reduce last (waited least)" if late is not None else "a late peer"
            cause, facts = "late-peer", [f"{who}; {1000 * st.interference_s:.1f} ms a step lost to late peers "
                                         f"over {st.num_peer_late} steps"]
        elif cause is None:
            cause = "inside-step"
            facts = [f"{INSIDE_STEP}: compute {1000 * st.compute_s:.1f} ms a step, {wait_ms}"]
        out.append(Diagnosis(rank=rank, cause=cause, measured_s=st.busy_s, predicted_s=pred,
                             evidence="; ".join(facts + context)))
    return tuple(out)


def line(epoch: int, found: Sequence[Diagnosis]) -> str:
    """The one line rank 0 prints for an epoch's slow ranks."""
    parts = [f"rank {d.rank} {1000 * d.measured_s:.1f} ms a step vs {1000 * d.predicted_s:.1f} ms predicted "
             f"({100 * d.error:+.0f}%): {d.cause} -- {d.evidence}" for d in found]
    return f"epoch {epoch}: slow " + " | ".join(parts)


def normalized_scores(record: EpochRecord) -> tuple[float | None, ...]:
    """Per rank, predicted / measured own time per step (1.0 = on plan, 0.5 = twice the planned time), by rank:
    a score normalized by the work the plan gave each rank, so an uneven planned split scores every rank ~1.0 where
    a raw step-time comparison would call the small-batch rank fast and the large-batch one slow.  None for a rank
    without a prediction or a measured step.  The score a straggler detector thresholds (docs/ADOPTING.md)."""
    out: list[float | None] = []
    by_rank = {st.rank: st for st in record.ranks}
    for rank, pred in enumerate(record.predicted_step_time_s):
        st = by_rank.get(rank)
        ok = st is not None and st.num_steps > 0 and st.busy_s > 0 and math.isfinite(pred) and pred > 0
        out.append(pred / st.busy_s if ok and st is not None else None)
    return tuple(out)
