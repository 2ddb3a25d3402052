"""Batches in multiples of M (``SolveOptions.batch_multiple``): every rank's batch and micro-batch a multiple of M.

A model compiled with static shapes (``torch.compile(dynamic=False)``) or captured in CUDA graphs compiles or
captures once per batch shape; plans in multiples of M keep the shapes few.  The problem is the solver's own in
units of M samples: rank i runs ``q_i`` units, ``sum q_i = B / M``, and with ``k_i`` micro-steps each micro-batch is
``M * q_i / k_i`` samples, so ``k_i`` divides ``q_i`` (under fsdp one ``K`` divides every ``q_i``).  The search:

  1. the solver's optimum (any integers), divided by M and rounded to units by largest remainder (the total
     exact, each rank within its caps in units);
  2. each rank's micro-steps: the fewest ``k`` dividing ``q_i`` whose micro-batch fits the rank's memory cap and
     holds ``min_batch``;
  3. while moving one unit off the slowest rank onto another lowers the slowest rank's time (the largest busy
     time, what the solver balances), make the best such move (while no rank fits: a move between any two).
     Under fsdp (one K on every rank) steps 1-3 run for each K that divides ``B / M``, in units of K, and the
     fastest result wins.

A global batch that is not a multiple of M, or below M units of ``min_batch`` per rank, is refused with the
nearest global batches that work.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from planner._model import RankModel
from planner.errors import PlanError, ValidationError
from planner.options import SolveOptions
from planner.rounding import largest_remainder


def min_units(opts: SolveOptions) -> int:
    """Fewest units of M a rank may run: ``min_batch`` samples, at least one unit."""
    return max(1, math.ceil(opts.min_batch / opts.batch_multiple))


def check_global_batch(B: int, world_size: int, opts: SolveOptions) -> None:
    """ValidationError unless ``B`` splits into multiples of ``batch_multiple`` of at least ``min_batch`` each."""
    M = opts.batch_multiple
    if M == 1:
        return
    least = M * min_units(opts) * world_size
    if B < least:
        raise ValidationError(
            f"global batch {B} cannot give {world_size} ranks a multiple of --batch-multiple {M} each "
            f"(>= {M * min_units(opts)} samples, --min-batch {opts.min_batch}): the smallest global batch that works "
            f"is {least}")
    if B % M:
        lo, hi = B - B % M, B - B % M + M
        nearest = f"{hi}" if lo < least else f"{lo} and {hi}"
        raise ValidationError(
            f"global batch {B} is not a multiple of --batch-multiple {M}: the nearest global batches that work are "
            f"{nearest}")


def _unit_cap(m: RankModel, M: int, opts: SolveOptions) -> int | None:
    """Most units one optimizer step of this rank may hold (memory cap x micro-steps, --max-batch-per-rank)."""
    caps = []
    if m.micro_cap is not None:
        caps.append(m.micro_cap * opts.max_accumulation_steps)
    if m.batch_cap is not None:
        caps.append(m.batch_cap)
    return min(caps) // M if caps else None


def _fits(m: RankModel, samples: int, k: int, opts: SolveOptions) -> bool:
    micro = samples // k
    return ((m.micro_cap is None or micro <= m.micro_cap) and (m.batch_cap is None or samples <= m.batch_cap)
            and (k == 1 or micro >= opts.min_batch))


def steps_for(models: Sequence[RankModel], q: Sequence[int], opts: SolveOptions,
              K: int | None = None) -> list[int] | None:
    """The fewest micro-steps per rank that divide its units and fit (one K for all under fsdp; ``K`` given: that
    one on every rank); None: none do."""
    M, top = opts.batch_multiple, opts.max_accumulation_steps
    if K is not None or opts.mode == "fsdp":
        for k in ([K] if K is not None else range(1, top + 1)):
            if all(qi % k == 0 and _fits(m, M * qi, k, opts) for m, qi in zip(models, q, strict=True)):
                return [k] * len(q)
        return None
    out = []
    for m, qi in zip(models, q, strict=True):
        ki = next((j for j in range(1, min(top, qi) + 1) if qi % j == 0 and _fits(m, M * qi, j, opts)), None)
        if ki is None:
            return None
        out.append(ki)
    return out


def _times(models: Sequence[RankModel], q: Sequence[int], w: np.ndarray, opts: SolveOptions,
           K: int | None) -> tuple[list[float], list[int] | None]:
    """Each rank's busy time at ``q`` units (what the solver balances) and the micro-steps; inf where none fit."""
    k = steps_for(models, q, opts, K)
    if k is None:
        return [math.inf] * len(q), None
    M = opts.batch_multiple
    return [m.busy_time(M * qi, int(w[i]), k[i])[0] for i, (m, qi) in enumerate(zip(models, q, strict=True))], k


def _descend(models: Sequence[RankModel], q: list[int], w: np.ndarray, opts: SolveOptions, *, g: int,
             K: int | None, lo: int, hi: Sequence[int | None]) -> tuple[float, list[int], list[int] | None]:
    """Moves of ``g`` units off the slowest rank (any rank while nothing fits) while the slowest time drops."""
    times, k = _times(models, q, w, opts, K)
    best = max(times)
    for _ in range(sum(q) // g + 4 * len(q)):  # each move lowers the slowest time; bounded regardless
        order = list(range(len(q))) if k is None else [max(range(len(q)), key=lambda i: times[i])]
        move: tuple[float, list[float], list[int], list[int]] | None = None
        for s in order:
            if q[s] - g < lo:
                continue
            for j in range(len(q)):
                cap = hi[j]
                if j == s or (cap is not None and q[j] + g > cap):
                    continue
                cand = list(q)
                cand[s] -= g
                cand[j] += g
                ct, kc = _times(models, cand, w, opts, K)
                t = max(ct)
                if kc is not None and t < best * (1 - 1e-12) and (move is None or t < move[0]):
                    move = (t, ct, cand, kc)
        if move is None:
            break
        best, times, q, k = move
    return best, q, k


def to_multiples(models: Sequence[RankModel], b: np.ndarray, w: np.ndarray, B: int,
                 opts: SolveOptions) -> tuple[np.ndarray, np.ndarray]:
    """(batches, micro-steps) in multiples of ``batch_multiple`` near the solver's batches ``b`` (module docstring).
    Under fsdp every micro-step count K that divides the units is tried (units moved K at a time); the fastest
    wins, the fewer micro-steps among equals.

    Raises:
        PlanError: no split in multiples fits the ranks' caps.
    """
    M = opts.batch_multiple
    lo = min_units(opts)
    hi = [_unit_cap(m, M, opts) for m in models]
    U = B // M
    shared = opts.mode == "fsdp"
    found: tuple[float, list[int], list[int]] | None = None
    for K in (range(1, opts.max_accumulation_steps + 1) if shared else [None]):
        g = K or 1
        if U % g:
            continue
        try:
            q0 = [g * x for x in largest_remainder([float(x) / (M * g) for x in b], U // g, lo=math.ceil(lo / g),
                                                   hi=[h // g if h is not None else None for h in hi])]
        except PlanError:
            continue
        t, q, k = _descend(models, q0, w, opts, g=g, K=K, lo=lo, hi=hi)
        if k is not None and (found is None or t < found[0] * (1 - 1e-12)):
            found = (t, q, k)
    if found is None:
        raise PlanError(f"no split of {B} into multiples of --batch-multiple {M} fits the ranks' caps with "
                        f"micro-batches in multiples of {M} (at most {opts.max_accumulation_steps} micro-steps; units "
                        f"of {M} each rank can hold: {[h if h is not None else 'any' for h in hi]}): lower "
                        f"--batch-multiple or raise --max-accumulation-steps")
    _, q, k = found
    return np.asarray([M * x for x in q], dtype=np.int64), np.asarray(k, dtype=np.int64)


def equal_multiples(B: int, world_size: int, opts: SolveOptions) -> list[int]:
    """The equal split in units of ``batch_multiple`` (larger shares first, as ``equal_split``)."""
    M = opts.batch_multiple
    units, extra = divmod(B // M, world_size)
    return [M * (units + (1 if i < extra else 0)) for i in range(world_size)]
