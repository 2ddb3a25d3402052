"""The adoption policy: whether a re-solved plan replaces the running one (pure: numbers in, a verdict out).

After AdaptDL's ``_sync_local_bsz``: change only above a threshold, and only above the noise.

    gain  = T(old plan under the updated model) / T(new plan) - 1     (computed by the caller)
    noise = noise_sigmas * max_i (std_i / sqrt(n_i)) / c_i            (``AdoptionPolicy.noise``)
    adopt iff  gain > threshold  and  gain > noise
               and (gain >= confirm_below  or  the previous epoch proposed a move in the same direction)

The direction of a move is the sign of each rank's batch change; a small gain is adopted only when the next epoch
confirms it, so one epoch disturbed by another process on the host does not move the plan while a real slowdown
(gains of 30-80% measured) is followed at once.

Measured, not predicted, has the last word: a newly adopted plan is on trial until its first epoch is measured;
if its step time (slowest rank) is slower than the previous plan's last epoch by more than max(1%, noise), the
previous plan comes back at once ("reverted"), and for 5 epochs neither the rejected batch sizes nor a move from
the restored plan that reaches 3/4 of the way toward them is adopted (a shorter move in that direction still is):

    barred iff  cand == rejected   or  (current == moved_from  and  <cand - from, rej - from> >= 3/4 |rej - from|^2)

A revert compares two epochs, so it holds only while the ranks stay as they were. A rank whose batch the trial
did not raise cannot be slowed by the trial's split (its curve rises with the batch); when such a rank ran slower
than the model predicted at its batch by more than max(5%, noise), the ranks changed (a co-tenant arrived, a
clock dropped) and the trial is kept, no revert and no bar: its miss is followed up like any other, by the
re-solve on the updated model.

    conditions changed  iff  some rank i with b_i(trial) <= b_i(previous) measured c_i > pred_i * (1 + max(5%, noise))

Without it a slowdown that arrives in a trial's epoch reverts the trial and then bars every move in its
direction for 5 epochs, the right one included (tests/runtime/test_replan.py: a rank 3x slower, a 150% gain
refused for 5 epochs).

A revert also shows how far the model can be wrong: the reverted move predicted a gain g and measured s slower, so
the model missed by m = (1 + g)(1 + s) - 1.  Until a later trial confirms a prediction, a move must predict more
than that miss, halved every 5 epochs (the model keeps learning from what it measures):

    adopt only if  gain > m * 0.5 ** ((epoch - e_revert) / 5)

Without it, a model with a shape error proposes a slightly different move of the same kind once the bar expires
(random-profile test, seed 0: a 4-rank case missed by 40%, then adopted a neighbouring move 2 epochs later that
measured 5.7% slower -- 2.8% lost over 12 epochs).

A kept trial is judged once more, against its own prediction: a change adopted on a model that was wrong
leaves the step off what the plan printed, and a remaining gain under the threshold would leave it there for
good.  When the trial's measured step is off the step its plan predicted by more than ``PREDICTION_MISS`` (5%)
and the noise, the trial *missed*; the re-solve of that same epoch (the model now updated at the new split) is
its follow-up, adopted above half the threshold and without the confirmation, since the change it completes
already cleared them:

    missed     iff  |step / predicted step - 1| > max(PREDICTION_MISS, noise)
    follow-up  adopt iff  gain > max(FOLLOW_UP_SHARE * threshold, WORSE_MARGIN, noise)
               (the bars and the reverted moves' miss still apply)

A follow-up is on trial like any adopted plan (reverted when slower than the plan before it, judged again
against its own prediction).  Measured on a simulated co-tenant whose slowdown the profile's curve cannot
express in one step (tests/runtime/test_replan_followup.py): the first move left the step 20% over its
prediction with 4% more to gain, under the 5% threshold, for every later epoch; followed up, the next epoch
ran on its prediction.

Eras, memory and reversals: the rules that keep re-planning from making a run worse.  Every rule above compares a
prediction with a measurement; these compare measurements with measurements, which a wrong model cannot fool.

    era        advances when a rank's measured speed changed beyond the noise: the correction model saw a device
               change (model.device_changed / same_batch_changed), a trial's ``changed_ranks`` fired, or a rank's
               ratio at the batch it runs drifted more than 10% (and 10 standard errors) from the era's first
               measurement there; everything below is kept per era and forgotten when it advances
    memory     per split run in the era: mean measured step S (slowest rank) over its epochs, noise n / sqrt(k)
    barred     cand was measured in the era and  S(cand) > S(current) * (1 + max(WORSE_MARGIN, n_cand, n_cur))
    reversal   a revert, or adopting a move m with <m, m_prev> < 0 against the era's previous adopted move m_prev
    hold       after a revert nothing is adopted until the era advances; a move against m_prev is never adopted

Why memory: the model that proposed a split once proposes it again from the same measurements, and a revert's
bar expires after ``WORSE_EPOCHS``; the split's own measured step does not expire while the ranks run as they did.
Measured on 2 gloo ranks on a busy 2-core box (rank 1 slowed from epoch 2): [9, 1] was adopted, then [6, 4] as the
follow-up (0.88 s a step against 0.34), reverted to [9, 1], and the same again three times in 9 epochs.

Why at most one reversal per era, and why a hold rather than a shrinking step: within one era the ranks' speeds
are what they were, so a move back undoes evidence the run already paid for.  Either the first move measured
slower (its revert is the reversal, restoring the faster split, which the memory then holds) or it measured faster,
and a move against it returns toward a split that measured slower -- with a wrong model a trust region would only
make the same mistake in smaller steps, each paid with an epoch.  A revert itself is never refused: going back to
a split measured faster cannot make the run slower.  What a hold gives up is a partial step back from an overshoot
that still measured faster than the split before it; the next speed change (new era) re-opens every move.  A first
launch of this went [199, 1] -> [100, 100] -> [199, 1] -> [82, 118], giving the 4x slower rank 59% of the batch.

A missed move: a move back against the era's last move is allowed once, as the follow-up of that move's trial when
the trial measured slower than it predicted (by more than max(5%, noise)), and it is the era's reversal -- after it
the split holds until the speeds change:

    follow-up back  iff  trial missed slow (step > predicted)  and  <cand - cur, m_prev> < 0  and the follow-up's
                         gain test passes      ->   reversal = this epoch (hold)

A trial faster than it predicted gained more than the model said: a step back from it is the model's extrapolation
again, not evidence (an FSDP2 case whose move measured 27% faster than predicted stepped back and measured 12%
slower, a second reversal).

The trial measured the ranks at the split the model moved to, which the move's own epoch could not: a move made on
an epoch that held a change's onset (a co-tenant's start-up takes CPU from every rank of its host) is judged there
on speeds the next epochs do not run at.  On one H200 box (a CUDA rank beside a CPU rank, a co-tenant joining the
GPU), moves made on the onset epoch put 498 of 512 samples on the GPU rank and missed their prediction by 25%; with
no move back, 2 of 3 launches ran 52-62k samples/s for the rest of the run, where the launch that kept its split ran
65-79k.

The policy knows batch sizes only; the Replanner keeps the plans they belong to.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from planner.errors import ValidationError
from planner.stats import StepStats

Batches = tuple[int, ...]

WORSE_MARGIN = 0.01
"""A newly adopted plan measured this much slower (or more, with noise) than its predecessor is reverted."""
WORSE_EPOCHS = 5
"""Epochs for which batch sizes that measured worse are not adopted again."""
WORSE_REACH = 0.75
"""After a revert, a move from the same plan that goes at least this far along the rejected move is refused."""
FOLLOW_UP_SHARE = 0.5
"""A follow-up must predict more than this share of the threshold: the change it completes paid the threshold
once, and half of it still pays for a re-layout and, streamed, the loaders' refill (a recorded 2x H100 launch
missed by 7.9% in an epoch its later ones did not repeat; the follow-up its model then offered was 3 samples for
1.4%)."""
PREDICTION_MISS = 0.05
"""A plan whose measured step is this far (relative, either way) from the step it predicted, beyond the noise,
missed: its prediction is re-made under the updated model, and a trial that missed is followed up."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Trial:
    """A plan adopted at epoch ``adopted_at``, on trial until its first epoch has been measured."""

    previous: Batches
    """The batch sizes it replaced (restored if it measures slower)."""
    previous_step_s: float
    """The step time (slowest rank) measured in the previous plan's last epoch."""
    adopted_at: int
    predicted_gain: float = 0.0
    """The gain the model predicted for it (0 for trials restored from states written before it was kept)."""
    predicted_step_s: float = 0.0
    """The step time its plan predicted (0: not known -- a state written before it was kept; no miss is judged)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Rejection:
    """A move that measured slower and was reverted: barred for ``WORSE_EPOCHS`` epochs."""

    moved_from: Batches
    batch_sizes: Batches
    """The batch sizes that measured slower."""
    epoch: int
    """The epoch that measured them."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Missed:
    """A kept trial whose measured step was off its prediction by more than ``PREDICTION_MISS`` and the noise."""

    adopted_at: int
    step_s: float
    """The step time its first epoch measured."""
    predicted_step_s: float

    @property
    def error(self) -> float:
        return self.step_s / self.predicted_step_s - 1.0

    def describe(self) -> str:
        return (f"the plan adopted at epoch {self.adopted_at} measured {self.step_s * 1e3:.4g} ms per step against "
                f"{self.predicted_step_s * 1e3:.4g} ms predicted ({self.error:+.1%})")


def pooled_spread(state: PolicyState) -> float:
    """The era's epoch-to-epoch relative sigma of a split's step, pooled over its splits measured twice or more
    (0 before any was)."""
    dof = sum(m.epochs - 1 for m in state.measured)
    return math.sqrt(sum(m.spread for m in state.measured) / dof) if dof > 0 else 0.0


def missed_prediction(step_s: float, predicted_step_s: float, noise: float) -> bool:
    """Whether a measured step is off its prediction by more than ``PREDICTION_MISS`` and ``noise`` (relative)."""
    return predicted_step_s > 0 and abs(step_s / predicted_step_s - 1.0) > max(PREDICTION_MISS, noise)


def changed_ranks(trial: Trial | None, batch_sizes: Sequence[int], measured: Sequence[float], predicted: Sequence[float],
                  noise: float) -> list[int]:
    """The ranks that show the conditions changed under ``trial`` (module docstring): a batch the trial did not
    raise, and a measured compute over its prediction by more than ``max(PREDICTION_MISS, noise)``."""
    if trial is None:
        return []
    return [i for i, (b, m, p) in enumerate(zip(batch_sizes, measured, predicted, strict=True))
            if b <= trial.previous[i] and p > 0 and m > p * (1.0 + max(PREDICTION_MISS, noise))]


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitMeasure:
    """What one split measured in the current era (module docstring, "memory")."""

    batch_sizes: Batches
    step_s: float
    """Mean measured step time (slowest rank) over the era's epochs of this split."""
    noise: float
    """The noisiest of those epochs' own relative noise (``noise_sigmas`` standard errors: ``revert_noise``)."""
    epochs: int = 1
    epoch: int = 0
    """The last epoch that measured it."""
    spread: float = 0.0
    """Sum of squared relative deviations of its epochs' steps from their mean (Welford): the epoch-to-epoch
    noise that one epoch's own spread cannot show."""
    workers: tuple[int, ...] = ()
    accumulation_steps: tuple[int, ...] = ()
    """The split's plan besides its batches (to return to it: ``AdoptionPolicy.fallback``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Move:
    """The era's last adopted move: new batch sizes minus old."""

    delta: tuple[int, ...]
    epoch: int

    def against(self, current: Batches, candidate: Batches) -> bool:
        """Whether current -> candidate goes back against this move: <candidate - current, delta> < 0."""
        return sum((c - a) * d for a, c, d in zip(current, candidate, self.delta, strict=True)) < 0


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyState:
    """Everything the policy remembers between epochs."""

    proposed: tuple[int, ...] | None = None
    """Direction (sign per rank) of the last epoch's unconfirmed small move, if any."""
    trial: Trial | None = None
    rejections: tuple[Rejection, ...] = ()
    """Recent reverts, oldest first."""
    miss: tuple[float, int] | None = None
    """(m, epoch): the last reverted move's prediction miss and when it was measured; cleared by a kept trial."""
    missed_trial: Missed | None = None
    """The trial kept at this epoch that missed its prediction (``check_trial``): the judge of the same epoch
    follows it up, then forgets it."""
    era: int = 0
    """How many times the ranks' measured speeds changed (module docstring, "era")."""
    era_since: int | None = None
    """The epoch the era began (None: the run's first)."""
    measured: tuple[SplitMeasure, ...] = ()
    """Every split run in this era, in the order first run."""
    last_move: Move | None = None
    """The era's last adopted move (None: none yet, or a revert since)."""
    reversal: int | None = None
    """The epoch of the era's reversal (a revert, or a missed move's follow-up back): nothing is adopted until the era
    advances."""

    def measure_of(self, batch_sizes: Batches) -> SplitMeasure | None:
        return next((m for m in self.measured if m.batch_sizes == batch_sizes), None)

    def miss_at(self, epoch: int) -> float:
        """The gain a move must beat at ``epoch`` because of the last miss (module docstring)."""
        if self.miss is None:
            return 0.0
        m, at = self.miss
        return m * 0.5 ** (max(0, epoch - at) / WORSE_EPOCHS)


@dataclass(frozen=True, kw_only=True, slots=True)
class Revert:
    """The plan on trial measured slower than its predecessor: go back to ``trial.previous``."""

    trial: Trial
    rejected: Batches
    """The batch sizes on trial."""
    step_s: float
    """Their measured step time."""

    @property
    def slower(self) -> float:
        return self.step_s / self.trial.previous_step_s - 1.0

    def reason(self) -> str:
        prev = list(self.trial.previous)
        return (f"reverted: batches {list(self.rejected)} (adopted at epoch {self.trial.adopted_at}) measured "
                f"{self.step_s * 1e3:.4g} ms per step, {self.slower:.1%} slower than the "
                f"{self.trial.previous_step_s * 1e3:.4g} ms of {prev} before them; back to {prev}")


@dataclass(frozen=True, kw_only=True, slots=True)
class RecompileCharge:
    """What a candidate's new shapes cost a compiled model (``recompile_charge``), against what its gain saves.

    A rank whose micro-batch size changes to one it has not run recompiles (torch.compile specializes its graph on
    the batch dimension; dynamo caches a graph per shape, so a size the rank already ran costs nothing again).  The
    ranks compile in parallel and the step waits for the slowest, so the charge is the largest ``recompile_s`` of
    the ranks that change.  The gain is worth it only when

        saved_s = (T_old - T_new) * steps_per_epoch * epochs_left  >  charge_s
    """

    charge_s: float
    """Seconds of recompiling the candidate costs: the most over ``ranks`` (0 when no rank meets a new shape)."""
    ranks: tuple[int, ...]
    """The ranks whose micro-batch size is one they have not run, with a recompile time known for them."""
    sizes: tuple[int, ...]
    """Their new micro-batch sizes, in the order of ``ranks``."""
    saved_s: float
    """(T_old - T_new) * steps_per_epoch * epochs_left: what the gain saves over the rest of the run."""
    steps_per_epoch: int
    epochs_left: int
    run_length_known: bool = True
    """False when the run did not say how many epochs it has: ``epochs_left`` is then 1 (the next epoch), the least
    the gain has to pay back with."""

    @property
    def worth(self) -> bool:
        return self.charge_s <= 0.0 or self.saved_s > self.charge_s

    def describe(self) -> str:
        """The charge with its numbers, for the decision's reason."""
        who = ", ".join(f"rank {r} to {b}" for r, b in zip(self.ranks, self.sizes, strict=True))
        over = (f"over the {self.epochs_left} epoch{'s' if self.epochs_left != 1 else ''} left"
                if self.run_length_known else "over the next epoch (the run's epochs are not known)")
        return (f"recompiling {self.charge_s:.3g} s ({who}) against {self.saved_s:.3g} s saved {over} "
                f"of {self.steps_per_epoch} steps")


def recompile_charge(*, recompile_s: Sequence[float | None], compiled: Sequence[frozenset[int]],
                     candidate_micro: Sequence[Sequence[int]], t_old_s: float, t_new_s: float,
                     steps_per_epoch: int, epochs_left: int | None) -> RecompileCharge:
    """The recompile charge of a candidate whose rank i runs micro-batches ``candidate_micro[i]``, rank i having
    compiled the sizes ``compiled[i]`` and recompiling in ``recompile_s[i]`` seconds (None: not measured, no charge).
    ``epochs_left`` None: not known, weighed over one epoch (``RecompileCharge.run_length_known``)."""
    ranks, sizes, costs = [], [], []
    for i, (micro, done, cost) in enumerate(zip(candidate_micro, compiled, recompile_s, strict=True)):
        new = sorted(set(micro) - done)
        if new and cost is not None and cost > 0:
            ranks.append(i)
            sizes.append(new[0])
            costs.append(float(cost))
    left = 1 if epochs_left is None else max(0, int(epochs_left))
    saved = max(0.0, t_old_s - t_new_s) * max(0, int(steps_per_epoch)) * left
    return RecompileCharge(charge_s=max(costs, default=0.0), ranks=tuple(ranks), sizes=tuple(sizes), saved_s=saved,
                           steps_per_epoch=int(steps_per_epoch), epochs_left=left,
                           run_length_known=epochs_left is not None)


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    adopt: bool
    why: str
    """The reason, to follow the caller's numbers ("...: below the threshold 5.0%")."""
    short: str | None = None
    """The reason for the one-line summary (``ReplanDecision.line``); None: ``why`` itself."""

    @property
    def brief(self) -> str:
        return self.why if self.short is None else self.short


@dataclass(frozen=True, kw_only=True, slots=True)
class AdoptionPolicy:
    """The rules (module docstring); the memory they need is a ``PolicyState`` passed in and returned."""

    threshold: float = 0.05
    """Minimum predicted gain to switch plans (0.05 = 5 %)."""
    noise_sigmas: float = 2.0
    """The gain must also exceed this many relative standard errors of the noisiest rank."""
    confirm_below: float = 0.10
    """A gain under this (over the threshold) is adopted only when the previous epoch proposed the same move."""

    def __post_init__(self) -> None:
        if not self.threshold >= 0.0:
            raise ValidationError(f"replan threshold must be >= 0, got {self.threshold}")

    def noise(self, by_rank: Sequence[StepStats]) -> float:
        """The relative noise a gain must beat: ``noise_sigmas`` standard errors of the noisiest rank's mean.

        The per-step sigma is robust (``StepStats.compute_s_sigma``: 1.4826 x MAD when the timer recorded it), so a
        few stalled steps -- a peer's stall leaking into this rank's timing, GC -- do not inflate it.
        """
        return self.noise_sigmas * max(s.compute_s_sigma / math.sqrt(s.num_steps) / s.compute_s for s in by_rank)

    def revert_noise(self, by_rank: Sequence[StepStats]) -> float:
        """The relative noise a trial's slowdown must beat before its plan is reverted: the standard error of the
        noisiest rank's mean step time over every step (stalls included; the compute time's where the step time's
        spread was not recorded).  A revert compares two epochs' whole step times, which drift with
        everything a per-step MAD leaves out, so it asks for more evidence than adopting does."""
        return self.noise_sigmas * max(
            (s.step_time_s_std / s.step_time_s if s.step_time_s_std is not None and s.step_time_s > 0
             else s.compute_s_std / s.compute_s) / math.sqrt(s.num_steps) for s in by_rank)

    @staticmethod
    def new_era(state: PolicyState, epoch: int) -> PolicyState:
        """The ranks' measured speeds changed: what the era measured, its moves, its reversal and its reverts' bars
        describe the old speeds and are forgotten (the model's demonstrated miss is kept: it is the model's)."""
        return replace(state, era=state.era + 1, era_since=epoch, measured=(), last_move=None, reversal=None,
                       rejections=(), proposed=None)

    @staticmethod
    def remember(state: PolicyState, *, epoch: int, batch_sizes: Batches, step_s: float, noise: float,
                 workers: tuple[int, ...] = (), accumulation_steps: tuple[int, ...] = ()) -> PolicyState:
        """This epoch's measured step of the split it ran, folded into the era's memory (a running mean)."""
        old = state.measure_of(batch_sizes)
        if old is None:
            new = SplitMeasure(batch_sizes=batch_sizes, step_s=step_s, noise=noise, epoch=epoch, workers=workers,
                               accumulation_steps=accumulation_steps)
            return replace(state, measured=(*state.measured, new))
        k = old.epochs + 1
        mean = old.step_s + (step_s - old.step_s) / k
        spread = old.spread + (step_s - old.step_s) * (step_s - mean) / (old.step_s * mean)
        new = replace(old, step_s=mean, noise=max(old.noise, noise), epochs=k, epoch=epoch, spread=spread)
        return replace(state, measured=tuple(new if m is old else m for m in state.measured))

    def slower(self, state: PolicyState, a: SplitMeasure, b: SplitMeasure) -> float | None:
        """How much slower ``a`` measured than ``b`` when it did beyond the noise (module docstring, "barred"), else
        None.  Each mean's relative sigma is its epochs' own (noise / noise_sigmas) or the era's epoch-to-epoch
        spread, whichever is larger, over sqrt(epochs):

            slower iff  S_a > S_b * (1 + max(WORSE_MARGIN, noise_sigmas * sqrt(s_a^2 / k_a + s_b^2 / k_b)))
        """
        pooled = pooled_spread(state)
        ns = max(self.noise_sigmas, 1e-9)
        sa, sb = (max(m.noise / ns, pooled) for m in (a, b))
        z = self.noise_sigmas * math.sqrt(sa * sa / a.epochs + sb * sb / b.epochs)
        return a.step_s / b.step_s - 1.0 if a.step_s > b.step_s * (1.0 + max(WORSE_MARGIN, z)) else None

    def fallback(self, state: PolicyState, current: Batches) -> tuple[SplitMeasure, float] | None:
        """The era's best measured split, when the running one (measured at least twice, so more than its trial
        saw) measured slower than it beyond the noise and the era has had no reversal: go back to it (a revert).
        A trial kept within the noise can still be slower; its later epochs show it."""
        now = state.measure_of(current)
        if now is None or now.epochs < 2 or state.reversal is not None or state.trial is not None:
            return None
        others = [m for m in state.measured if m.batch_sizes != current and m.workers]
        if not others:
            return None
        best = min(others, key=lambda m: m.step_s)
        lost = self.slower(state, now, best)
        return None if lost is None else (best, lost)

    def check_trial(self, state: PolicyState, *, epoch: int, batch_sizes: Batches, step_s: float,
                    noise: float, conditions_changed: bool = False) -> tuple[PolicyState, Revert | None]:
        """First at every accepted epoch: forget expired rejections, then judge the plan on trial (if any),
        ``batch_sizes``, by the step time ``step_s`` its first epoch measured.  The trial ends either way.
        ``conditions_changed``: a rank the trial did not load more ran slower than predicted (module docstring), so
        a slower step is no evidence against the trial's split: it is kept and judged against its prediction."""
        rejections = tuple(r for r in state.rejections if epoch - r.epoch < WORSE_EPOCHS)
        trial = state.trial
        state = replace(state, trial=None, rejections=rejections, missed_trial=None)
        if trial is None:
            return state, None
        revert = Revert(trial=trial, rejected=batch_sizes, step_s=step_s)
        # A slowdown within the noise is no evidence against the new plan; 1% is not worth a change either way.
        if not revert.slower > max(WORSE_MARGIN, noise) or conditions_changed:
            # Kept: the move held.  Judged once more against its own prediction (module docstring).
            missed = (Missed(adopted_at=trial.adopted_at, step_s=step_s, predicted_step_s=trial.predicted_step_s)
                      if missed_prediction(step_s, trial.predicted_step_s, noise) else None)
            return replace(state, miss=None, missed_trial=missed), None
        rejected = Rejection(moved_from=trial.previous, batch_sizes=batch_sizes, epoch=epoch)
        miss = (1.0 + trial.predicted_gain) * (1.0 + revert.slower) - 1.0
        # The era's reversal: hold the restored split until the ranks' speeds change (module docstring).
        return replace(state, proposed=None, trial=None, rejections=(*rejections, rejected), miss=(miss, epoch),
                       last_move=None, reversal=epoch), revert

    def judge(self, state: PolicyState, *, epoch: int, current: Batches, candidate: Batches, gain: float,
              noise: float, step_s: float, predicted_step_s: float = 0.0) -> tuple[PolicyState, Verdict]:
        """Whether ``candidate`` (a valid re-solve, different from ``current``) with predicted ``gain`` and predicted
        step ``predicted_step_s`` replaces ``current``, whose epoch measured ``step_s`` per step.  Adopting puts it
        on trial.  A trial that missed its prediction this epoch (``check_trial``) is followed up below the
        threshold (module docstring)."""
        follow = state.missed_trial
        state = replace(state, missed_trial=None)
        # First: after the era's reversal nothing moves (module docstring); a barred move is refused whatever its
        # predicted gain -- the prediction is what was wrong.
        if state.reversal is not None:
            return state, Verdict(adopt=False, why=(
                f"holding {list(current)} after the reversal at epoch {state.reversal} until a rank's measured speed "
                "changes (one reversal per change)"), short=f"holding after the reversal at epoch {state.reversal}")
        barred = self.barred_by(state, current, candidate)
        if barred is not None:
            return state, Verdict(adopt=False, why=(
                f"goes as far as {list(barred.batch_sizes)}, which measured slower than {list(barred.moved_from)} "
                f"at epoch {barred.epoch}; such moves are barred until epoch {barred.epoch + WORSE_EPOCHS}"))
        # Measurements before predictions (module docstring, "Eras, memory and reversals").
        was, now = state.measure_of(candidate), state.measure_of(current)
        lost = None if was is None or now is None else self.slower(state, was, now)
        if was is not None and lost is not None:
            return state, Verdict(adopt=False, why=(
                f"{list(candidate)} measured {was.step_s * 1e3:.4g} ms per step (epoch {was.epoch}), "
                f"{lost:.1%} slower than {list(current)}; not adopted again until a rank's speed changes"),
                short=f"{list(candidate)} measured {lost:.1%} slower")
        last = state.last_move
        back = last is not None and last.against(current, candidate)
        if last is not None and back and (follow is None or follow.error <= 0):
            return state, Verdict(adopt=False, why=(
                f"moves back against the move adopted at epoch {last.epoch} while the ranks' speeds are "
                "unchanged; not adopted until a rank's measured speed changes"),
                short=f"moves back against epoch {last.epoch}'s move")
        trial = Trial(previous=current, previous_step_s=step_s, adopted_at=epoch, predicted_gain=gain,
                      predicted_step_s=predicted_step_s)
        move = Move(delta=tuple(c - a for a, c in zip(current, candidate, strict=True)), epoch=epoch)
        if follow is not None and gain > max(FOLLOW_UP_SHARE * self.threshold, WORSE_MARGIN, noise) \
                and gain > state.miss_at(epoch):
            # The change adopted before was made on a model this epoch corrected: finish it.  Back against that
            # change, the follow-up is the era's one reversal (module docstring, "A missed move"): nothing moves
            # after it until the speeds change.
            return replace(state, proposed=None, trial=trial, last_move=move,
                           reversal=epoch if back else state.reversal), Verdict(
                adopt=True, why=f"adopted as the follow-up{' back' if back else ''}: {follow.describe()}",
                short=f"follow-up{' back' if back else ''} ({follow.error:+.1%} off)")
        missed = state.miss_at(epoch)
        if gain > self.threshold and not gain > missed:
            assert state.miss is not None
            return replace(state, proposed=None), Verdict(adopt=False, why=(
                f"the last reverted move missed its prediction by {state.miss[0]:.1%} (epoch {state.miss[1]}); a move "
                f"must predict more than {missed:.1%} now (halved every {WORSE_EPOCHS} epochs)"))
        if not gain > self.threshold:
            # Nothing worth moving for: a small move proposed earlier is no longer pending confirmation.
            return replace(state, proposed=None), Verdict(adopt=False, why=f"below the threshold {self.threshold:.1%}")
        direction = tuple((b > a) - (b < a) for a, b in zip(current, candidate, strict=True))
        if not gain > noise and state.proposed != direction:
            # Heavy-tailed steps (a peer's stall, worker spin-up) can make one epoch's noise estimate exceed a real
            # gain; the same move proposed by two epochs in a row is evidence noise rarely gives, so it is adopted
            # on the second (and a trial that measures slower is still reverted).
            return replace(state, proposed=direction), Verdict(adopt=False, why=(
                f"within the measurement noise {noise:.1%} ({self.noise_sigmas:g} x relative std error); adopted "
                "if the next epoch proposes the same move"))
        if gain < self.confirm_below and state.proposed != direction:
            return replace(state, proposed=direction), Verdict(adopt=False, why=(
                f"under {self.confirm_below:.0%}, adopted only if the next epoch confirms it"))
        # This epoch's measured step is the yardstick the new plan's first epoch must not lose to.
        confirmed = state.proposed == direction
        return replace(state, proposed=None, trial=trial, last_move=move), Verdict(
            adopt=True, why="adopted", short="confirmed by a second epoch" if confirmed else "")

    @staticmethod
    def barred_by(state: PolicyState, current: Batches, candidate: Batches) -> Rejection | None:
        """The recent revert that rules out ``candidate``: the same batches, or (from the same plan) a move reaching
        at least ``WORSE_REACH`` of the way along the move that measured slower."""
        for r in state.rejections:
            if candidate == r.batch_sizes:
                return r
            if r.moved_from == current:
                # Project the candidate's move onto the rejected one: a shorter step the same way may still win.
                rejected = [d - s for s, d in zip(r.moved_from, r.batch_sizes, strict=True)]
                move = [c - s for s, c in zip(r.moved_from, candidate, strict=True)]
                norm2 = sum(x * x for x in rejected)
                if norm2 > 0 and sum(m * x for m, x in zip(move, rejected, strict=True)) >= WORSE_REACH * norm2:
                    return r
        return None
