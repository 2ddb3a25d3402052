"""Re-planning at epoch boundaries: update the per-rank model from what the ranks measured, re-solve, adopt.

Model update (rank i ran batch b_i and measured mean compute c_i, data wait d_i, step time s_i):

    raw_i     = c_i / t0_i(b_i)                    t0_i = envelope fitted to the ORIGINAL profile's points
    factor_i <- (1 - a) * factor_i + a * raw_i     EMA, a = `smoothing` (0.5); factor_i starts at 1 (trust the
                                                   profile as much as one epoch), so one noisy epoch moves the
                                                   model only half way
    points_i  = original compute points, step_time_s * factor_i      (same curve shape, rescaled)

Shape correction: a profile's curve can be right at one batch size and off in slope elsewhere -- e.g. near the
knee where a launch-bound GPU turns compute-bound, a uniformly rescaled curve then sends too much work to a rank
(measured on 2x H200, ResNet-50, emulated 3x rank: the re-plan moved 38 samples and the step got 4% slower).
So once a rank has been measured at two different batch sizes b1 < b2 (times c1 < c2; the latest measurement
at each of the two most recent batch sizes; a batch size measured >10% off its previous time clears the history),
with raw ratios r1, r2 within a factor 2 of each other (beyond that the device itself changed, e.g. a
co-tenant came, and the uniform factor above applies), each original point time t becomes

    alpha * t + beta      alpha, beta: the affine map of the original curve through (b1, c1) and (b2, c2)
    r1 * t  for b <= b1   when beta <= 0 (truly steeper than profiled), else
    r2 * t  for b >= b2   (truly flatter)

which passes through both measurements, stays convex and positive, and keeps the profile's shape beyond them.

Measured, not predicted, has the last word: after a plan is adopted, its first epoch's step time (slowest rank)
is compared with the previous plan's last epoch; if it is slower by more than max(1%, noise) the previous plan
comes back at once ("reverted", logged), and for 5 epochs neither the rejected batch sizes nor a move from the
restored plan that reaches 3/4 of the way toward them is adopted (a shorter move in that direction still is).

Loader: when d_i / s_i > `loader_wait_frac` the loader did not keep up.  With w_i workers a loader-bound rank
runs one step per b_i * p_i / w_i seconds, which the loop saw as c_i + d_i, so the effective cost per sample is

    p_i = (c_i + d_i) * w_i / b_i      (w_i >= 1)        p_i = d_i / b_i      (w_i = 0: loaded in the loop)

smoothed the same way and only ever raised (a loader that keeps up hides its true cost, so a small wait is no
evidence that it got faster).  The scaled points and loader costs form a new ``planner.Profile`` -- the profile
in use stays the one source of truth -- which ``planner.solve`` re-solves at the same global batch and min batch.

Adoption (after AdaptDL's ``_sync_local_bsz``: decide on rank 0, broadcast, change only above a threshold):

    gain = T(old plan under the updated model) / T(new plan) - 1      (``planner.evaluate`` with the old
                                                                        batches and workers)
    adopt iff  gain > threshold  and  gain > noise_sigmas * max_i (std_i / sqrt(n_i)) / c_i

Refused, with the reason logged: stats that are missing, NaN/inf/negative or from fewer than ``min_steps``
steps; a re-solve that fails; a plan that changes the global batch or puts a rank below min batch; a plan
identical to the current one.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from planner.curves import fit_envelope
from planner.errors import PlanError, ValidationError
from planner.plan import Plan
from planner.profile import ComputePoint, LoaderProfile, Profile
from planner.solve import SolveOptions, evaluate, solve
from planner.stats import StepStats

# solve() options that also apply when evaluating the old plan under the updated model.
_SOLVE_KEYS = frozenset(f.name for f in fields(SolveOptions)) - {"min_batch"}  # min_batch comes from the plan
_EVAL_KEYS = _SOLVE_KEYS - {"time_limit_s", "min_gain"}  # evaluate() scores a given split: no search options
_STATE_VERSION = 1
_SHAPE_MAX_LOG = math.log(2.0)
"""Two measured ratios further apart than 2x mean the device changed, not the curve's shape (a knee between a
launch-bound floor and the linear part can make them differ by 1.5x)."""
_WORSE_REACH = 0.75
"""After a revert, a move from the same plan that goes at least this far along the rejected move is refused."""
_SAME_BATCH_CHANGE = math.log(1.10)
"""The same batch size measured more than 10% off its last time: the device changed; its history is dropped."""
_WORSE_MARGIN = 0.01
"""A newly adopted plan measured this much slower (or more, with noise) than its predecessor is reverted."""
_WORSE_EPOCHS = 5
"""Epochs for which batch sizes that measured worse are not adopted again."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplanDecision:
    """What the re-planner decided at one epoch boundary (identical on every rank after ``Replanner.step``)."""

    epoch: int
    adopted: bool
    reason: str
    """Why the plan was or was not changed, with the numbers."""
    old_plan: Plan
    """The plan that ran this epoch."""
    new_plan: Plan | None
    """The plan for the next epoch when adopted, else None."""
    predicted_gain: float | None
    """T(old plan) / T(new plan) - 1 under the updated model; None when no re-solve was made."""
    measured_compute_s: tuple[float, ...]
    """Per rank: mean compute time measured this epoch."""
    predicted_compute_s: tuple[float, ...]
    """Per rank: the model's compute time at the batch the rank ran, before this epoch's update."""
    candidate: Plan | None = None
    """The re-solved plan, also when it was not adopted."""
    scale_factors: tuple[float, ...] = ()
    """Per rank: compute time relative to the original profile after this update."""

    @property
    def plan(self) -> Plan:
        """The plan in force for the next epoch."""
        return self.new_plan if self.new_plan is not None else self.old_plan

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return self.plan.batch_sizes

    def to_log(self) -> dict[str, Any]:
        """The JSON-lines record the report reads (non-finite numbers become null: the line stays valid JSON)."""
        return {
            "event": "replan",
            "epoch": self.epoch,
            "adopted": self.adopted,
            "reason": self.reason,
            "predicted_gain": _finite_or_none(self.predicted_gain),
            "old_batch_sizes": list(self.old_plan.batch_sizes),
            "new_batch_sizes": list(self.plan.batch_sizes),
            "measured_compute_s": [_finite_or_none(x) for x in self.measured_compute_s],
            "predicted_compute_s": [_finite_or_none(x) for x in self.predicted_compute_s],
            "plan": self.new_plan.to_dict() if self.new_plan is not None else None,
        }


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


class Replanner:
    """Keeps a plan matched to measured per-rank speeds across epochs.

    Args:
        profile: the profile the first plan was solved from (the model's shape; never modified).
        plan: the plan running now.
        threshold: minimum predicted throughput gain to switch plans (0.05 = 5 %); switching costs a sampler
            re-layout and, when worker counts change, new DataLoader workers.
        min_steps: epochs with fewer averaged steps are refused as too noisy.
        solve_kwargs: extra ``planner.solve`` options (memory headroom, CPU reserve, worker cap, ...);
            ``global_batch`` and ``min_batch`` always come from the plan.
        smoothing: EMA weight of the newest epoch in the scale factors (1.0 = trust the last epoch only).
        noise_sigmas: the gain must also exceed this many relative standard errors of the noisiest rank.
        confirm_below: a gain under this (but over the threshold) is adopted only when the previous epoch proposed
            a move in the same direction too: one epoch disturbed by another process on the host must not move
            the plan, while a real slowdown (gains of 30-80% measured) is followed at once.
        loader_wait_frac: data wait above this fraction of the step counts as a loader that did not keep up.
        solve_fn: the solver (``planner.solve``); replaceable for heuristics and tests.
    """

    def __init__(
        self,
        profile: Profile,
        plan: Plan,
        *,
        threshold: float = 0.05,
        min_steps: int = 5,
        solve_kwargs: Mapping[str, Any] | None = None,
        smoothing: float = 0.5,
        noise_sigmas: float = 2.0,
        confirm_below: float = 0.10,
        loader_wait_frac: float = 0.10,
        solve_fn: Callable[..., Plan] = solve,
    ) -> None:
        if plan.world_size != profile.world_size:
            raise ValidationError(
                f"the plan has {plan.world_size} ranks but the profile {profile.world_size}; "
                "re-run `planner plan` on this profile"
            )
        if not threshold >= 0.0:
            raise ValidationError(f"replan threshold must be >= 0, got {threshold}")
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
        self.threshold = threshold
        self.min_steps = min_steps
        self.smoothing = smoothing
        self.noise_sigmas = noise_sigmas
        self.confirm_below = confirm_below
        self._proposed: tuple[int, ...] | None = None
        """Direction (sign per rank) of the last epoch's unconfirmed small move, if any."""
        self.loader_wait_frac = loader_wait_frac
        self._solve_kwargs = kwargs
        self._solve_fn = solve_fn
        self._base = profile
        self._base_env = [fit_envelope(r.compute) for r in profile.by_rank]
        self._base_spp = [r.loader.sec_per_sample if r.loader else 0.0 for r in profile.by_rank]
        self._plan = plan
        self._scale = [1.0] * profile.world_size
        self._spp = list(self._base_spp)
        self._last_epoch: int | None = None
        self._obs: list[list[tuple[int, float]]] = [[] for _ in range(profile.world_size)]
        """Per rank, (batch size, measured / original-curve ratio) at the two most recent batch sizes."""
        self._revert: tuple[Plan, float, int] | None = None
        """(previous plan, its last measured step time, epoch of adoption) while a new plan awaits its check."""
        self._worse: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
        """(plan moved from, batch sizes that measured slower, epoch that showed it) of recent reverts."""

    # -- the model in use -------------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        return self._plan

    @property
    def scale_factors(self) -> tuple[float, ...]:
        return tuple(self._scale)

    @property
    def loader_sec_per_sample(self) -> tuple[float, ...]:
        return tuple(self._spp)

    def _two_point(self, rank: int) -> tuple[float, float, float, float, float, float] | None:
        """(b1, b2, r1, r2, alpha, beta) of rank ``rank``'s shape correction, or None when the uniform factor applies."""
        obs = self._obs[rank]
        if len(obs) != 2 or obs[0][0] == obs[1][0]:
            return None
        (b1, r1), (b2, r2) = sorted(obs)
        if abs(math.log(r1 / r2)) > _SHAPE_MAX_LOG:
            return None
        t1, t2 = self._base_env[rank](b1), self._base_env[rank](b2)
        c1, c2 = r1 * t1, r2 * t2
        if not (t2 > t1 and c2 > c1):
            return None  # no slope to learn from (flat curve, or noise reversed the order)
        alpha = (c2 - c1) / (t2 - t1)
        return b1, b2, r1, r2, alpha, c1 - alpha * t1

    def _correction(self, rank: int) -> Callable[[float, float], float]:
        """f(batch_size, t): the model's time at ``batch_size`` for a point the original profile gave time ``t``."""
        tp = self._two_point(rank)
        if tp is None:
            scale = self._scale[rank]
            return lambda b, t: scale * t
        b1, b2, r1, r2, alpha, beta = tp
        if beta <= 0:  # steeper than profiled: the affine map above b1, the ratio at b1 below (convex at b1)
            return lambda b, t: r1 * t if b <= b1 else alpha * t + beta
        return lambda b, t: alpha * t + beta if b <= b2 else r2 * t  # flatter: affine below b2, ratio above

    def ratio(self, rank: int, batch_size: float) -> float:
        """The model's time over the original curve's at ``batch_size`` (see the module docstring)."""
        t = self._base_env[rank](batch_size)
        return self._correction(rank)(batch_size, t) / t

    @property
    def profile(self) -> Profile:
        """The original profile with each rank's compute points rescaled and loader costs raised as measured."""
        ranks = []
        for i, r in enumerate(self._base.by_rank):
            correct = self._correction(i)
            compute = tuple(
                ComputePoint(batch_size=p.batch_size, step_time_s=correct(p.batch_size, p.step_time_s))
                for p in r.compute
            )
            loader = r.loader
            if self._spp[i] != self._base_spp[i]:
                loader = LoaderProfile(sec_per_sample=self._spp[i], scaling=r.loader.scaling if r.loader else ())
            ranks.append(replace(r, compute=compute, loader=loader))
        return replace(self._base, ranks=tuple(ranks))

    # -- the decision (pure: no collectives) ----------------------------------------------------------------
    def decide(self, stats: Sequence[StepStats], epoch: int) -> ReplanDecision:
        """Update the model from every rank's stats of `epoch` and decide whether to switch plans.

        Call once per epoch with all ranks' stats: accepted stats move the model (also when the plan is kept).
        """
        old = self._plan
        measured = tuple(float(s.compute_s) for s in sorted(stats, key=lambda s: s.rank))
        problem = self._check_stats(stats, epoch)
        if problem is not None:
            return ReplanDecision(epoch=epoch, adopted=False, reason=problem, old_plan=old, new_plan=None,
                                  predicted_gain=None, measured_compute_s=measured, predicted_compute_s=(),
                                  scale_factors=self.scale_factors)
        by_rank = sorted(stats, key=lambda s: s.rank)
        predicted = tuple(self._correction(i)(s.batch_size, self._base_env[i](s.batch_size))
                          for i, s in enumerate(by_rank))
        self._update(by_rank)
        self._last_epoch = epoch
        step_s = max(s.step_time_s for s in by_rank)
        noise = self.noise_sigmas * max(
            s.compute_s_std / math.sqrt(s.num_steps) / s.compute_s for s in by_rank
        )
        self._worse = [w for w in self._worse if epoch - w[2] < _WORSE_EPOCHS]

        def refuse(reason: str, gain: float | None = None, candidate: Plan | None = None) -> ReplanDecision:
            return ReplanDecision(epoch=epoch, adopted=False, reason=reason, old_plan=old, new_plan=None,
                                  predicted_gain=gain, measured_compute_s=measured, predicted_compute_s=predicted,
                                  candidate=candidate, scale_factors=self.scale_factors)

        if self._revert is not None:
            prev, prev_step_s, adopted_at = self._revert
            self._revert = None
            slower = step_s / prev_step_s - 1.0
            if slower > max(_WORSE_MARGIN, noise):
                self._worse.append((prev.batch_sizes, old.batch_sizes, epoch))
                self._proposed = None
                back = replace(prev, meta={**prev.meta, "reverted_at_epoch": epoch})
                self._plan = back
                return ReplanDecision(
                    epoch=epoch, adopted=True, old_plan=old, new_plan=back, predicted_gain=None,
                    reason=(f"reverted: batches {list(old.batch_sizes)} (adopted at epoch {adopted_at}) measured "
                            f"{step_s * 1e3:.4g} ms per step, {slower:.1%} slower than the {prev_step_s * 1e3:.4g} ms "
                            f"of {list(prev.batch_sizes)} before them; back to {list(prev.batch_sizes)}"),
                    measured_compute_s=measured, predicted_compute_s=predicted, scale_factors=self.scale_factors)

        profile = self.profile
        try:
            cand = self._solve_fn(profile, global_batch=old.global_batch, min_batch=old.min_batch,
                                  **self._solve_kwargs)
        except PlanError as e:
            return refuse(f"re-solve failed, keeping the plan: {e}")
        if cand.world_size != old.world_size or cand.global_batch != old.global_batch:
            return refuse(
                f"re-solved plan has world size {cand.world_size} / global batch {cand.global_batch}, "
                f"the run has {old.world_size} / {old.global_batch}: refused (the global batch never changes)",
                candidate=cand,
            )
        starved = [(r.rank, r.batch_size) for r in cand.ranks if r.batch_size < old.min_batch]
        if starved:
            listed = ", ".join(f"rank {i} at {b}" for i, b in starved)
            return refuse(f"re-solved plan puts {listed} below min batch {old.min_batch}: refused", candidate=cand)
        if cand.fingerprint == old.fingerprint:
            return refuse("re-solved plan is identical to the current one", gain=0.0, candidate=cand)
        eval_kwargs = {k: v for k, v in self._solve_kwargs.items() if k in _EVAL_KEYS}
        old_eval = evaluate(profile, old.batch_sizes, num_workers=[r.num_workers for r in old.ranks],
                            min_batch=old.min_batch, **eval_kwargs)
        t_old, t_new = old_eval.predicted.step_time_s, cand.predicted.step_time_s
        gain = t_old / t_new - 1.0
        numbers = (f"predicted step {t_old * 1e3:.4g} ms -> {t_new * 1e3:.4g} ms, gain {gain:.1%}; "
                   f"batches {list(old.batch_sizes)} -> {list(cand.batch_sizes)}")
        barred = self._barred(old.batch_sizes, cand.batch_sizes)
        if barred is not None:
            src, dst, seen = barred
            return refuse(f"{numbers}: goes as far as {list(dst)}, which measured slower than {list(src)} at epoch "
                          f"{seen}; such moves are barred until epoch {seen + _WORSE_EPOCHS}", gain, cand)
        if not gain > self.threshold:
            self._proposed = None
            return refuse(f"{numbers}: below the threshold {self.threshold:.1%}", gain, cand)
        if not gain > noise:
            return refuse(f"{numbers}: within the measurement noise {noise:.1%} "
                          f"({self.noise_sigmas:g} x relative std error)", gain, cand)
        direction = tuple((b > a) - (b < a) for a, b in zip(old.batch_sizes, cand.batch_sizes, strict=True))
        if gain < self.confirm_below and self._proposed != direction:
            self._proposed = direction
            return refuse(f"{numbers}: under {self.confirm_below:.0%}, adopted only if the next epoch confirms it",
                          gain, cand)
        self._proposed = None
        new = replace(cand, meta={**cand.meta, "replanned_at_epoch": epoch})
        self._plan = new
        self._revert = (old, step_s, epoch)
        return ReplanDecision(epoch=epoch, adopted=True, reason=f"{numbers}: adopted", old_plan=old, new_plan=new,
                              predicted_gain=gain, measured_compute_s=measured, predicted_compute_s=predicted,
                              candidate=cand, scale_factors=self.scale_factors)

    def _barred(self, current: tuple[int, ...],
                cand: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
        """The recent revert that rules out ``cand``: the same batches, or (from the same plan) a move reaching at
        least ``_WORSE_REACH`` of the way along the move that measured slower."""
        for src, dst, seen in self._worse:
            if cand == dst:
                return src, dst, seen
            if src == current:
                rejected = [d - s for s, d in zip(src, dst, strict=True)]
                move = [c - s for s, c in zip(src, cand, strict=True)]
                norm2 = sum(r * r for r in rejected)
                if norm2 > 0 and sum(m * r for m, r in zip(move, rejected, strict=True)) >= _WORSE_REACH * norm2:
                    return src, dst, seen
        return None

    def _check_stats(self, stats: Sequence[StepStats], epoch: int) -> str | None:
        """Why these stats cannot be used (None when they can): refusing beats re-planning on garbage."""
        W = self._plan.world_size
        ids = sorted(s.rank for s in stats)
        if ids != list(range(W)):
            return f"need stats from ranks 0..{W - 1} exactly once, got ranks {ids}: refused"
        if self._last_epoch is not None and epoch <= self._last_epoch:
            return f"epoch {epoch} was already decided (last {self._last_epoch}): refused"
        for s in sorted(stats, key=lambda s: s.rank):
            for name in ("data_wait_s", "compute_s", "step_time_s", "compute_s_std"):
                v = getattr(s, name)
                if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                    return f"rank {s.rank} reported {name}={v}: non-finite or negative measurement, refused"
            if s.num_steps < self.min_steps:
                return f"rank {s.rank} averaged {s.num_steps} steps, fewer than min_steps {self.min_steps}: refused"
            if s.compute_s <= 0 or s.batch_size < 1:
                return f"rank {s.rank} reported compute_s={s.compute_s} at batch {s.batch_size}: refused"
        return None

    def _update(self, by_rank: Sequence[StepStats]) -> None:
        a = self.smoothing
        for i, s in enumerate(by_rank):
            raw = s.compute_s / self._base_env[i](s.batch_size)
            self._scale[i] = (1.0 - a) * self._scale[i] + a * raw
            b = int(s.batch_size)
            same = [r for ob, r in self._obs[i] if ob == b]
            if same and abs(math.log(raw / same[0])) > _SAME_BATCH_CHANGE:
                self._obs[i] = [(b, raw)]  # the device changed under us: what it showed before no longer holds
            else:
                self._obs[i] = [*[o for o in self._obs[i] if o[0] != b][-1:], (b, raw)]
            if s.step_time_s > 0 and s.data_wait_s / s.step_time_s > self.loader_wait_frac:
                if s.num_workers > 0:
                    seen = (s.compute_s + s.data_wait_s) * s.num_workers / s.batch_size
                else:
                    seen = s.data_wait_s / s.batch_size
                self._spp[i] = max(self._spp[i], (1.0 - a) * self._spp[i] + a * seen)

    # -- the collective ------------------------------------------------------------------------------------
    def step(self, local_stats: StepStats, epoch: int, *, group: Any = None) -> ReplanDecision:
        """All-gather every rank's stats, decide on rank 0, broadcast; every rank returns the same decision.

        Without an initialized process group (one process) it decides locally.  Every rank leaves with the same
        plan and model state, checked by fingerprint; a disagreement raises on every rank instead of hanging.
        The caller then applies ``decision.batch_sizes`` (``sampler.set_batch_sizes``) before the next epoch;
        when the adopted plan changes ``num_workers`` the DataLoader must be rebuilt to follow it.  With NCCL the
        object collectives use the current CUDA device: call ``torch.cuda.set_device`` first (every DDP script
        does).
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self.decide([local_stats], epoch)
        rank = dist.get_rank(group)
        src = 0 if group is None else dist.get_global_rank(group, 0)
        mine = {"stats": local_stats.to_dict(), "plan_fingerprint": self._plan.fingerprint}
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)

        payload: dict[str, Any] = {}
        own_error: BaseException | None = None
        if rank == 0:
            try:
                fps = [g["plan_fingerprint"] for g in gathered]
                if len(set(fps)) != 1:
                    raise ValidationError(f"ranks run different plans (fingerprints {fps}): re-planning refused")
                dec = self.decide([StepStats(**g["stats"]) for g in gathered], epoch)
                payload = {"error": None, "log": dec.to_log(), "state": self.state_dict(),
                           "candidate": dec.candidate.to_dict() if dec.candidate is not None else None,
                           "scale_factors": list(dec.scale_factors)}
            except Exception as e:  # every rank must learn of it, or the others hang in the broadcast
                own_error = e
                payload = {"error": f"{type(e).__name__}: {e}"}
        box = [payload]
        dist.broadcast_object_list(box, src=src, group=group)
        payload = box[0]
        if payload["error"] is not None:
            if own_error is not None:
                raise own_error
            raise RuntimeError(f"re-planning failed on rank 0: {payload['error']}")

        log = payload["log"]
        check = ""
        try:
            if rank != 0:
                old = self._plan
                self.load_state_dict(payload["state"])
                cand = payload["candidate"]
                dec = ReplanDecision(
                    epoch=log["epoch"], adopted=log["adopted"], reason=log["reason"], old_plan=old,
                    new_plan=Plan.from_dict(log["plan"]) if log["plan"] is not None else None,
                    predicted_gain=log["predicted_gain"],
                    measured_compute_s=tuple(math.nan if x is None else x for x in log["measured_compute_s"]),
                    predicted_compute_s=tuple(log["predicted_compute_s"]),
                    candidate=Plan.from_dict(cand) if cand is not None else None,
                    scale_factors=tuple(payload["scale_factors"]),
                )
            check = dec.plan.fingerprint
        except Exception as e:  # reported through the gather below so that every rank raises together
            check = f"error on rank {rank}: {type(e).__name__}: {e}"
        checks: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(checks, check, group=group)
        if len(set(checks)) != 1:
            raise RuntimeError(
                f"ranks disagree on the plan after re-planning at epoch {epoch}: fingerprints {checks} "
                f"(rank 0 has {checks[0]})"
            )
        return dec

    # -- checkpointing ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The current plan and the model's corrections (JSON-able), so a resumed run continues re-planning."""
        return {
            "version": _STATE_VERSION,
            "kind": "replanner",
            "plan": self._plan.to_dict(),
            "compute_scale": list(self._scale),
            "loader_sec_per_sample": list(self._spp),
            "last_epoch": self._last_epoch,
            "proposed_direction": None if self._proposed is None else list(self._proposed),
            "profile_fingerprint": self._base.fingerprint(),
            "observations": [[[b, r] for b, r in obs] for obs in self._obs],
            "revert": None if self._revert is None else {
                "plan": self._revert[0].to_dict(), "step_time_s": self._revert[1], "epoch": self._revert[2]},
            "measured_worse": [{"from": list(s), "to": list(d), "epoch": e} for s, d, e in self._worse],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned (on a Replanner built from the same profile)."""
        if state.get("kind") != "replanner" or state.get("version") != _STATE_VERSION:
            raise ValidationError(
                f"not a replanner state (kind={state.get('kind')!r}, version={state.get('version')!r}); "
                f"expected kind 'replanner' version {_STATE_VERSION}"
            )
        plan = Plan.from_dict(state["plan"], path="replanner.plan")
        W = self._base.world_size
        scale = [float(x) for x in state["compute_scale"]]
        spp = [float(x) for x in state["loader_sec_per_sample"]]
        if plan.world_size != W or len(scale) != W or len(spp) != W:
            raise ValidationError(
                f"replanner state is for {plan.world_size} ranks ({len(scale)} scale factors) but the profile has "
                f"{W}: resume with the same cluster or start re-planning afresh"
            )
        if not all(math.isfinite(x) and x > 0 for x in scale) or not all(math.isfinite(x) and x >= 0 for x in spp):
            raise ValidationError(f"replanner state has invalid factors {scale} / loader costs {spp}")
        if state.get("profile_fingerprint") not in (None, self._base.fingerprint()):
            warnings.warn("replanner state was saved with another profile; its scale factors are applied to this "
                          "one's curves", stacklevel=2)
        self._plan = plan
        self._scale = scale
        self._spp = spp
        last = state.get("last_epoch")
        self._last_epoch = None if last is None else int(last)
        proposed = state.get("proposed_direction")
        self._proposed = None if proposed is None else tuple(int(x) for x in proposed)
        # Optional (states written before the shape correction lack them: they resume with an empty history).
        obs = state.get("observations") or [[] for _ in range(W)]
        if len(obs) != W:
            raise ValidationError(f"replanner state has observations for {len(obs)} ranks, the profile {W}")
        self._obs = [[(int(b), float(r)) for b, r in o][-2:] for o in obs]
        if not all(b >= 1 and math.isfinite(r) and r > 0 for o in self._obs for b, r in o):
            raise ValidationError(f"replanner state has invalid observations {self._obs}")
        rev = state.get("revert")
        self._revert = None if rev is None else (
            Plan.from_dict(rev["plan"], path="replanner.revert.plan"), float(rev["step_time_s"]), int(rev["epoch"]))
        self._worse = [(tuple(int(x) for x in w["from"]), tuple(int(x) for x in w["to"]), int(w["epoch"]))
                       for w in state.get("measured_worse") or []]
