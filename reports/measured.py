"""What a run log measured against what the plan predicted: the report's reality check.

Four things a report must not get wrong when the user hands it a run log:

  * the epoch size -- the log's start record holds the dataset size (older logs: steps per epoch x global batch),
    so epoch times are not computed for a 50,000-sample default the run never had;
  * a miss -- a plan whose measured step is more than 15% off its prediction is a finding, with the likely
    cause read from the same log: a noisy profile, one rank slower or faster than its curve (its compute, or its
    wait for data), or every rank on time and the difference in synchronization;
  * a slow rank inside the tolerance -- a rank more than 5% over its prediction in the per-rank table's epoch
    (the per-rank target) gets a line with its likely cause too, among them a compute that is on its curve
    in most steps but averages more through a tail of long steps (found only with DataLoaders and DDP peers
    together, ``compute_tail_cause``);
  * measured equal split vs plan -- when the log holds epochs of both (a run that started equal and re-planned,
    or two runs appended to one log), their measured ratio, beside the predicted one, taken only over epochs at
    the same rank speeds (reports.as_measured.speed_eras): a slowdown between them is not the split's doing.

Steady state: the first epoch of a split warms up (allocator, workers, autotuning), so a split measured over
several epochs is judged on the others (median).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from planner.plan import Plan, synchronous_step_s
from planner.profile import Profile
from planner.quality import ProfileQuality, QualityIssue
from planner.runlog import EpochRecord, RunLog
from planner.stats import WORKERS_KEPT_UP
from reports.as_measured import speed_change, speed_eras

PREDICTION_TOL = 0.15
"""A measured step this far (relative) from the prediction is a finding."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredSplit:
    batch_sizes: tuple[int, ...]
    epochs: tuple[int, ...]
    """The epochs it is measured over (warm-up epoch left out when there are others)."""
    step_time_s: float
    """Median measured synchronous step."""
    predicted_step_time_s: float
    """Median predicted step (slowest rank's busy time + the plan's exposed communication)."""
    samples_per_s: float

    @property
    def error(self) -> float:
        return self.step_time_s / self.predicted_step_time_s - 1.0


def epoch_size(log: RunLog) -> tuple[int, str] | None:
    """(samples per epoch, where it came from) from the log, or None when it cannot tell: the start record's
    dataset size; else the most samples an epoch trained (the epoch records' ``samples``, every step counted);
    else the timed steps x the global batch, which leaves each epoch's warm-up steps out (4,096 samples in 64 steps
    read 3,968), and says so."""
    if log.dataset_size:
        return log.dataset_size, "the run log's dataset size"
    trained = [e.samples for e in log.epochs if e.samples]
    if trained:
        return max(trained), "the samples the run log's epochs trained"
    for e in log.epochs:
        steps = max((s.num_steps for s in e.ranks), default=0)
        if steps > 0 and e.batch_sizes:
            return (steps * sum(e.batch_sizes),
                    "the run log's timed steps x global batch, warm-up steps left out: pass --dataset-size")
    return None


def _is_equal(batches: Sequence[int]) -> bool:
    return bool(batches) and max(batches) - min(batches) <= 1


def measured_splits(log: RunLog, comm_s: float, epochs: Sequence[EpochRecord] | None = None) -> list[MeasuredSplit]:
    """Every split the log ran (or ran in ``epochs``), in first-seen order, measured over its steady-state epochs
    (never those wholly in the loaders' drain, ``EpochRecord.drained``)."""
    groups: dict[tuple[int, ...], list[EpochRecord]] = {}
    for e in log.epochs if epochs is None else epochs:
        if e.step_time_s and e.step_time_s > 0 and e.predicted_step_time_s and not e.drained:
            groups.setdefault(tuple(e.batch_sizes), []).append(e)
    return [_measured(batches, epochs[1:] if len(epochs) > 1 else epochs, comm_s) for batches, epochs in groups.items()]


def _measured(batches: tuple[int, ...], epochs: Sequence[EpochRecord], comm_s: float) -> MeasuredSplit:
    """The split ``batches`` measured over ``epochs`` (medians; the predicted step is the plan's own formula,
    ``planner.plan.synchronous_step_s``, over the per-rank predictions the log holds: the plan's exposed
    communication ``comm_s`` on top of the slowest rank's)."""
    step = float(statistics.median(e.step_time_s or 0.0 for e in epochs))
    pred = float(statistics.median(synchronous_step_s(e.predicted_step_time_s, comm_s) for e in epochs))
    return MeasuredSplit(batch_sizes=batches, epochs=tuple(e.epoch for e in epochs), step_time_s=step,
                         predicted_step_time_s=pred, samples_per_s=sum(batches) / step)


def _split_epochs(log: RunLog, split: MeasuredSplit) -> list[EpochRecord]:
    """The log's epochs ``split`` is measured over."""
    return [e for e in log.epochs if e.epoch in split.epochs and tuple(e.batch_sizes) == split.batch_sizes]


def _rank_ratios(log: RunLog, split: MeasuredSplit) -> list[tuple[int, float, float, float, float | None]]:
    """(rank, measured busy, predicted busy, measured data wait, loader period or None) per rank, medians over
    the split's epochs (the loader period where its workers timed their batches in every one of them)."""
    epochs = _split_epochs(log, split)
    if not epochs or not all(len(e.ranks) == len(e.predicted_step_time_s) for e in epochs):
        return []
    out = []
    for i in range(len(epochs[0].ranks)):
        busy = statistics.median(e.measured_busy_s[i] for e in epochs)
        wait = statistics.median(e.measured_data_wait_s[i] for e in epochs)
        pred = statistics.median(e.predicted_step_time_s[i] for e in epochs)
        periods = [e.ranks[i].loader_period_s for e in epochs]
        period = None if None in periods else float(statistics.median(p for p in periods if p is not None))
        out.append((i, float(busy), float(pred), float(wait), period))
    return out


def _planned_loader_s(log: RunLog, batches: tuple[int, ...]) -> list[float | None]:
    """Each rank's loader time per step in the plan that ran ``batches`` (the start plan or an adopted re-plan;
    empty when the log holds neither)."""
    plans = [log.start_plan, *(r.plan for r in log.replans if r.adopted)]
    for plan in plans:
        if plan is not None and tuple(plan.batch_sizes) == batches:
            return [r.predicted_loader_s for r in plan.ranks]
    return []


def _steal_cores(log: RunLog, split: MeasuredSplit, rank: int) -> float | None:
    """Median cores the hypervisor took from ``rank``'s cores over the split's epochs (None: never measured)."""
    states = [e.device_state[rank] for e in _split_epochs(log, split) if rank < len(e.device_state)]
    seen = [s.cpu_steal_cores for s in states if s is not None and s.cpu_steal_cores is not None]
    return float(statistics.median(seen)) if seen else None


def _loader_remedy(log: RunLog, split: MeasuredSplit) -> str:
    """What re-planning does, or did, with a loader cost that the run measured off its plan.

    A run without re-planning is told to use it. A run that re-planned is told what its ``--replan`` did over
    ``split``'s epochs: the split it moved to, or the most a re-solve would have gained: telling a run
    that re-planned to "train with --replan", or to "give it more workers" for a loader faster than planned, would
    be wrong."""
    decisions = [r for r in log.replans if r.event == "replan"]  # reverts aside
    if not decisions:
        return "train with --replan, which takes the measured loader cost"
    seen = [r for r in decisions if r.epoch in split.epochs]
    moved = [r for r in seen if r.adopted]
    if moved:
        return f"--replan took the measured cost and moved the split after epoch {moved[0].epoch}"
    gains = [r.predicted_gain for r in seen if r.predicted_gain is not None]
    if gains:
        return (f"--replan took the measured cost, and no re-solve over these epochs gained more than "
                f"{max(gains):.1%}, so it kept the split")
    return "--replan took the measured cost"


def _slow_loader(rank: int, period: float, planned: float, steal: float | None, remedy: str) -> str:
    """A rank whose workers built slower than its plan said, with what the host shows of why, and ``remedy``
    (``_loader_remedy``)."""
    from reports.evidence import STEAL_MIN_CORES

    if steal is not None and steal >= STEAL_MIN_CORES:
        # "may": steal of this size came with ~15% slower loaders on a 32-vCPU host, but 4.5 stolen
        # cores of a 64-vCPU host left one launch's loaders on plan (2x H100, skew case).
        why = (f"the hypervisor took {steal:.2f} core(s) from its cores (steal) meanwhile: a busy VM host may have "
               "slowed its workers")
    else:
        shown = f" (steal {steal:.2f} core(s))" if steal is not None else ""
        why = f"the host gave its workers less than when profiled{shown}: other load, clocks or memory bandwidth"
    return (f"rank {rank}'s workers built a batch every {1000 * period:.1f} ms against {1000 * planned:.1f} ms in the "
            f"plan ({period / planned - 1:+.0%}): {why}; {remedy}")


def _noise_at(quality: ProfileQuality | None, split: MeasuredSplit) -> QualityIssue | None:
    """The profile's worst compute issue at the batch sizes ``split`` (or the equal split) ran, if any."""
    if quality is None or not split.batch_sizes:
        return None
    return quality.relevant(split.batch_sizes, sum(split.batch_sizes) / len(split.batch_sizes)).worst


def likely_cause(log: RunLog, split: MeasuredSplit, profile: Profile, quality: ProfileQuality | None) -> str:
    """The most likely reason a split missed its prediction, in plain words with the numbers (a noisy profile only
    where its noise touches the split's batch sizes: planner.quality.ProfileQuality.relevant)."""
    worst = _noise_at(quality, split)
    ranks = [r for r in _rank_ratios(log, split) if r[2] > 0]
    off = [r for r in ranks if abs(r[1] / r[2] - 1.0) > PREDICTION_TOL]
    # The noise is the cause only where it is as large as the miss: a rank measured 5x its prediction is not
    # explained by curves off by 30%.
    if worst is not None and all(abs(r[1] / r[2] - 1.0) <= worst.noise_frac for r in off):
        return (f"the profile is noisy ({worst.subject}: {worst.what}); re-profile with a longer --budget-s on an "
                "idle machine")
    if off:
        outside = _outside_timers(split, ranks)
        cause = _rank_cause(log, split, profile, max(off, key=lambda r: abs(r[1] / r[2] - 1.0)))
        return cause if outside is None else f"{outside}; beyond that, {cause}"
    comm = profile.comm
    unmeasured = comm is None or comm.exposed_s is None
    gap = split.step_time_s - split.predicted_step_time_s
    tail = ("; this profile has no measured DDP overhead -- profile under torchrun so it is measured"
            if unmeasured and profile.world_size > 1 else "")
    return (f"every rank's own work is within {PREDICTION_TOL:.0%} of its prediction, so the {1000 * abs(gap):.1f} ms "
            f"{'extra' if gap > 0 else 'saved'} per step is synchronization (the gradient all-reduce and DDP's own "
            f"work){tail}")


def _outside_timers(split: MeasuredSplit, ranks: Sequence[tuple[int, float, float, float, float | None]]) -> str | None:
    """The part of a miss no rank's own time holds, when it is most of the miss: the measured step less the busiest
    rank's busy time (compute and data wait) less the predicted communication.  Work a loop does per step outside
    the timed forward and backward (a cost before the model's forward, recorded on a loaded 2-core box: the step
    1.85 s, both ranks busy under 0.8 s) lands there, as does synchronization slower than profiled; None when a
    rank's own excess explains at least half of the miss."""
    if not ranks:
        return None
    busiest = max(r[1] for r in ranks)
    comm = split.predicted_step_time_s - max(r[2] for r in ranks)
    outside = split.step_time_s - busiest - comm
    miss = split.step_time_s - split.predicted_step_time_s
    if miss <= 0 or outside < 0.5 * miss or outside < PREDICTION_TOL * split.predicted_step_time_s:
        return None
    return (f"{1000 * outside:.1f} ms of each step is in no rank's own time (the step {1000 * split.step_time_s:.1f} "
            f"ms, the busiest rank's compute and data wait {1000 * busiest:.1f} ms, the predicted communication "
            f"{1000 * comm:.1f} ms): work the loop does outside the timed forward and backward (before the model's "
            "forward, or after the optimizer step: no timer sees it), or synchronization slower than profiled")


def _rank_cause(log: RunLog, split: MeasuredSplit, profile: Profile,
                rank: tuple[int, float, float, float, float | None]) -> str:
    """Why one rank's own time (``_rank_ratios``' row) is off its prediction over ``split``'s epochs."""
    i, busy, pred, wait, period = rank
    planned = _planned_loader_s(log, split.batch_sizes)
    loader_plan = planned[i] if i < len(planned) else None
    spikes = _compute_tail(log, split, i)
    if period is not None and loader_plan and period > (1.0 + LOADER_SLOW_TOL) * loader_plan and period > pred:
        # the workers themselves fell behind the plan (2x H100: 111-129 ms against 107-111 planned while the
        # VM host lost 0.3 cores to steal); whatever the hand-over adds comes after
        cause = _slow_loader(i, period, loader_plan, _steal_cores(log, split, i), _loader_remedy(log, split))
        if wait > HANDOVER_WAIT * busy and period <= WORKERS_KEPT_UP * busy:
            cause += (f"; beyond that it waits {1000 * wait:.1f} ms per step for data, the hand-over of each "
                      "batch to the training loop")
        elif spikes is not None and spikes[1] + wait > period:
            # seen on 2x H100: workers 13% behind the plan, and the rank's compute spiking above both
            cause += (f"; beyond that its compute, {1000 * spikes[0]:.1f} ms in most steps, averages "
                      f"{1000 * spikes[1]:.1f} ms: some steps run far longer"
                      + (f", its host's cores {spikes[3]:.0%} busy" if spikes[3] is not None else ""))
        return cause
    if period is not None and period >= WORKERS_KEPT_UP * busy:
        head = (f"rank {i}'s loader needs {1000 * period:.1f} ms per step (its workers' own build time) against "
                f"{1000 * pred:.1f} ms predicted for the rank: ")
        if period > pred:
            return (f"{head}the loader is slower than profiled (host contention, transforms); give it more workers "
                    f"(--max-workers-per-rank) or lighter transforms; {_loader_remedy(log, split)}")
        return (f"{head}its workers built faster than planned (the host gave them more than when measured), which "
                f"does not slow the step; {_loader_remedy(log, split)}")
    if period is not None and wait > HANDOVER_WAIT * busy and period <= WORKERS_KEPT_UP * busy:
        return handover_cause(i, busy, wait, period, split.batch_sizes[i], profile, _steal_cores(log, split, i))
    if wait > 0.5 * busy:
        return (f"rank {i} waits {1000 * wait:.1f} ms per step for data ({1000 * busy:.1f} ms busy against "
                f"{1000 * pred:.1f} ms predicted): its loader is slower than profiled; give it more workers "
                "(--max-workers-per-rank) or a faster data path")
    if spikes is not None and spikes[0] + wait <= (1.0 + TAIL_TOL) * pred:
        return compute_tail_cause(i, pred, *spikes, loader_and_peers=period is not None and len(split.batch_sizes) > 1)
    return (f"rank {i}'s own step measured {1000 * busy:.1f} ms against {1000 * pred:.1f} ms predicted: its "
            "curve in the profile does not match this run (measured under other load, or for another model or "
            "input size); re-profile it, or train with --replan, which corrects curves from measurements")


TAIL_TOL = 0.05
"""A rank's mean compute this far over its median is a tail of long steps (``compute_tail_cause``) when the median
is on the prediction."""


def _compute_tail(log: RunLog, split: MeasuredSplit, rank: int) -> tuple[float, float, float, float | None] | None:
    """(median, mean, typical spread, host busy share or None) of ``rank``'s compute over the split's epochs, medians
    of the epochs' statistics; None when its mean is within ``TAIL_TOL`` of its median or the log has no medians."""
    epochs = [e for e in _split_epochs(log, split) if rank < len(e.ranks)]
    stats = [e.ranks[rank] for e in epochs]
    if not stats or any(s.compute_s_median is None for s in stats):
        return None
    median = float(statistics.median(s.compute_s_median or 0.0 for s in stats))
    mean = float(statistics.median(s.compute_s for s in stats))
    if median <= 0 or mean <= (1.0 + TAIL_TOL) * median:
        return None
    spread = float(statistics.median(s.compute_s_sigma for s in stats))
    states = [e.device_state[rank] for e in epochs if rank < len(e.device_state)]
    busy = [x.cpu_busy_frac for x in states if x is not None and x.cpu_busy_frac is not None]
    return median, mean, spread, (float(statistics.median(busy)) if busy else None)


def compute_tail_cause(rank: int, pred: float, median: float, mean: float, spread: float,
                       host_busy: float | None, *, loader_and_peers: bool) -> str:
    """A rank on its curve in most steps whose mean compute a tail of long steps raises (``loader_and_peers``: the
    rank is fed by a DataLoader and has DDP peers).

    On 2x H100 (docs/PERFORMANCE.md) such a tail came only with both: rank 0 of `planner
    train`'s skew case ran 20-50 ms long in 15-40% of its steps, but its compute span stayed flat (p90 within 0.3 ms
    of its median) on one GPU beside 30 CPU burners (nice 0 or 10), beside a 23-worker DataLoader whose pinned
    batches it trained on, and on two GPUs under DDP with the batches already on the device.  A busy host alone is
    therefore not the cause.  On 2x H200 the step log told the suspects apart
    with the step log's ``lead_ms``: 57 of the 60 long spans of the rank that never
    waited for data came in steps it started ahead of its data-starved peer, the span tracking the head start with
    a correlation of 0.98-1.00 -- its wait for the peer in DDP's buffer broadcast at the forward's start, which
    spans opened before ``ddp(x)`` counted as compute.  The span now opens after it
    (runtime.timing.ComputeStart), so such a tail in a log that records ``lead_ms`` is something else.  The host's busy share is named
    as context."""
    head = (f"rank {rank}'s compute is on its curve in most steps (median {1000 * median:.1f} ms against "
            f"{1000 * pred:.1f} ms predicted for the rank) but averages {1000 * mean:.1f} ms: some steps run far "
            f"longer than the typical {1000 * spread:.1f} ms spread")
    busy = f" (its host's cores {host_busy:.0%} busy)" if host_busy is not None else ""
    if loader_and_peers:
        return (f"{head}{busy} -- on 2x H100 such long steps came only with DataLoaders and DDP peers together, "
                "not from a busy CPU or the loader alone; on 2x H200 they were steps this rank started ahead of a "
                "peer late with its data, waiting for it in DDP's buffer broadcast at the forward's start (spans "
                "now open after it): look at the peers' data waits; `planner train --step-log` records each step's "
                "lead (`lead_ms`)")
    return (f"{head}{busy} -- something else stalls it now and then (a co-tenant, the garbage collector, the host); "
            "`planner train --step-log` records every step to find when")


LOADER_SLOW_TOL = 0.05
"""A rank's workers building this much slower than its plan's loader time (``RankPlan.predicted_loader_s``), and
slower than its whole predicted step, are the first cause of its miss (``likely_cause``)."""
HANDOVER_WAIT = 0.10
"""A rank waiting this share of its step for data while its workers build faster than it steps is paced by the
hand-over (``handover_cause``)."""


def handover_cause(rank: int, busy: float, wait: float, period: float, batch: int, profile: Profile,
                   steal: float | None = None) -> str:
    """A rank that waits for data though its workers build a batch faster than it steps: the batches reach the
    training loop slower than they are built -- the training process's pinning thread (runtime.pinning.PinAhead,
    or the DataLoader's own pin-memory thread) copies each one into pinned memory on one core (2x H200:
    298 MB batches built every 93 ms, handed over every ~130 ms, the step 129 ms against 108 predicted;
    docs/PERFORMANCE.md).  Steal of ``STEAL_MIN_CORES`` or more is named beside: the copy is the
    host's memory bandwidth and one core, both of which a busy VM host takes (2x H100: 0.5 cores stolen,
    the host monitor's memory-copy probe 10% slower, rank 0 waiting 34 ms a step with its workers on plan)."""
    from reports.evidence import STEAL_MIN_CORES

    lp = profile.rank(rank).loader if rank < profile.world_size else None
    size = ""
    if lp is not None and lp.sample_bytes:
        nbytes = lp.sample_bytes * batch
        size = (f" -- {nbytes / 1e6:,.0f} MB a batch, {nbytes / busy / 1e9:.1f} GB/s as delivered"
                + (f" against {lp.handover_bytes_per_s / 1e9:.1f} GB/s in the profile" if lp.handover_bytes_per_s
                   else ""))
    stolen = (f"; the hypervisor took {steal:.2f} core(s) from its cores meanwhile (steal: a busy VM host, which "
              "slows that copy too)" if steal is not None and steal >= STEAL_MIN_CORES else "")
    return (f"rank {rank} waits {1000 * wait:.1f} ms per step for data although its workers build a batch every "
            f"{1000 * period:.1f} ms: the batches reach the training loop slower than they are built -- the "
            f"hand-over, the pinning thread copying each one once more on one core (without it, the loop's own "
            f"copy){size}{stolen}; fewer bytes a sample (e.g. uint8 "
            "images normalized on the GPU) or a smaller batch on this rank relieve it, more workers do not")


FILL_TOL = 0.05
"""An epoch start (the loaders' fill, runtime.timing) costing more than this share of its epoch is a finding."""


def fill_line(log: RunLog) -> str | None:
    """What each epoch start costs beside the steady pace the predictions are compared with: the DataLoaders
    refilling their pipelines (every worker building its prefetch at once), from the ranks' ``fill_steps`` and
    ``fill_excess_s``; None when no epoch had a steady part after its fill, or the fill costs under ``FILL_TOL``.
    Epoch 0 is left out where later epochs exist (it also holds the start-up)."""
    epochs = [e for e in log.epochs if e.ranks and e.step_time_s and max(s.fill_steps for s in e.ranks)]
    later = [e for e in epochs if e.epoch > 0] or epochs
    if not later:
        return None
    costs, shares, fills = [], [], []
    for e in later:
        worst = max(e.ranks, key=lambda s: s.fill_excess_s)
        epoch_s = worst.fill_excess_s + worst.num_steps * (e.step_time_s or 0.0)  # steady steps, plus the fill
        costs.append(worst.fill_excess_s)
        shares.append(worst.fill_excess_s / epoch_s if epoch_s > 0 else 0.0)
        fills.append(worst.fill_steps)
    share = statistics.median(shares)
    if share < FILL_TOL:
        return None
    most = max(later[-1].ranks, key=lambda s: s.num_workers)
    return (f"Epoch start: each epoch's first {max(fills)} steps, while the DataLoaders refilled their pipelines "
            f"(every worker building its prefetch at once), took {statistics.median(costs):.1f} s beyond the steady "
            f"pace ({share:.0%} of the epoch; the run log's throughput and per-rank times are the steady pace after "
            f"it). Longer epochs dilute it. It lasts workers x (prefetch + 1) steps of the busiest loader, so fewer "
            f"workers there (rank {most.rank} has {most.num_workers}; --max-workers-per-rank) shorten it and load the "
            f"host's cores less while it lasts -- check that the steady pace stays where it was.")


WALL_TOL = 0.10
"""The wall clock's epoch throughput this far below the timed pace is a finding."""


def wall_line(log: RunLog) -> str | None:
    """The epochs by the wall clock beside the step timer's pace (logs that record ``wall_s``): the timed pace
    leaves out each epoch's warm-up steps -- the first batch's wait among them, one worker building a whole batch
    -- which a loader-fed epoch pays every time (2x H100, 100-step epochs: 2.4-4.9 s a step-0 wait,
    the wall clock at 0.62-0.69 of the prediction where the timed pace read 0.88-0.93).  None when the log has no
    wall times or they are within ``WALL_TOL`` of the timed pace.  Epoch 0 is left out where later epochs exist."""
    epochs = [e for e in log.epochs if e.wall_samples_per_s and e.samples_per_s]
    later = [e for e in epochs if e.epoch > 0] or epochs
    if not later:
        return None
    wall = statistics.median(e.wall_samples_per_s or 0.0 for e in later)
    timed = statistics.median(e.samples_per_s or 0.0 for e in later)
    if wall >= (1.0 - WALL_TOL) * timed:
        return None
    lost = statistics.median((e.wall_s or 0.0) - (e.samples or 0) / (e.samples_per_s or 1.0) for e in later)
    return (f"By the wall clock the epochs ran {wall:,.0f} samples/s, {1 - wall / timed:.0%} below the timed "
            f"pace of {timed:,.0f} that the per-rank times and predictions are compared with: about "
            f"{lost:.1f} s an epoch go to steps the timed pace leaves out -- its warm-up, where the DataLoader's "
            f"workers start over and the first batch waits for one worker to build it whole, and the loaders' fill "
            f"or drain where they are left out. Longer epochs dilute it (`planner train --step-log` records every "
            f"step).")


def _table_epoch(log: RunLog, comm_s: float) -> tuple[EpochRecord, MeasuredSplit] | None:
    """The epoch the report's per-rank table reads (``RunLog.steady_epoch``) and its split measured over it alone;
    None when it is drained or holds no measured step or prediction."""
    e = log.steady_epoch()
    if e is None or not e.step_time_s or not e.predicted_step_time_s or e.drained:
        return None
    return e, _measured(tuple(e.batch_sizes), [e], comm_s)


def _table_epoch_miss(log: RunLog, table: tuple[EpochRecord, MeasuredSplit], missed: Sequence[MeasuredSplit],
                      profile: Profile, quality: ProfileQuality | None) -> str | None:
    """A rank off its prediction by more than ``PREDICTION_TOL`` in the epoch the report's per-rank table reads
    (``_table_epoch``), explained, when no split miss covers that epoch already: a split's median over its
    epochs can sit within tolerance while one of them, the one the table shows, does not (2x H100:
    rank 0 at +30% in epoch 2 while epochs 1 and 3 held its split's median at +8%)."""
    e, one = table
    if any(e.epoch in s.epochs and tuple(e.batch_sizes) == s.batch_sizes for s in missed):
        return None
    errors = [(i, b / p - 1.0) for i, (b, p) in enumerate(zip(e.measured_busy_s, e.predicted_step_time_s))
              if p > 0 and math.isfinite(b)]
    off = [x for x in errors if abs(x[1]) > PREDICTION_TOL]
    if not off:
        return None
    i, err = max(off, key=lambda x: abs(x[1]))
    return (f"Prediction miss in epoch {e.epoch} (the run log's per-rank table): rank {i} was busy "
            f"{1000 * e.measured_busy_s[i]:.1f} ms a step against {1000 * e.predicted_step_time_s[i]:.1f} ms "
            f"predicted ({err:+.0%}); likely cause: {likely_cause(log, one, profile, quality)}.")


NOTE_TOL = 0.05
"""A rank this much slower than its prediction in the per-rank table's epoch, yet within ``PREDICTION_TOL``, gets a
line with its likely cause (``_table_epoch_note``): the per-rank target."""


def _table_epoch_note(log: RunLog, table: tuple[EpochRecord, MeasuredSplit], profile: Profile,
                      quality: ProfileQuality | None) -> str | None:
    """The slowest rank of the per-rank table's epoch (``_table_epoch``) when it is more than ``NOTE_TOL`` and at
    most ``PREDICTION_TOL`` over its prediction, with its likely cause: a noisy profile only when the noise is that
    rank's."""
    e, one = table
    rows = [r for r in _rank_ratios(log, one) if r[2] > 0 and NOTE_TOL < r[1] / r[2] - 1.0 <= PREDICTION_TOL]
    if not rows:
        return None
    row = max(rows, key=lambda r: r[1] / r[2])
    i, busy, pred = row[0], row[1], row[2]
    worst = _noise_at(quality, one)
    if worst is not None and i in worst.ranks:
        cause = f"its profile is noisy ({worst.subject}: {worst.what})"
    else:
        cause = _rank_cause(log, one, profile, row)
    return (f"Rank {i} was busy {1000 * busy:.1f} ms a step in epoch {e.epoch} (the run log's per-rank table) against "
            f"{1000 * pred:.1f} ms predicted ({busy / pred - 1:+.1%}; a miss is over {PREDICTION_TOL:.0%}); likely "
            f"cause: {cause}.")


def log_findings(log: RunLog, plan: Plan, profile: Profile, quality: ProfileQuality | None) -> list[str]:
    """Findings from a run log: the epochs by the wall clock, what each epoch start costs, prediction misses with
    their likely cause, and measured equal split vs plan."""
    splits = measured_splits(log, plan.predicted.comm_s)
    lines = [x for x in (wall_line(log), fill_line(log)) if x is not None]
    missed = [s for s in splits if abs(s.error) > PREDICTION_TOL]
    for s in missed:
        epochs = ", ".join(map(str, s.epochs))
        lines.append(
            f"Prediction miss: the split {list(s.batch_sizes)} measured {1000 * s.step_time_s:.1f} ms per step "
            f"against {1000 * s.predicted_step_time_s:.1f} ms predicted ({s.error:+.0%}, epoch(s) {epochs}); "
            f"likely cause: {likely_cause(log, s, profile, quality)}.")
    table = _table_epoch(log, plan.predicted.comm_s)
    table_miss = None if table is None else _table_epoch_miss(log, table, missed, profile, quality)
    if table_miss is not None:
        lines.append(table_miss)
    elif table is not None and not missed:
        note = _table_epoch_note(log, table, profile, quality)
        if note is not None:
            lines.append(note)
    compared = split_comparison(log, plan, profile, splits)
    if compared is not None:
        lines.append(compared)
    return lines


def _pair(splits: Sequence[MeasuredSplit], plan: Plan) -> tuple[MeasuredSplit, MeasuredSplit] | None:
    """(the equal split, the planned split: the plan's own where it ran) among ``splits``; None without both."""
    equal = [s for s in splits if _is_equal(s.batch_sizes)]
    planned = [s for s in splits if not _is_equal(s.batch_sizes)]
    if not equal or not planned:
        return None
    return equal[0], next((s for s in planned if s.batch_sizes == plan.batch_sizes), planned[-1])


def split_comparison(log: RunLog, plan: Plan, profile: Profile, splits: Sequence[MeasuredSplit]) -> str | None:
    """Measured equal split vs planned split, each measured only over epochs of one speed era
    (reports.as_measured.speed_eras: no rank's compute over its curve moved beyond noise between them), the latest
    era that ran both; where no era ran both, a line that says their numbers measure the change of speed, not the
    splits.  None when the log did not run both kinds of split."""
    if _pair(splits, plan) is None:
        return None
    comm_s = plan.predicted.comm_s
    eras = speed_eras(profile, log)
    members: dict[int, list[EpochRecord]] = {}
    for rec, era in zip(log.epochs, eras, strict=True):
        members.setdefault(era, []).append(rec)
    for era in sorted(members, reverse=True):
        pair = _pair(measured_splits(log, comm_s, members[era]), plan)
        if pair is None:
            continue
        e, p = pair
        predicted = (sum(p.batch_sizes) / p.predicted_step_time_s) / (sum(e.batch_sizes) / e.predicted_step_time_s)
        where = (f" (epochs {', '.join(map(str, sorted(p.epochs + e.epochs)))}, at the same rank speeds)"
                 if len(members) > 1 else "")
        return (f"Measured in the run log: the split {list(p.batch_sizes)} ran {p.samples_per_s:,.0f} samples/s and "
                f"the equal split {list(e.batch_sizes)} {e.samples_per_s:,.0f}{where}: "
                f"{p.samples_per_s / e.samples_per_s:.2f}x (predicted {predicted:.2f}x).")
    pair = _pair(splits, plan)
    assert pair is not None
    e, p = pair
    first = {x.epoch: x for x in log.epochs}
    change = speed_change(profile, first[p.epochs[0]], first[e.epochs[0]])
    moved = (f" (rank {change[0]}'s compute over its curve changed {change[1]:.2f}x between epoch {p.epochs[0]} and "
             f"epoch {e.epochs[0]})" if change is not None else "")
    return (f"The run log ran the split {list(p.batch_sizes)} (epoch(s) {', '.join(map(str, p.epochs))}) and the "
            f"equal split {list(e.batch_sizes)} (epoch(s) {', '.join(map(str, e.epochs))}) at different rank "
            f"speeds{moved}: their {p.samples_per_s:,.0f} and {e.samples_per_s:,.0f} samples/s measure that change, "
            "not the splits, so the report does not compare them.")
