"""Micro-batches: gradient accumulation inside one optimizer step, with exact weights for every micro-batch.

A plan may give rank i ``accumulation_steps`` k_i: its b_i samples of an optimizer step run as k_i micro-batches
(memory caps the micro-batch, not the step). The layout stays that of docs/DESIGN.md, Runtime protocol: global step
s covers P[s*B:(s+1)*B], rank i owns b_i of those positions, and those positions, in order, are cut into micro-batches of
sizes ceil(b_i/k_i) ... then floor(b_i/k_i) (:func:`micro_batch_sizes`). Under DDP k_i may differ per rank
(``no_sync`` on all but a rank's last micro-batch: one all-reduce per optimizer step on every rank); under FSDP2
every rank runs the same number of micro-batches in every step, because each forward all-gathers.

The true gradient of one optimizer step is  g = sum_i sum_j (n_ij / n) g_ij,  with g_ij the mean-loss gradient
of rank i's micro-batch j, n_ij its sample count and n = sum_ij n_ij the step's global count. Hence the weights
carried by :class:`MicroStep` (every rank computes every n_ij from the layout, without communicating):

- ``loss_scale`` = n_ij * W / n: the factor for the mean loss when the framework *averages* over W ranks (DDP's
  default all-reduce, FSDP2's reduce-scatter): sum_i (1/W) sum_j (n_ij W / n) g_ij = g.
- ``accumulation_weight`` = n_ij / n_i: the factor for the mean loss with :func:`register_weighted_hook`, which
  multiplies the accumulated sum_j (n_ij / n_i) g_ij by n_i / n and SUM-all-reduces.

A stock accumulation loop changes in a few lines (docs/ADOPTING.md):

    for (x, y), micro in micro_steps(loader, sampler):
        model.set_requires_gradient_sync(micro.is_last)      # FSDP2; DDP: no_sync() unless micro.is_last
        (loss_fn(model(x), y) * micro.loss_scale).backward()
        if micro.is_last:
            opt.step()
            opt.zero_grad()
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from planner.errors import ValidationError
from planner.plan import micro_batch_sizes as _plan_micro_batch_sizes
from runtime.safety import note_weighting
from runtime.weighting import StepCounts

T = TypeVar("T")


# The plan's rule, one implementation (planner.plan): rank i's b_i samples of a step in k_i micro-batches,
# ceil(b_i/k_i) ... then floor(b_i/k_i).
micro_batch_sizes = _plan_micro_batch_sizes


def check_accumulation(batch_sizes: Sequence[int], accumulation_steps: Sequence[int] | None, min_batch: int,
                       what: str = "accumulation_steps") -> tuple[int, ...]:
    """Validated per-rank micro-step counts (None: one micro-step per rank).

    Every micro-batch must hold at least ``min_batch`` samples (BatchNorm): floor(b_i / k_i) >= min_batch, which
    also rules out empty micro-batches (k_i > b_i).
    """
    if accumulation_steps is None:
        return (1,) * len(batch_sizes)
    steps = tuple(accumulation_steps)
    if len(steps) != len(batch_sizes):
        raise ValidationError(f"{what}: got {len(steps)} values for {len(batch_sizes)} ranks; give one per rank")
    if any(isinstance(k, bool) or int(k) != k or k < 1 for k in steps):
        raise ValidationError(f"{what}: every rank needs an integer >= 1 micro-steps, got {list(steps)}")
    for i, (b, k) in enumerate(zip(batch_sizes, steps, strict=True)):
        if b // int(k) < min_batch:
            raise ValidationError(
                f"{what}: rank {i} splits its batch of {b} into {int(k)} micro-batches, so some hold {b // int(k)} "
                f"samples, below min_batch {min_batch}; use at most {max(1, b // min_batch)} micro-steps on rank {i}"
            )
    return tuple(int(k) for k in steps)


def partial_micro_layout(partial: Sequence[int], batch_sizes: Sequence[int],
                         accumulation_steps: Sequence[int], min_batch: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(samples, micro-batch count) of every rank in the epoch's partial last step.

    Rank i gets r_i samples from the proportional split (``partial``) and runs them in the fewest micro-batches
    that fit its planned micro-batch u_i = ceil(b_i / k_i): m_i = ceil(r_i / u_i) <= k_i, so the partial step is
    never slower than a full one and no micro-batch exceeds what the rank's memory was planned for. When every
    rank has the same k (always under FSDP2) every rank runs m = max_i m_i, so the micro-step counts stay equal.
    Where m_i micro-batches of r_i samples would fall below ``min_batch``, r_i grows to m_i * min_batch (wrap-around
    padding, fewer than min_batch extra samples, and r_i' <= b_i since floor(b_i / k_i) >= min_batch). With one
    micro-step everywhere this is the partial step unchanged.
    """
    counts = [-(-r // -(-b // k)) for r, b, k in zip(partial, batch_sizes, accumulation_steps, strict=True)]
    if len(set(accumulation_steps)) == 1:
        counts = [max(counts)] * len(counts)
    sizes = tuple(max(r, m * min_batch) for r, m in zip(partial, counts, strict=True))
    return sizes, tuple(counts)


class MicroLayout(StepCounts, Protocol):
    """What :func:`micro_steps` needs from a sampler (HeteroBatchSampler): the weighting's view plus where a resumed
    pass starts inside its first step."""

    @property
    def start_micro_step(self) -> int: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroStep:
    """Where one micro-batch sits in its optimizer step, and its exact weights (see the module docstring)."""

    step: int
    """Optimizer step of the epoch this micro-batch belongs to (the sampler's global step)."""
    index: int
    """Position of this micro-batch among this rank's micro-batches of the step, from 0."""
    count: int
    """This rank's micro-batches in the step (k_i; fewer in the epoch's partial last step)."""
    num_samples: int
    """n_ij: samples in this micro-batch."""
    rank_samples: int
    """n_i: this rank's samples in the step."""
    step_samples: int
    """n: all ranks' samples in the step."""
    world_size: int
    """W: data-parallel ranks."""

    def __post_init__(self) -> None:
        assert 0 <= self.index < self.count and 0 < self.num_samples <= self.rank_samples <= self.step_samples

    @property
    def is_last(self) -> bool:
        """This rank's last micro-batch of the step: synchronize gradients, then step the optimizer."""
        return self.index == self.count - 1

    @property
    def weight(self) -> float:
        """n_ij / n: this micro-batch's share of the step's true (global mean-loss) gradient."""
        return self.num_samples / self.step_samples

    @property
    def loss_scale(self) -> float:
        """n_ij * W / n: multiply the mean loss by it when DDP or FSDP2 averages gradients over W ranks."""
        return self.num_samples * self.world_size / self.step_samples

    @property
    def accumulation_weight(self) -> float:
        """n_ij / n_i: multiply the mean loss by it with :func:`runtime.weighting.register_weighted_hook`."""
        return self.num_samples / self.rank_samples


def _step_micro_steps(sampler: MicroLayout, step: int) -> list[MicroStep]:
    """Every :class:`MicroStep` of this rank in optimizer step ``step``."""
    counts = sampler.counts_at(step)
    mine = sampler.micro_sizes_at(step)[sampler.rank]
    return [MicroStep(step=step, index=j, count=len(mine), num_samples=m, rank_samples=counts[sampler.rank],
                      step_samples=sum(counts), world_size=sampler.world_size) for j, m in enumerate(mine)]


def micro_step_at(sampler: MicroLayout, step: int, index: int) -> MicroStep:
    """The :class:`MicroStep` of this rank's micro-batch ``index`` in optimizer step ``step``."""
    micro = _step_micro_steps(sampler, step)
    if not 0 <= index < len(micro):
        raise IndexError(f"micro-step {index} is outside 0..{len(micro) - 1} of step {step} on rank {sampler.rank}")
    return micro[index]


def micro_steps(loader: Iterable[T], sampler: MicroLayout) -> Iterator[tuple[T, MicroStep]]:
    """Iterate ``loader`` (a DataLoader over ``sampler``) and say where each micro-batch sits in its step.

    Positions come from the sampler's deterministic layout, not from the sampler's own progress (a DataLoader
    with workers runs the sampler ahead), starting where the pass starts (0, or the resumed step and micro-step
    after ``load_state_dict``). One call per epoch, after ``sampler.set_epoch``, like ``for batch in loader``.
    """
    note_weighting("micro_steps")  # before the pass starts: its MicroSteps carry the exact weights
    it = iter(loader)  # starts the sampler's pass: its start position is now this pass's
    step, index = sampler.start_step, sampler.start_micro_step
    current: list[MicroStep] = []  # the step's MicroSteps, built once per step
    for batch in it:
        if step >= sampler.num_steps:
            raise RuntimeError(
                f"micro_steps: the loader yielded more batches than the sampler's {sampler.num_steps} steps; build "
                "the DataLoader with batch_sampler= this sampler"
            )
        if not current or current[0].step != step:
            current = _step_micro_steps(sampler, step)
        micro = current[index]
        yield batch, micro
        step, index = (step + 1, 0) if micro.is_last else (step, index + 1)
