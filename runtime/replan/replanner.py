"""The Replanner: one decision per epoch boundary -- check the stats, update the model, re-solve, ask the policy.

    1. refuse stats that are missing, NaN/inf/negative or from fewer than ``min_steps`` steps (the model stays)
    2. update the correction model (model.py) with every rank's stats
    3. a plan on trial that measured slower is reverted (policy.py); nothing else happens this epoch
    4. re-solve the corrected profile at the same global batch and min batch with the run's SolveOptions;
       refuse a re-solve that fails, changes the global batch, puts a rank below min batch, or is identical
    5. gain = T(old plan under the updated model) / T(new plan) - 1  (``planner.evaluate`` with the old batches
       and workers); the policy adopts or refuses it, with the reason logged (a kept trial that missed its
       prediction is followed up below the threshold: policy.py)
    6. a plan kept whose measured step is off its prediction (``policy.missed_prediction``) carries on with its
       prediction re-made under the updated model (same batches, workers and fingerprint: the run log's next
       epochs compare against what the model now says, not a number it has already seen fail)

Between 2 and 3 the era and the memory (policy.py, "Eras, memory and reversals"): a rank whose measured speed
changed beyond the noise starts a new era; the split that ran is remembered with its measured step, and step 5's
policy refuses a split the era measured slower, any move after the era's revert, and a move back against the era's
previous move.

A re-plan never ends the training: any exception inside a decision (the model, the solver, ``evaluate``, the
policy) restores the state from before it and returns the running plan kept, with ``warning`` saying why
(``re-plan failed, keeping the plan: <Type>: <message>``).  A solver that finds no plan (``PlanError``) is an
answer, not a failure: the plan is kept with the solver's reason and the epoch's measurements are learned.

Every decision carries its inputs (``ReplanDecision.inputs``: the state before it and every rank's stats), and
``describe()`` the configuration, so the run log replays each decision offline exactly
(``Replanner.from_description(d, plan)``, ``load_state_dict(inputs["state"])``, ``decide(inputs["stats"])``;
benchmarks/replan_replay.py).

``step`` runs the same on every rank through one collective exchange (exchange.py); ``decide`` is the local,
collective-free part.  The global batch never changes, so the sampler's coverage stays exactly-once.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields, replace
from typing import Any

from planner.errors import PlanError, ValidationError
from planner.plan import Plan
from planner.profile import Profile
from planner.solve import SolveOptions, evaluate, solve
from planner.stats import LOADER_WAIT_FRAC, StepStats
from runtime.replan.decision import FAILED, ReplanDecision
from runtime.replan.exchange import exchange_decision
from runtime.replan.model import (
    DEFAULT_SMOOTHING,
    DEVICE_CHANGE,
    CorrectionModel,
    Observation,
    RankCorrection,
    same_batch_changed,
)
from runtime.replan.policy import (
    AdoptionPolicy,
    Move,
    PolicyState,
    Rejection,
    SplitMeasure,
    Trial,
    changed_ranks,
    missed_prediction,
    recompile_charge,
)

_SOLVE_KEYS = frozenset(f.name for f in fields(SolveOptions)) - {"min_batch"}  # min_batch comes from the plan
_STATE_VERSION = 1
_STATS_FIELDS = ("data_wait_s", "compute_s", "step_time_s", "compute_s_std")
ERA_MISS = math.exp(DEVICE_CHANGE)
"""A trial's changed rank (``policy.changed_ranks``) starts a new era only this far (1.5x) over its prediction."""
_DESCRIPTION_KIND = "replanner_config"
_DESCRIPTION_VERSION = 1
_Snapshot = tuple[Any, ...]


class Replanner:
    """Keeps a plan matched to measured per-rank speeds across epochs.

    Args:
        profile: the profile the first plan was solved from (the model's shape; never modified).
        plan: the plan running now.
        threshold: minimum predicted throughput gain to switch plans (0.05 = 5 %); switching costs a sampler
            re-layout and, when worker counts change, new DataLoader workers.
        min_steps: epochs with fewer averaged steps are refused as too noisy.
        options: the ``planner.SolveOptions`` every re-solve uses (memory headroom, CPU reserve, worker cap, ...);
            default: the plan's own (``plan.options``).  ``global_batch`` and ``min_batch`` always come from the plan.
        solve_kwargs: the same as keywords (the older form); applied on top of ``options``.
        smoothing: EMA weight of the newest epoch in the scale factors (1.0 = trust the last epoch only); the
            default ``DEFAULT_SMOOTHING`` (0.8) and why: runtime/replan/model.py.
        noise_sigmas: the gain must also exceed this many relative standard errors of the noisiest rank.
        confirm_below: a gain under this (but over the threshold) is adopted only when the previous epoch proposed
            a move in the same direction too: one epoch disturbed by another process on the host must not move
            the plan, while a real slowdown (gains of 30-80% measured) is followed at once.
        loader_wait_frac: data wait above this fraction of the step counts as a loader that did not keep up.
        solve_fn: the solver (``planner.solve``); replaceable for heuristics and tests.  Called as
            ``solve_fn(profile, global_batch=..., min_batch=..., options=...)`` (and ``num_workers=...`` when
            ``follow_workers`` is False).
        follow_workers: the training loop rebuilds its DataLoader with an adopted plan's loader workers
            (`planner train` does).  False: the loop keeps the workers it has (an own loop, a framework's
            DataLoader), so a re-solve keeps each rank's workers as its stats report them (``planner.solve``'s
            ``num_workers``), and every prediction is for the workers that will run.
        recompile_s: seconds a rank takes to recompile its model at a batch size it has not run (torch.compile), one
            number for every rank or one per rank (None for a rank: no charge); default: the profile's compile record
            (``compile_record``), else none -- no charge.  A candidate that moves some rank to a micro-batch size it
            has not run is adopted only when its gain over the rest of the run saves more than the slowest such
            rank's recompile (policy.recompile_charge; the sizes a rank ran are remembered, dynamo keeps their
            graphs).  A rank whose epoch counted compile steps (``StepStats.compile_s``) after a change of its batch
            measured its recompile: that number replaces the one given.
        epochs: the run's epochs (``set_run_length``); the epochs left after epoch e's decision are epochs - e - 1.
            None: not known, the charge is weighed against one epoch's saving.
        steps_per_epoch: optimizer steps per epoch (None: each epoch's stats tell it, ``num_steps`` plus the steps
            the timer left out).
    """

    def __init__(
        self,
        profile: Profile,
        plan: Plan,
        *,
        threshold: float = 0.05,
        min_steps: int = 5,
        options: SolveOptions | None = None,
        solve_kwargs: Mapping[str, Any] | None = None,
        smoothing: float = DEFAULT_SMOOTHING,
        noise_sigmas: float = 2.0,
        confirm_below: float = 0.10,
        loader_wait_frac: float = LOADER_WAIT_FRAC,
        solve_fn: Callable[..., Plan] = solve,
        follow_workers: bool = True,
        recompile_s: float | Sequence[float | None] | None = None,
        epochs: int | None = None,
        steps_per_epoch: int | None = None,
    ) -> None:
        if plan.world_size != profile.world_size:
            raise ValidationError(
                f"the plan has {plan.world_size} ranks but the profile {profile.world_size}; "
                "re-run `planner plan` on this profile"
            )
        self._policy = AdoptionPolicy(threshold=threshold, noise_sigmas=noise_sigmas, confirm_below=confirm_below)
        if min_steps < 1:
            raise ValidationError(f"replan min_steps must be >= 1, got {min_steps}")
        if not 0.0 < smoothing <= 1.0:
            raise ValidationError(f"replan smoothing must be in (0, 1], got {smoothing}")
        kwargs = dict(solve_kwargs or {})
        bad = sorted(set(kwargs) - _SOLVE_KEYS)
        if bad:
            raise ValidationError(
                f"solve_kwargs: {', '.join(bad)} not accepted (global_batch and min_batch come from the plan); "
                f"allowed: {', '.join(sorted(_SOLVE_KEYS))}"
            )
        self.min_steps = min_steps
        self.follow_workers = bool(follow_workers)
        self.smoothing = smoothing
        self.loader_wait_frac = loader_wait_frac
        self._options = (options if options is not None else plan.options).with_overrides(
            {**kwargs, "min_batch": plan.min_batch})
        self._solve_fn = solve_fn
        self._plan = plan
        self._model = CorrectionModel.of(profile, self._options,
                                         workers=[r.num_workers for r in sorted(plan.ranks, key=lambda r: r.rank)])
        self._policy_state = PolicyState()
        self._previous: Plan | None = None
        """The plan the one on trial replaced (set exactly while ``_policy_state.trial`` is): restored on revert."""
        self._last_epoch: int | None = None
        self._era_ref: tuple[Observation | None, ...] = (None,) * plan.world_size
        """Per rank, its first measurement in this era at the batch it runs now (a drift from it beyond the noise
        starts a new era: policy.py, "era")."""
        self._workers = tuple(r.num_workers for r in sorted(plan.ranks, key=lambda r: r.rank))
        """The loader workers the model's starting loader costs were taken at (``describe``)."""
        record = compile_record(profile)
        self._recompile_s = _per_rank_seconds(recompile_s if recompile_s is not None else record[0], plan.world_size)
        """Per rank, its recompile seconds at a new batch size (None: no charge for it)."""
        self._compiled: tuple[frozenset[int], ...] = tuple(
            frozenset(r.micro_batches) | frozenset(record[1][r.rank]) for r in sorted(plan.ranks, key=lambda r: r.rank))
        """Per rank, the micro-batch sizes it has run (or the profile compiled): no recompile charged for them."""
        self.epochs: int | None = None
        self.steps_per_epoch: int | None = None
        self.set_run_length(epochs=epochs, steps_per_epoch=steps_per_epoch)

    def set_run_length(self, *, epochs: int | None = None, steps_per_epoch: int | None = None) -> None:
        """Tell the Replanner how long the run is (what a recompile's cost is weighed against); None keeps what it
        knew."""
        for name, v in (("epochs", epochs), ("steps_per_epoch", steps_per_epoch)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValidationError(f"replan {name} must be an integer >= 1, got {v!r}")
        self.epochs = epochs if epochs is not None else self.epochs
        self.steps_per_epoch = steps_per_epoch if steps_per_epoch is not None else self.steps_per_epoch

    @property
    def recompile_s(self) -> tuple[float | None, ...]:
        """Per rank, the recompile seconds a new batch size is charged (None: not charged)."""
        return self._recompile_s

    @property
    def compiled_sizes(self) -> tuple[frozenset[int], ...]:
        """Per rank, the micro-batch sizes it has run: a candidate returning to one is not charged."""
        return self._compiled

    # -- the model in use -------------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        return self._plan

    @property
    def threshold(self) -> float:
        return self._policy.threshold

    @property
    def noise_sigmas(self) -> float:
        return self._policy.noise_sigmas

    @property
    def confirm_below(self) -> float:
        return self._policy.confirm_below

    @property
    def scale_factors(self) -> tuple[float, ...]:
        return self._model.scale_factors

    @property
    def era(self) -> int:
        """How many times a rank's measured speed changed beyond the noise (policy.py, "era")."""
        return self._policy_state.era

    @property
    def loader_sec_per_sample(self) -> tuple[float, ...]:
        return self._model.loader_sec_per_sample

    def ratio(self, rank: int, batch_size: float) -> float:
        """The model's time over the original curve's at ``batch_size`` (see runtime/replan/model.py)."""
        return self._model.ratio(rank, batch_size)

    @property
    def profile(self) -> Profile:
        """The original profile with each rank's compute points corrected and loader costs raised as measured."""
        return self._model.corrected_profile()

    # -- the decision (no collectives) ------------------------------------------------------------------------
    def decide(self, stats: Sequence[StepStats], epoch: int) -> ReplanDecision:
        """Update the model from every rank's stats of `epoch` and decide whether to switch plans.

        Call once per epoch with all ranks' stats: accepted stats move the model (also when the plan is kept).
        Never raises: a failure inside keeps the plan and the state as they were, and says so in ``warning``.
        """
        snapshot = self._snapshot()
        try:
            inputs: dict[str, Any] | None = {"state": self.state_dict(), "stats": [s.to_dict() for s in stats]}
        except Exception:  # stats that are not StepStats: the decision below says what is wrong with them
            inputs = None
        try:
            decision = self._decide(stats, epoch)
        except Exception as e:  # a re-plan must never end the training (module docstring)
            self._restore(snapshot)
            decision = self.failed(stats, epoch, f"{type(e).__name__}: {e}")
        return replace(decision, inputs=inputs)

    def failed(self, stats: Sequence[StepStats], epoch: int, error: str) -> ReplanDecision:
        """The decision that keeps the running plan because the re-plan failed with ``error`` ("Type: message")."""
        try:
            measured = tuple(float(s.compute_s) for s in sorted(stats, key=lambda s: s.rank))
        except Exception:
            measured = ()
        warning = FAILED + error
        return ReplanDecision(epoch=epoch, adopted=False, reason=warning, old_plan=self._plan, new_plan=None,
                              predicted_gain=None, measured_compute_s=measured, predicted_compute_s=(),
                              scale_factors=self.scale_factors, warning=warning, brief=error)

    def _snapshot(self) -> _Snapshot:
        """Everything ``decide`` may change (immutable values: restoring them is exact)."""
        return (self._plan, self._model, self._policy_state, self._previous, self._last_epoch, self._era_ref,
                self._compiled, self._recompile_s)

    def _restore(self, snapshot: _Snapshot) -> None:
        (self._plan, self._model, self._policy_state, self._previous, self._last_epoch, self._era_ref,
         self._compiled, self._recompile_s) = snapshot

    def _decide(self, stats: Sequence[StepStats], epoch: int) -> ReplanDecision:
        old = self._plan
        measured = tuple(float(s.compute_s) for s in sorted(stats, key=lambda s: s.rank))
        problem = self._check_stats(stats, epoch)
        if problem is not None:
            return ReplanDecision(epoch=epoch, adopted=False, reason=problem, old_plan=old, new_plan=None,
                                  predicted_gain=None, measured_compute_s=measured, predicted_compute_s=(),
                                  scale_factors=self.scale_factors, brief=problem)
        by_rank = sorted(stats, key=lambda s: s.rank)
        self._learn_compiles(old, by_rank)
        steps = old.accumulation_steps
        predicted = tuple(self._model.span_s(i, s.batch_size, k)  # as measured
                          for i, (s, k) in enumerate(zip(by_rank, steps, strict=True)))
        self._model, device = self._model.updated_and_changed(
            by_rank, smoothing=self.smoothing, loader_wait_frac=self.loader_wait_frac, micro_steps=steps)
        self._last_epoch = epoch
        step_s = max(s.step_time_s for s in by_rank)  # the synchronous step waits for the slowest rank
        noise = self._policy.noise(by_rank)
        step_noise = max(noise, self._policy.revert_noise(by_rank))

        # A rank the trial did not load more, slower than predicted at its batch: the ranks changed, not the split
        # (policy module docstring), so a slower step does not revert the trial.
        changed = changed_ranks(self._policy_state.trial, [s.batch_size for s in by_rank], measured, predicted, noise)
        note = "" if not changed else (
            f"rank{'s' if len(changed) > 1 else ''} {', '.join(map(str, changed))} ran "
            + ", ".join(f"{measured[i] / predicted[i]:.2f}x" for i in changed)
            + " the predicted compute at a batch the last change did not raise: the ranks changed, so the step is "
              "not compared with the plan before; ")
        # The era (policy.py): a rank whose measured speed changed makes every measured split of the era stale.
        # A trial's changed rank counts when its miss is past what the model's extrapolation to a batch it has not
        # measured can leave: the uniform correction reads a multiplicative slowdown as partly per-sample, and
        # under-predicts it below the batch it measured by 7-10% (a 4x slower rank on 50 ms + 1 ms a sample, moved
        # from 15 to 12 samples, ran 10% over; read as a speed change it re-opened a move back that measured 31%
        # slower).  A device change is DEVICE_CHANGE (1.5x) off the model.
        far = [i for i in changed if measured[i] > predicted[i] * max(ERA_MISS, 1.0 + noise)]
        moved = sorted({*device, *far, *self._drifted(by_rank)})
        era_note = ""
        if moved:
            self._policy_state = self._policy.new_era(self._policy_state, epoch)
            self._era_ref = (None,) * old.world_size
            era_note = (f" [rank{'s' if len(moved) > 1 else ''} {', '.join(map(str, moved))} changed speed: era "
                        f"{self._policy_state.era}, splits measured before are not compared]")
        # Exposed communication (model.py): the step the split measured beyond what the updated model gives it,
        # taken whole in a new era (the ranks changed, so did what their steps wait on).
        self._model = self._learned_exposed(old, step_s, 1.0 if moved else self.smoothing)
        self._era_ref = tuple(ref if ref is not None and ref.batch_size == r.observations[-1].batch_size
                              else r.observations[-1] for ref, r in zip(self._era_ref, self._model.ranks, strict=True))
        self._policy_state = self._policy.remember(
            self._policy_state, epoch=epoch, batch_sizes=old.batch_sizes, step_s=step_s, noise=step_noise,
            workers=tuple(r.num_workers for r in old.ranks), accumulation_steps=old.accumulation_steps)
        worst = max(range(old.world_size), key=lambda i: abs(math.log(measured[i] / predicted[i]))
                    if predicted[i] > 0 else 0.0)
        deviation = (f"rank {worst} measured {measured[worst] / predicted[worst]:.2f}x its predicted compute"
                     if predicted[worst] > 0 else "")

        def outcome(reason: str, new: Plan | None = None, gain: float | None = None,
                    candidate: Plan | None = None, reverted: bool = False,
                    repredicted: Plan | None = None, brief: str = "") -> ReplanDecision:
            reason = note + reason + era_note
            return ReplanDecision(epoch=epoch, adopted=new is not None, reason=reason, old_plan=old, new_plan=new,
                                  predicted_gain=gain, measured_compute_s=measured, predicted_compute_s=predicted,
                                  candidate=candidate, scale_factors=self.scale_factors, reverted=reverted,
                                  repredicted=repredicted, brief=brief or reason)

        self._policy_state, revert = self._policy.check_trial(
            self._policy_state, epoch=epoch, batch_sizes=old.batch_sizes, step_s=step_s, noise=step_noise,
            conditions_changed=bool(changed))
        previous, self._previous = self._previous, None
        if revert is not None:
            assert previous is not None and previous.batch_sizes == revert.trial.previous
            self._plan = replace(previous, meta={**previous.meta, "reverted_at_epoch": epoch})
            return outcome(revert.reason(), new=self._plan, reverted=True, brief=f"measured {revert.slower:.1%} slower")

        profile = self.profile
        back = self._policy.fallback(self._policy_state, old.batch_sizes)
        if back is not None:  # the split measured slower than the era's best over its epochs: back to the best
            best, lost = back
            restored = evaluate(profile, best.batch_sizes, best.accumulation_steps, num_workers=list(best.workers),
                                options=self._options)
            self._plan = replace(restored, meta={**restored.meta, "reverted_at_epoch": epoch})
            self._policy_state = replace(self._policy_state, reversal=epoch, last_move=None, proposed=None)
            now = self._policy_state.measure_of(old.batch_sizes)
            assert now is not None
            return outcome(f"reverted: batches {list(old.batch_sizes)} measured {now.step_s * 1e3:.4g} ms per step "
                           f"over {now.epochs} epochs, {lost:.1%} slower than the {best.step_s * 1e3:.4g} ms of "
                           f"{list(best.batch_sizes)} in the same conditions; back to {list(best.batch_sizes)}",
                           new=self._plan, reverted=True,
                           brief=f"measured {lost:.1%} slower over {now.epochs} epochs than {list(best.batch_sizes)}")
        # The running plan under the updated model: the gain's baseline, and its prediction if it is kept.
        try:
            old_eval: Plan | None = evaluate(profile, old.batch_sizes, old.accumulation_steps,
                                             num_workers=[r.num_workers for r in old.ranks], options=self._options)
        except (PlanError, ValidationError):
            old_eval = None

        def kept(reason: str, gain: float | None = None, candidate: Plan | None = None,
                 brief: str = "") -> ReplanDecision:
            """The plan stays; re-predicted under the updated model when its measured step missed (step 6)."""
            self._policy_state = replace(self._policy_state, missed_trial=None)
            brief = brief or reason
            if old_eval is None or not missed_prediction(step_s, old.predicted.step_time_s, step_noise):
                return outcome(reason, gain=gain, candidate=candidate, brief=brief)
            again = self._repredicted(old, old_eval, epoch)
            self._plan = again
            return outcome(f"{reason}; the plan measured {step_s * 1e3:.4g} ms per step against "
                           f"{old.predicted.step_time_s * 1e3:.4g} ms predicted, its prediction is now "
                           f"{again.predicted.step_time_s * 1e3:.4g} ms", gain=gain, candidate=candidate,
                           repredicted=again, brief=f"{brief}; measured {step_s * 1e3:.4g} ms, prediction now "
                                                    f"{again.predicted.step_time_s * 1e3:.4g} ms")

        # A loop that keeps its DataLoader runs the workers its stats report, whatever a plan says (the argument's
        # docstring); with accumulation the solve picks micro-steps freely and is re-evaluated at those workers.
        fixed = None if self.follow_workers else [int(s.num_workers) for s in by_rank]
        try:
            if fixed is None or any(k > 1 for k in old.accumulation_steps):
                cand = self._solve_fn(profile, global_batch=old.global_batch, min_batch=old.min_batch,
                                      options=self._options)
                if fixed is not None and [r.num_workers for r in cand.ranks] != fixed:
                    cand = replace(evaluate(profile, cand.batch_sizes, cand.accumulation_steps, num_workers=fixed,
                                            options=self._options), solver=cand.solver)
            else:
                cand = self._solve_fn(profile, global_batch=old.global_batch, min_batch=old.min_batch,
                                      options=self._options, num_workers=fixed)
        except PlanError as e:  # the solver's answer (no plan fits), not a failure of the re-plan
            return kept(f"re-solve failed, keeping the plan: {e}", brief=f"no plan fits: {e}")
        if cand.world_size != old.world_size or cand.global_batch != old.global_batch:
            return kept(
                f"re-solved plan has world size {cand.world_size} / global batch {cand.global_batch}, "
                f"the run has {old.world_size} / {old.global_batch}: refused (the global batch never changes)",
                candidate=cand, brief="the re-solve changed the world size or global batch: refused",
            )
        starved = [(r.rank, r.batch_size) for r in cand.ranks if r.batch_size < old.min_batch]
        if starved:
            listed = ", ".join(f"rank {i} at {b}" for i, b in starved)
            return kept(f"re-solved plan puts {listed} below min batch {old.min_batch}: refused", candidate=cand)
        if cand.fingerprint == old.fingerprint or old_eval is None:
            return kept("re-solved plan is identical to the current one" if old_eval is not None else
                        "the running plan cannot be evaluated under the updated model", gain=0.0, candidate=cand)
        # Both times under the same updated model: the gain compares plans, not the model with the profile.
        t_old, t_new = old_eval.predicted.step_time_s, cand.predicted.step_time_s
        gain = t_old / t_new - 1.0
        numbers = (f"predicted step {t_old * 1e3:.4g} ms -> {t_new * 1e3:.4g} ms, gain {gain:.1%}; "
                   f"batches {list(old.batch_sizes)} -> {list(cand.batch_sizes)}")
        old_w, new_w = [r.num_workers for r in old.ranks], [r.num_workers for r in cand.ranks]
        if old_w != new_w:  # loader workers follow the step (planner._search.SPARE_LOADER_SHARE)
            numbers += f", loader workers {old_w} -> {new_w}"
        judged, verdict = self._policy.judge(
            self._policy_state, epoch=epoch, current=old.batch_sizes, candidate=cand.batch_sizes, gain=gain,
            noise=noise, step_s=step_s, predicted_step_s=t_new)
        if not verdict.adopt:
            self._policy_state = judged
            return kept(f"{numbers}: {verdict.why}", gain=gain, candidate=cand,
                        brief=f"{list(cand.batch_sizes)} predicted {gain:+.1%}: {verdict.brief}")
        # A compiled model recompiles at a shape it has not run: the gain must pay for it over the epochs left
        # (policy.recompile_charge); refused, the policy's state stays as before the judgement (no trial begins).
        charge = recompile_charge(
            recompile_s=self._recompile_s, compiled=self._compiled, candidate_micro=[r.micro_batches for r in cand.ranks],
            t_old_s=t_old, t_new_s=t_new, steps_per_epoch=self._steps_per_epoch(by_rank),
            epochs_left=None if self.epochs is None else self.epochs - epoch - 1)
        if not charge.worth:
            return kept(f"{numbers}: {charge.describe()}: not adopted, the recompile costs more than the gain saves",
                        gain=gain, candidate=cand,
                        brief=f"{list(cand.batch_sizes)} predicted {gain:+.1%}: recompiling {charge.charge_s:.3g} s "
                              f"> {charge.saved_s:.3g} s saved")
        self._policy_state = judged
        self._plan = replace(cand, meta={**cand.meta, "replanned_at_epoch": epoch})
        self._previous = old
        why = verdict.why if charge.charge_s <= 0 else f"{verdict.why}; {charge.describe()}"
        return outcome(f"{numbers}: {why}", new=self._plan, gain=gain, candidate=cand,
                       brief="; ".join(x for x in (verdict.short, deviation) if x))

    def _steps_per_epoch(self, by_rank: Sequence[StepStats]) -> int:
        """Optimizer steps per epoch: as told (``set_run_length``), else what the epoch's stats counted (the steps
        averaged and those the timer left out as warm-up, outliers or compile)."""
        if self.steps_per_epoch is not None:
            return self.steps_per_epoch
        return max(s.num_steps + s.num_outliers + s.fill_steps + s.compile_steps for s in by_rank)

    def _learn_compiles(self, old: Plan, by_rank: Sequence[StepStats]) -> None:
        """The sizes each rank ran this epoch are compiled now; a rank whose epoch counted compile time at a size
        it had not run before measured its recompile (``StepStats.compile_s``)."""
        seconds = list(self._recompile_s)
        compiled = []
        for r, s, done in zip(sorted(old.ranks, key=lambda r: r.rank), by_rank, self._compiled, strict=True):
            sizes = frozenset(r.micro_batches)
            if s.compile_s > 0 and not sizes <= done:
                seconds[r.rank] = float(s.compile_s)
            compiled.append(done | sizes)
        self._compiled, self._recompile_s = tuple(compiled), tuple(seconds)

    def _learned_exposed(self, plan: Plan, step_s: float, weight: float) -> CorrectionModel:
        """The model with its exposed communication moved by ``weight`` of the step ``plan`` measured (``step_s``)
        beyond the model's prediction for it (model.py, "Exposed communication")."""
        if plan.world_size < 2:
            return self._model
        try:
            now = evaluate(self._model.corrected_profile(), plan.batch_sizes, plan.accumulation_steps,
                           num_workers=[r.num_workers for r in plan.ranks], options=self._options)
        except (PlanError, ValidationError):
            return self._model
        return self._model.with_exposed_miss(step_s - now.predicted.step_time_s, weight)

    def _drifted(self, by_rank: Sequence[StepStats]) -> list[int]:
        """The ranks whose ratio at the batch they ran has moved from the era's first measurement there by more
        than ``SAME_BATCH_CHANGE`` and the noise (a change too gradual for the model's epoch-to-epoch rule)."""
        out = []
        for i, (ref, r, s) in enumerate(zip(self._era_ref, self._model.ranks, by_rank, strict=True)):
            now = r.observations[-1] if r.observations else None
            if ref is not None and now is not None and ref.batch_size == now.batch_size \
                    and same_batch_changed(now.ratio, ref.ratio, s):
                out.append(i)
        return out

    @staticmethod
    def _repredicted(plan: Plan, evaluated: Plan, epoch: int) -> Plan:
        """``plan`` with the per-rank and step predictions of ``evaluated`` (the same batches, micro-steps and
        workers under the updated model): what it runs is unchanged, so is its fingerprint."""
        ranks = tuple(replace(evaluated.ranks[r.rank], device=r.device or evaluated.ranks[r.rank].device,
                              host=r.host or evaluated.ranks[r.rank].host) for r in plan.ranks)
        again = replace(plan, ranks=ranks, predicted=evaluated.predicted,
                        meta={**plan.meta, "repredicted_at_epoch": epoch})
        assert again.fingerprint == plan.fingerprint, (again.fingerprint, plan.fingerprint)
        return again

    def _check_stats(self, stats: Sequence[StepStats], epoch: int) -> str | None:
        """Why these stats cannot be used (None when they can): refusing beats re-planning on garbage."""
        W = self._plan.world_size
        ids = sorted(s.rank for s in stats)
        if ids != list(range(W)):
            return f"need stats from ranks 0..{W - 1} exactly once, got ranks {ids}: refused"
        if self._last_epoch is not None and epoch <= self._last_epoch:
            return f"epoch {epoch} was already decided (last {self._last_epoch}): refused"
        for s in sorted(stats, key=lambda s: s.rank):
            for name in _STATS_FIELDS:
                v = getattr(s, name)
                if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                    return f"rank {s.rank} reported {name}={v}: non-finite or negative measurement, refused"
            if s.num_steps < self.min_steps:
                return f"rank {s.rank} averaged {s.num_steps} steps, fewer than min_steps {self.min_steps}: refused"
            if s.compute_s <= 0 or s.batch_size < 1:
                return f"rank {s.rank} reported compute_s={s.compute_s} at batch {s.batch_size}: refused"
        return None

    # -- the collective ------------------------------------------------------------------------------------
    def step(self, local_stats: StepStats, epoch: int, *, group: Any = None) -> ReplanDecision:
        """All-gather every rank's stats, decide on rank 0, broadcast; every rank returns the same decision.

        Without an initialized process group (one process) it decides locally.  Every rank leaves with the same
        plan and model state, checked by fingerprint; a disagreement raises on every rank instead of hanging.
        The caller then applies ``decision.batch_sizes`` (``sampler.set_batch_sizes``) before the next epoch;
        when the adopted plan changes ``num_workers`` the DataLoader must be rebuilt to follow it.  With NCCL the
        exchange uses the current CUDA device: call ``torch.cuda.set_device`` first (every DDP script does).
        """
        return exchange_decision(self, local_stats, epoch, group)

    # -- checkpointing ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The current plan and the model's corrections (JSON-able), so a resumed run continues re-planning."""
        ps, trial = self._policy_state, self._policy_state.trial
        return {
            "version": _STATE_VERSION,
            "kind": "replanner",
            "plan": self._plan.to_dict(),
            "compute_scale": list(self.scale_factors),
            "loader_sec_per_sample": list(self.loader_sec_per_sample),
            "handover_s_per_sample": [r.handover_s for r in self._model.ranks],
            "exposed_extra_s": self._model.exposed_extra_s,
            "last_epoch": self._last_epoch,
            "proposed_direction": None if ps.proposed is None else list(ps.proposed),
            "profile_fingerprint": self._model.base.fingerprint(),
            "observations": [[[o.batch_size, o.ratio] for o in r.observations] for r in self._model.ranks],
            "revert": None if trial is None or self._previous is None else {
                "plan": self._previous.to_dict(), "step_time_s": trial.previous_step_s, "epoch": trial.adopted_at,
                "predicted_gain": trial.predicted_gain, "predicted_step_s": trial.predicted_step_s},
            "measured_worse": [{"from": list(r.moved_from), "to": list(r.batch_sizes), "epoch": r.epoch}
                               for r in ps.rejections],
            "model_miss": None if ps.miss is None else {"miss": ps.miss[0], "epoch": ps.miss[1]},
            # The era and its memory (policy.py): what decide() compares measurements with.
            "era": ps.era,
            "era_since": ps.era_since,
            "measured_splits": [{"batch_sizes": list(m.batch_sizes), "step_time_s": m.step_s, "noise": m.noise,
                                 "epochs": m.epochs, "epoch": m.epoch, "spread": m.spread,
                                 "workers": list(m.workers), "accumulation_steps": list(m.accumulation_steps)}
                                for m in ps.measured],
            "last_move": None if ps.last_move is None else {"delta": list(ps.last_move.delta),
                                                           "epoch": ps.last_move.epoch},
            "reversal_epoch": ps.reversal,
            "era_reference": [None if o is None else [o.batch_size, o.ratio] for o in self._era_ref],
            "compiled_sizes": [sorted(c) for c in self._compiled],
            "recompile_s": list(self._recompile_s),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned (on a Replanner built from the same profile).

        Everything is checked before anything is changed: a state that fails leaves this Replanner as it was.
        """
        if state.get("kind") != "replanner" or state.get("version") != _STATE_VERSION:
            raise ValidationError(
                f"not a replanner state (kind={state.get('kind')!r}, version={state.get('version')!r}); "
                f"expected kind 'replanner' version {_STATE_VERSION}"
            )
        plan = Plan.from_dict(state["plan"], path="replanner.plan")
        base = self._model.base
        W = base.world_size
        scale = [float(x) for x in state["compute_scale"]]
        spp = [float(x) for x in state["loader_sec_per_sample"]]
        if plan.world_size != W or len(scale) != W or len(spp) != W:
            raise ValidationError(
                f"replanner state is for {plan.world_size} ranks ({len(scale)} scale factors) but the profile has "
                f"{W}: resume with the same cluster or start re-planning afresh"
            )
        if not all(math.isfinite(x) and x > 0 for x in scale) or not all(math.isfinite(x) and x >= 0 for x in spp):
            raise ValidationError(f"replanner state has invalid factors {scale} / loader costs {spp}")
        if state.get("profile_fingerprint") not in (None, base.fingerprint()):
            warnings.warn("replanner state was saved with another profile; its scale factors are applied to this "
                          "one's curves", stacklevel=2)
        last = state.get("last_epoch")
        proposed = state.get("proposed_direction")
        # Optional (states written before the shape correction lack them: they resume with an empty history).
        raw_obs = state.get("observations") or [[] for _ in range(W)]
        if len(raw_obs) != W:
            raise ValidationError(f"replanner state has observations for {len(raw_obs)} ranks, the profile {W}")
        obs = [[(int(b), float(r)) for b, r in o][-2:] for o in raw_obs]
        if not all(b >= 1 and math.isfinite(r) and r > 0 for o in obs for b, r in o):
            raise ValidationError(f"replanner state has invalid observations {obs}")
        # Optional too (older states without it resume with the profile's hand-over costs).
        handover = [float(x) for x in state.get("handover_s_per_sample") or [r.handover_s for r in self._model.ranks]]
        if len(handover) != W or not all(math.isfinite(x) and x >= 0 for x in handover):
            raise ValidationError(f"replanner state has invalid hand-over costs {handover} for {W} ranks")
        rev = state.get("revert")
        previous = None if rev is None else Plan.from_dict(rev["plan"], path="replanner.revert.plan")
        trial = None if rev is None or previous is None else Trial(
            previous=previous.batch_sizes, previous_step_s=float(rev["step_time_s"]), adopted_at=int(rev["epoch"]),
            predicted_gain=float(rev.get("predicted_gain", 0.0)),
            predicted_step_s=float(rev.get("predicted_step_s", 0.0)))
        rejections = tuple(Rejection(moved_from=tuple(int(x) for x in w["from"]),
                                     batch_sizes=tuple(int(x) for x in w["to"]), epoch=int(w["epoch"]))
                           for w in state.get("measured_worse") or [])
        # The era's memory (optional: a state written before it resumes in a fresh era with nothing measured).
        splits = tuple(SplitMeasure(batch_sizes=tuple(int(x) for x in m["batch_sizes"]),
                                    step_s=float(m["step_time_s"]), noise=float(m["noise"]),
                                    epochs=int(m.get("epochs", 1)), epoch=int(m.get("epoch", 0)),
                                    spread=float(m.get("spread", 0.0)),
                                    workers=tuple(int(x) for x in m.get("workers") or ()),
                                    accumulation_steps=tuple(int(x) for x in m.get("accumulation_steps") or ()))
                       for m in state.get("measured_splits") or [])
        if not all(len(m.batch_sizes) == W and math.isfinite(m.step_s) and m.step_s >= 0 and math.isfinite(m.noise)
                   and m.epochs >= 1 for m in splits):
            raise ValidationError(f"replanner state has invalid measured splits {state.get('measured_splits')}")
        lm = state.get("last_move")
        last_move = None if not lm else Move(delta=tuple(int(x) for x in lm["delta"]), epoch=int(lm["epoch"]))
        if last_move is not None and len(last_move.delta) != W:
            raise ValidationError(f"replanner state has a last move {lm} for another world size than {W}")
        raw_ref = state.get("era_reference") or [None] * W
        if len(raw_ref) != W:
            raise ValidationError(f"replanner state has era references for {len(raw_ref)} ranks, the profile {W}")
        era_ref = tuple(None if o is None else Observation(batch_size=int(o[0]), ratio=float(o[1])) for o in raw_ref)
        era_since, reversal = state.get("era_since"), state.get("reversal_epoch")
        # Optional (a state written before it resumes with none learned).
        extra = state.get("exposed_extra_s") or 0.0
        if not (isinstance(extra, (int, float)) and not isinstance(extra, bool) and math.isfinite(extra)
                and extra >= 0):
            raise ValidationError(f"replanner state has an invalid exposed_extra_s {extra!r} (a time >= 0)")
        # Optional (a state written before compile charging resumes with the sizes and times it was built with).
        raw_compiled = state.get("compiled_sizes")
        compiled = self._compiled if raw_compiled is None else tuple(frozenset(int(b) for b in c) for c in raw_compiled)
        if len(compiled) != W or not all(b >= 1 for c in compiled for b in c):
            raise ValidationError(f"replanner state has invalid compiled sizes {raw_compiled} for {W} ranks")
        raw_recompile = state.get("recompile_s")
        recompile = self._recompile_s if raw_recompile is None else _per_rank_seconds(raw_recompile, W)

        self._plan = plan
        self._model = self._model.with_ranks([
            RankCorrection(scale=f, loader_sec_per_sample=p,
                           observations=tuple(Observation(batch_size=b, ratio=r) for b, r in o), handover_s=h)
            for f, p, o, h in zip(scale, spp, obs, handover, strict=True)])
        self._model = replace(self._model, exposed_extra_s=float(extra))
        self._last_epoch = None if last is None else int(last)
        self._policy_state = PolicyState(proposed=None if proposed is None else tuple(int(x) for x in proposed),
                                         trial=trial, rejections=rejections,
                                         miss=None if not state.get("model_miss") else (
                                             float(state["model_miss"]["miss"]), int(state["model_miss"]["epoch"])),
                                         era=int(state.get("era") or 0),
                                         era_since=None if era_since is None else int(era_since),
                                         measured=splits, last_move=last_move,
                                         reversal=None if reversal is None else int(reversal))
        self._previous = previous
        self._era_ref = era_ref
        self._compiled, self._recompile_s = compiled, recompile

    # -- the configuration (for an exact offline replay) ---------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """This Replanner's configuration, JSON-able: with a decision's ``inputs`` it replays the decision exactly
        (``from_description``).  The run log's start record carries it (``StartRecord.replanner``)."""
        return {
            "kind": _DESCRIPTION_KIND,
            "version": _DESCRIPTION_VERSION,
            "profile": self._model.base.to_dict(),
            "threshold": self.threshold,
            "noise_sigmas": self.noise_sigmas,
            "confirm_below": self.confirm_below,
            "min_steps": self.min_steps,
            "smoothing": self.smoothing,
            "loader_wait_frac": self.loader_wait_frac,
            "options": self._options.to_dict(),
            "model_workers": list(self._workers),
            "follow_workers": self.follow_workers,
            "recompile_s": list(self._recompile_s),
            "epochs": self.epochs,
            "steps_per_epoch": self.steps_per_epoch,
            # Informational: a replay solves with planner.solve unless given the same function.
            "solve_fn": f"{getattr(self._solve_fn, '__module__', '?')}.{getattr(self._solve_fn, '__qualname__', '?')}",
        }

    @classmethod
    def from_description(cls, d: Mapping[str, Any], plan: Plan, *,
                         solve_fn: Callable[..., Plan] = solve) -> Replanner:
        """The Replanner ``describe()`` described, running ``plan`` (the run's first: its loader workers are the
        model's starting point unless the description names them)."""
        if d.get("kind") != _DESCRIPTION_KIND or d.get("version") != _DESCRIPTION_VERSION:
            raise ValidationError(f"not a replanner description (kind={d.get('kind')!r}, version={d.get('version')!r})")
        profile = Profile.from_dict(d["profile"], path="replanner.profile")
        rp = cls(profile, plan, threshold=float(d["threshold"]), min_steps=int(d["min_steps"]),
                 options=SolveOptions.from_dict(d["options"], path="replanner.options"),
                 smoothing=float(d["smoothing"]), noise_sigmas=float(d["noise_sigmas"]),
                 confirm_below=float(d["confirm_below"]), loader_wait_frac=float(d["loader_wait_frac"]),
                 solve_fn=solve_fn, follow_workers=bool(d.get("follow_workers", True)),
                 recompile_s=d.get("recompile_s"), epochs=d.get("epochs"), steps_per_epoch=d.get("steps_per_epoch"))
        workers = tuple(int(w) for w in d.get("model_workers") or rp._workers)
        if workers != rp._workers:
            rp._workers = workers
            rp._model = CorrectionModel.of(profile, rp._options, workers=list(workers))
        return rp


def compile_record(profile: Profile) -> tuple[list[float | None] | None, list[tuple[int, ...]]]:
    """(per-rank recompile seconds, per-rank batch sizes compiled) from each rank's compile record
    ``ranks[i].meta["compile"]`` (``planner profile --compile``, profiler.compiled; docs/DESIGN.md).

    The sizes are the record's ``sizes`` (run compiled: not charged).  The seconds a new size costs: with the
    batch dimension dynamic (``dynamic == "batch"``) the record's ``recompile_s`` (0.0: the dynamic graph serves
    every size); otherwise every new size compiles a graph, which costs the ``recompile_s`` measured at a later
    size, or ``first_s`` where no later size was run.  (None, no sizes) for a profile without records; a rank
    without one (or one this version cannot read) is None: not charged."""
    W = profile.world_size
    seconds: list[float | None] = [None] * W
    sizes: list[tuple[int, ...]] = [() for _ in range(W)]

    def sizes_of(v: Any) -> tuple[int, ...]:
        if not isinstance(v, Sequence) or isinstance(v, str):
            return ()
        return tuple(int(b) for b in v if isinstance(b, int) and not isinstance(b, bool) and b >= 1)

    def seconds_of(v: Any) -> float | None:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
        return float(v) if ok else None

    for rp in profile.by_rank:
        rec = rp.meta.get("compile") if isinstance(rp.meta, Mapping) else None
        if not isinstance(rec, Mapping) or not 0 <= rp.rank < W:
            continue
        sizes[rp.rank] = sizes_of(rec.get("sizes"))
        recompile = seconds_of(rec.get("recompile_s"))
        if rec.get("dynamic") != "batch" and not sizes_of(rec.get("recompiled_sizes")):
            recompile = seconds_of(rec.get("first_s"))  # static shapes: a new size compiles as the first one did
        seconds[rp.rank] = recompile
    return (None if all(x is None for x in seconds) else seconds), sizes


def _per_rank_seconds(value: float | Sequence[float | None] | None, world_size: int) -> tuple[float | None, ...]:
    """``recompile_s`` as one entry per rank (None: not charged); a bad value is a ValidationError with the fix."""
    if value is None:
        return (None,) * world_size
    per = [value] * world_size if isinstance(value, (int, float)) else list(value)
    if len(per) != world_size or not all(
            v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0)
            for v in per):
        raise ValidationError(f"recompile_s must be seconds >= 0, one number or one per rank ({world_size}), "
                              f"got {value!r}")
    return tuple(None if v is None else float(v) for v in per)
