"""Exact gradient weighting for uneven per-rank batches: a DDP comm hook and a loss-scale helper.

The true gradient of a global step is  g = sum_i (n_i / n) * g_i,  where g_i is rank i's mean-loss gradient, n_i
its sample count this step and n = sum_i n_i. Stock DDP computes (1/W) * sum_i g_i, which over-weights a rank
with few samples. The hook multiplies each bucket by n_i / n and SUM-all-reduces (no division by W). Every rank
knows every n_i from the sampler's deterministic layout (``counts_at``), so no extra collective is needed.

With micro-batches (the sampler's ``accumulation_steps``, runtime/accumulate.py) a sampler step is one optimizer
step made of this rank's micro-batches j: the hook still applies n_i / n once per step (it fires on the
synchronizing backward only), and the micro-batch mean losses are weighted n_ij / n_i before it
(``accumulation_weight(..., micro_step=j)``), or n_ij * W / n without the hook (``loss_scale(..., micro_step=j)``).

Weights other than sample counts (``StepWeights``, ``step_weights``): for a token-mean loss (a language model's
cross-entropy over non-padding target tokens) the weight of a micro-batch is its number of counted tokens n_ij,
which the sampler's layout cannot know. The gradient of  sum over all tokens / N  (N = sum_ij n_ij, all ranks) is
sum_ij (n_ij / N) g_ij with g_ij micro-batch j's token-mean gradient -- the same formula with tokens for samples, so
the same two factors apply (n_ij * W / N for DDP's averaging, n_i / N in the hook), once N is known: one scalar
SUM all-reduce per optimizer step (``step_weights``) over this rank's micro-batch counts of the step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from planner.errors import ValidationError
from runtime.compress import weighted_hook_for
from runtime.safety import note_weighting


class StepCounts(Protocol):
    """What the weighting needs from a sampler (HeteroBatchSampler or HeteroDistributedSampler)."""

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def num_steps(self) -> int: ...
    @property
    def generation(self) -> int: ...
    @property
    def start_step(self) -> int: ...
    def counts_at(self, step: int) -> tuple[int, ...]: ...
    def micro_sizes_at(self, step: int) -> tuple[tuple[int, ...], ...]: ...


def _window(sampler: StepCounts, step: int, accumulation_steps: int) -> range:
    # Accumulation windows are aligned to the epoch start: [0, K), [K, 2K), ...; the last one may be shorter.
    first = (step // accumulation_steps) * accumulation_steps
    return range(first, min(first + accumulation_steps, sampler.num_steps))


def _window_counts(sampler: StepCounts, step: int, accumulation_steps: int) -> tuple[int, int]:
    mine = total = 0
    for s in _window(sampler, step, accumulation_steps):
        counts = sampler.counts_at(s)
        mine += counts[sampler.rank]
        total += sum(counts)
    return mine, total


def _samples(sampler: StepCounts, step: int, micro_step: int | None) -> int:
    """This rank's samples in ``step`` (micro_step None) or in its micro-batch ``micro_step`` of that step."""
    parts = sampler.micro_sizes_at(step)[sampler.rank]
    if micro_step is None:
        if len(parts) > 1:
            raise ValidationError(
                f"step {step} runs as {len(parts)} micro-batches on rank {sampler.rank} (the sampler's "
                "accumulation_steps); pass micro_step=, or iterate with runtime.accumulate.micro_steps, whose "
                "MicroStep carries loss_scale and accumulation_weight"
            )
        return parts[0]
    if not 0 <= micro_step < len(parts):
        raise IndexError(f"micro_step {micro_step} is outside 0..{len(parts) - 1} of step {step} on rank "
                         f"{sampler.rank}")
    return parts[micro_step]


def loss_scale(sampler: StepCounts, step: int, *, accumulation_steps: int = 1, micro_step: int | None = None) -> float:
    """Factor for a mean loss when DDP keeps its default (averaging) all-reduce: n_i * W / n.

    ``(loss * loss_scale(sampler, step)).backward()`` makes DDP's mean over W ranks equal the true gradient.
    With gradient accumulation over K micro-batches, n is the window's total over all ranks (windows of K steps
    from the epoch start), so the scale already contains the 1/K: do NOT divide the loss by K as well. This is
    exact for every window, the epoch's short last one included, and also with SyncBatchNorm.

    When the sampler itself splits steps into micro-batches (its ``accumulation_steps``), pass ``micro_step=j``:
    the factor is then n_ij * W / n, exact under DDP and FSDP2 (both average over W) for any per-rank k_i.
    """
    note_weighting("loss_scale")  # the first backward's check (runtime.safety.arm_weighting_check) sees it
    mine = _samples(sampler, step, micro_step)
    _, total = _window_counts(sampler, step, accumulation_steps)
    return mine * sampler.world_size / total


def accumulation_weight(sampler: StepCounts, step: int, accumulation_steps: int = 1, *,
                        micro_step: int | None = None) -> float:
    """Weight of micro-batch ``step``'s mean loss inside its accumulation window when using the hook.

    n_i(step) / sum of n_i over the window: 1/K whenever this rank's micro-batches in the window are equal, which
    is every window except one holding the epoch's partial last step. See :func:`register_weighted_hook`.
    With the sampler's own micro-batches pass ``micro_step=j``: n_ij / (this rank's samples in the window).
    """
    note_weighting("loss_scale")
    mine, _ = _window_counts(sampler, step, accumulation_steps)
    return _samples(sampler, step, micro_step) / mine


@dataclass(frozen=True, kw_only=True, slots=True)
class StepWeights:
    """Per-batch weights of one optimizer step (e.g. counted target tokens): this rank's and the global total.

    With w_ij the weight of this rank's micro-batch j and N the sum over every rank's micro-batches of the step,
    the exact gradient of a weight-normalized loss (sum over tokens / N) is sum_ij (w_ij / N) g_ij, g_ij being the
    gradient of micro-batch j's own mean loss (mean over its w_ij tokens).
    """

    micro: tuple[float, ...]
    """w_ij: this rank's weight of each micro-batch of the step, in order (one entry without accumulation)."""
    total: float
    """N: the sum of every rank's weights of the step (all-reduced)."""
    world_size: int
    """W: data-parallel ranks (DDP and FSDP2 average over them)."""

    def __post_init__(self) -> None:
        if not self.micro or any(w < 0 for w in self.micro):
            raise ValidationError(f"step weights must be >= 0, one per micro-batch; got {list(self.micro)}")
        if not self.total > 0:
            raise ValidationError("the step's weights sum to 0 over all ranks (no counted tokens: every label is "
                                  "padding?); nothing to average")

    @property
    def local(self) -> float:
        """w_i: this rank's weight in the step."""
        return float(sum(self.micro))

    @property
    def factor(self) -> float:
        """w_i / N: what the weighted hook multiplies this rank's gradient by."""
        return self.local / self.total

    def loss_scale(self, micro_step: int = 0) -> float:
        """w_ij * W / N: the factor for micro-batch j's mean loss when DDP/FSDP2 averages over W ranks."""
        note_weighting("step_weights")  # taking a factor is what weights the loss (the first backward's check)
        return self.micro[micro_step] * self.world_size / self.total

    def accumulation_weight(self, micro_step: int = 0) -> float:
        """w_ij / w_i: the factor for micro-batch j's mean loss with the weighted hook (0 on a rank without weight)."""
        note_weighting("step_weights")
        return self.micro[micro_step] / self.local if self.local > 0 else 0.0


def step_weights(micro: Sequence[float | torch.Tensor] | float | torch.Tensor, *, process_group: Any = None,
                 device: torch.device | str | None = None) -> StepWeights:
    """This rank's weights of one optimizer step and their global total: ONE scalar all-reduce (collective).

    Call it once per optimizer step on every rank, before the step's first backward, with the weight of each of
    this rank's micro-batches of the step (e.g. ``[(labels != -100).sum() for labels in step_labels]``). Outside
    torch.distributed the total is the local sum. ``device``: where the scalar is reduced (default: the current
    CUDA device under NCCL, else CPU).

    Counting is not weighting: the first backward's check (runtime.safety) counts the weights as applied once a
    factor is taken from them (``loss_scale``, ``accumulation_weight``), so a loop that counts the tokens and then
    never scales its loss is refused like one that counts nothing.
    """
    parts = micro if isinstance(micro, Sequence) else [micro]
    values = tuple(float(w) for w in parts)  # one host sync per step: the counts come from label tensors
    world, total = 1, sum(values)
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size(process_group)
        if device is None:
            nccl = dist.get_backend(process_group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        buf = torch.tensor([total], dtype=torch.float64, device=device)
        dist.all_reduce(buf, group=process_group)
        total = float(buf.item())
    return StepWeights(micro=values, total=total, world_size=world)


@dataclass(kw_only=True, slots=True)
class WeightedHookState:
    """Mutable state of one registered hook (one DDP model). Not a value type: the hook advances it."""

    sampler: StepCounts
    process_group: Any = None
    """Group to all-reduce over (None = the default group), as in torch's default hooks."""
    accumulation_steps: int = 1
    on_last_bucket: Callable[[], None] | None = None
    step: int = 0
    """Sampler step of the next synchronizing backward in the current pass."""
    generation: int = -1
    """Sampler pass the step count belongs to; a new pass (new epoch or resume) resets ``step``."""
    last_factor: float = 1.0
    """n_i / n applied at the last synchronization (for logs and tests)."""
    num_syncs: int = 0
    per_batch_weights: bool = False
    """Weights come from :meth:`set_step_weights` each optimizer step instead of the sampler's sample counts."""
    weights: StepWeights | None = None
    """The current step's weights (per_batch_weights); consumed by the step's synchronization."""

    def set_step_weights(self, weights: StepWeights) -> None:
        """Use ``weights`` (from :func:`step_weights`) for the next synchronizing backward: factor w_i / N."""
        self.weights = weights

    def _factor_for_current_window(self) -> float:
        s = self.sampler
        if s.generation != self.generation:  # the sampler started a new pass: epoch start or resume
            self.generation, self.step = s.generation, s.start_step
        if self.step >= s.num_steps:
            raise RuntimeError(
                f"weighted gradient hook: synchronizing backward number {self.step + 1} of a pass that has only "
                f"{s.num_steps} steps; feed training from a DataLoader over this sampler (a new `for` loop per "
                "epoch) and synchronize only on a step's last micro-batch (runtime.accumulate.micro_steps says "
                "which) or pass accumulation_steps= when you use no_sync across sampler steps"
            )
        if self.per_batch_weights:
            if self.weights is None:
                raise RuntimeError("weighted gradient hook with per_batch_weights: no step weights for this step; call "
                                   "state.set_step_weights(step_weights(...)) before every optimizer step's backward")
            return self.weights.factor
        mine, total = _window_counts(s, self.step, self.accumulation_steps)
        return mine / total

    def _advance(self) -> None:
        window = _window(self.sampler, self.step, self.accumulation_steps)
        self.step = window.stop
        self.num_syncs += 1
        self.weights = None  # one step's weights serve one synchronization: a stale count would bias silently


def _weighted_allreduce_hook(state: WeightedHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    factor = state._factor_for_current_window()
    buffer = bucket.buffer()
    buffer.mul_(factor)
    if bucket.is_last():
        state.last_factor = factor
        if state.on_last_bucket is not None:
            state.on_last_bucket()  # before the launch: timing records "local compute done" here
        state._advance()
    fut = dist.all_reduce(buffer, group=state.process_group, async_op=True).get_future()  # type: ignore[union-attr]
    return fut.then(lambda f: f.value()[0])


# DDP checks the hook's annotations by identity; under `from __future__ import annotations` they are strings.
_weighted_allreduce_hook.__annotations__ = {
    "state": WeightedHookState, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor],
}


def register_weighted_hook(ddp_model: torch.nn.parallel.DistributedDataParallel, sampler: StepCounts, *,
                           on_last_bucket: Callable[[], None] | None = None, accumulation_steps: int = 1,
                           process_group: Any = None, per_batch_weights: bool = False,
                           compress: str = "none") -> WeightedHookState:
    """Make DDP's gradient the exact sample-weighted mean over all ranks' uneven batches.

    Each gradient bucket is multiplied by n_i / n and SUM-all-reduced, so after ``backward()`` every rank holds
    sum_i (n_i / n) g_i: the gradient one process would compute on the concatenation of all ranks' batches (for
    a mean loss). Works with NCCL and gloo, and after ``sampler.set_batch_sizes`` (the counts come from the
    sampler's current layout). The hook counts synchronizing backwards itself (``bucket.is_last()``), so the
    DataLoader's prefetching, which moves the sampler ahead, does not matter; the count restarts when the sampler
    starts a new pass (each ``for batch in loader``), at the resumed step after ``load_state_dict``.

    Micro-batches from the sampler (``HeteroBatchSampler(..., accumulation_steps=[k_0, k_1, ...])``, k_i may
    differ per rank): nothing to pass here. Iterate with :func:`runtime.accumulate.micro_steps`, run ``no_sync``
    on all but ``micro.is_last`` and multiply each micro-batch's mean loss by ``micro.accumulation_weight``
    (n_ij / n_i); every rank synchronizes once per step and the hook applies n_i / n, so the result is
    sum_ij (n_ij / n) g_ij exactly, the epoch's partial last step included.

    Equal accumulation across sampler steps with ``no_sync`` (the sampler without micro-batches): pass
    ``accumulation_steps=K``. Windows are K consecutive sampler steps from the epoch start (the last may be
    shorter); run ``no_sync`` on all but the window's last micro-batch and synchronize on the last (also at the
    end of the epoch). The hook then applies N_i / N, with N_i this rank's and N all ranks' samples in the window,
    so the result is exact when the locally accumulated gradient is the mean over this rank's window samples,
    i.e. each micro-batch's mean loss is multiplied by ``accumulation_weight(sampler, step, K)`` -- which equals
    the usual ``1 / K`` in every window whose micro-batches are equal on this rank (all but the window holding
    the epoch's partial last step).

    SyncBatchNorm: its backward all-reduces the per-rank loss gradients unweighted, so a per-rank factor on the
    parameter gradients cannot be exact when batch sizes differ. For SyncBatchNorm models keep DDP's default
    all-reduce and use :func:`loss_scale` instead (exact); this function warns when it finds SyncBatchNorm.

    Args:
        ddp_model: the DistributedDataParallel-wrapped model -- register after ``DDP(...)``, once, before the first
            step (a bare module has no comm hook: TypeError saying so).
        sampler: the HeteroBatchSampler (or HeteroDistributedSampler) feeding this rank.
        on_last_bucket: called when the step's last bucket reaches the hook, before its all-reduce is launched.
        accumulation_steps: micro-batches per optimizer step with ``no_sync`` (1 = no accumulation).
        process_group: group to all-reduce over (default: the default group).
        per_batch_weights: weight by per-batch weights (counted tokens) instead of sample counts: before every
            optimizer step's synchronizing backward call ``state.set_step_weights(step_weights(counts))`` and
            multiply micro-batch j's mean loss by ``weights.accumulation_weight(j)``; the hook applies w_i / N.
        compress: 'none' (default: all-reduce in the gradients' dtype, exact), 'bf16' or 'fp16' (opt-in: scale by
            n_i / n in fp32 first, then cast and SUM-all-reduce; runtime/compress.py says why that order).

    Returns:
        The hook's state (current step, last factor), e.g. for logging.
    """
    if accumulation_steps < 1:
        raise ValidationError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
    hook = weighted_hook_for(compress) or _weighted_allreduce_hook
    micro = getattr(sampler, "accumulation_steps", None)
    if accumulation_steps > 1 and micro is not None and max(micro) > 1:
        # Windows of several sampler steps each made of micro-batches: exact by the formulas, but MicroStep's
        # weights assume one optimizer step per sampler step. One way of accumulating at a time.
        raise ValidationError(
            f"the sampler already splits every step into micro-batches (accumulation_steps {list(micro)}); do not "
            f"also pass accumulation_steps={accumulation_steps} to register_weighted_hook"
        )
    if not callable(getattr(ddp_model, "register_comm_hook", None)):
        # The usual first try passes the bare model (or calls this before DDP(...) exists): say what to pass.
        raise TypeError(
            f"register_weighted_hook needs the DDP-wrapped model, got a {type(ddp_model).__name__} without "
            "register_comm_hook: call it after `model = DistributedDataParallel(model, ...)`, with that model"
        )
    world = dist.get_world_size(process_group)
    if sampler.world_size != world:
        raise ValidationError(
            f"sampler has batch sizes for {sampler.world_size} ranks but the process group has {world}; "
            "use a plan made for this world size"
        )
    if any(isinstance(m, torch.nn.SyncBatchNorm) for m in ddp_model.modules()):
        warnings.warn(
            "register_weighted_hook: the model has SyncBatchNorm, whose backward mixes unweighted per-rank losses; "
            "with uneven batches use runtime.weighting.loss_scale and DDP's default all-reduce for exact gradients",
            stacklevel=2,
        )
    state = WeightedHookState(sampler=sampler, process_group=process_group, accumulation_steps=accumulation_steps,
                              on_last_bucket=on_last_bucket, per_batch_weights=per_batch_weights)
    note_weighting("hook")  # the sampler's checks: this process weights its gradient
    ddp_model.register_comm_hook(state, hook)
    return state
