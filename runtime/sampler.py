"""Per-rank batch sizes for DDP: a batch sampler that reduces to DistributedSampler + BatchSampler.

Layout (docs/DESIGN.md, Runtime protocol). Epoch e shuffles range(N) with ``torch.randperm(N, Generator().manual_seed(seed + e))``
exactly as DistributedSampler does, and keeps the permutation P as one int32 tensor (4 bytes per sample; int64 past 2**31 samples; never a
Python list). With B = sum(b_i), global step s owns P[s*B:(s+1)*B]; inside a step, rank i takes b_i of the B
positions by a *weighted interleave*: sort the keys (k / b_i, i) for k < b_i over all ranks, and position p goes
to the rank owning the p-th smallest key. With equal b that is positions i, i+W, i+2W, ... -- DistributedSampler's
``rank::W`` -- so an equal plan reproduces DistributedSampler + BatchSampler batch for batch.

The last partial step (drop_last=False, R = N - S*B samples left) gives rank i r_i = max(min_batch,
ceil(R * b_i / B)) samples; when sum(r_i) > R the extra positions wrap around to P[0], P[1], ... (as
DistributedSampler pads). Every rank yields the same number of steps, and every rank can compute every rank's
batch size at every step (``counts_at``) without communicating: the gradient hook depends on that.

Micro-batches (gradient accumulation, runtime/accumulate.py): with ``accumulation_steps`` k_i, rank i's positions
of a step are cut, in order, into k_i micro-batches of sizes ceil(b_i/k_i) ... floor(b_i/k_i), and the sampler
yields those; a step is then one optimizer step. The layout of the steps above does not change.
"""

from __future__ import annotations

import copy
import math
import os
import sys
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, Sampler

from planner.errors import ValidationError
from planner.jsonio import MAX_WORLD_SIZE
from planner.shown import shown
from runtime.accumulate import check_accumulation, micro_batch_sizes, partial_micro_layout
from runtime.safety import arm_weighting_check, check_first_pass, drawn_by_dataloader, note_weighting, on_main_thread
from runtime.shuffle import PermutationPrefetch, epoch_permutation

if TYPE_CHECKING:
    from planner.plan import Plan

STATE_VERSION = 1
# Keys k / b are compared as float64: two distinct fractions with denominators <= 2**26 differ by >= 2**-52,
# more than twice the worst rounding error of a quotient in [0, 1), so the float order is the exact order.
MAX_BATCH = 1 << 26
SMALL_LAYOUT = 1 << 16
"""A global batch above the dataset's length is accepted up to this many positions (under 2 MB of layout)."""
MAX_DATASET_LEN = 1 << 40
"""Larger than any dataset indexable in memory; keeps every position and seed arithmetic exact in int64."""
MAX_EPOCH = 1 << 31
"""Epochs a sampler counts to: seed + epoch seeds the shuffle, and a checkpoint at epoch 10**18 is not a run."""
# Positions gathered per block while iterating: bounds the transient memory (8 MiB of int64) independent of N.
_BLOCK_POSITIONS = 1 << 20
# prefetch=None turns the background shuffle on from this N (randperm takes ~0.1 s here, ~3 s at 10**8).
PREFETCH_MIN_LEN = 1 << 22
OWN_LOOP_EPOCH_FIX = ("iterate `for batch in run.epoch(epoch, loader)`, or call sampler.set_epoch(epoch) before each "
                      "epoch's `for batch in loader`")


def interleave_owners(batch_sizes: Sequence[int]) -> np.ndarray:
    """Owner rank of each of the sum(batch_sizes) positions of a step (the weighted interleave).

    >>> interleave_owners([2, 2]).tolist()
    [0, 1, 0, 1]
    >>> interleave_owners([3, 1]).tolist()
    [0, 1, 0, 0]
    """
    sizes = np.asarray(batch_sizes, dtype=np.int64)
    ranks = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
    # k for each key: position inside its own rank's run of the repeat above
    starts = np.repeat(np.cumsum(sizes) - sizes, sizes)
    k = np.arange(len(ranks), dtype=np.int64) - starts
    keys = k / np.repeat(sizes, sizes).astype(np.float64)
    order = np.lexsort((ranks, keys))  # primary key: k / b_i; ties (equal fractions) by rank
    return ranks[order]


def _as_plan(plan: Plan | str | os.PathLike[str]) -> Plan:
    if isinstance(plan, (str, os.PathLike)):
        from planner.plan import Plan

        return Plan.load(plan)
    return plan


def plan_accumulation_steps(plan: Plan, loop: str | None = None) -> tuple[int, ...] | None:
    """The plan's per-rank micro-step counts k_i, or None when no rank accumulates (every rank one micro-step).

    Under FSDP every rank must run the same number of micro-steps (each forward all-gathers): refused when the
    plan says so (``plan.mode == "fsdp"``) or the loop does (``loop``, "ddp" or "fsdp": the kind of training loop
    that will run the plan, ``HeteroBatchSampler.from_plan(mode=)``).
    """
    if loop not in (None, "ddp", "fsdp"):
        raise ValidationError(f"mode must be 'ddp' or 'fsdp' (the kind of your training loop), got {str(loop)[:20]!r}")
    steps = tuple(int(r.accumulation_steps) for r in plan.ranks)
    if len(set(steps)) > 1 and plan.mode == "fsdp":
        raise ValidationError(f"plan mode 'fsdp' needs the same accumulation_steps on every rank, got {list(steps)}")
    if len(set(steps)) > 1 and loop == "fsdp":
        raise ValidationError(
            f"this is an FSDP2 loop but the plan (mode {plan.mode!r}) gives the ranks {list(steps)} micro-steps per "
            "optimizer step; each FSDP2 forward all-gathers, so every rank must run the same number -- re-plan "
            "with `planner plan --mode fsdp`")
    return steps if max(steps) > 1 else None


def int_arg(value: Any, name: str, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int, or ValidationError naming the argument: a bool, a non-integral or non-finite float
    (``rank=1.5`` used to be taken as 1), None, a string or a value outside [low, high] is refused."""
    ok = not isinstance(value, (bool, np.bool_)) and (
        isinstance(value, (int, np.integer)) or (isinstance(value, (float, np.floating)) and math.isfinite(value)
                                                 and float(value).is_integer()))
    if not ok:
        raise ValidationError(f"{name} must be an integer, got {type(value).__name__} {shown(value)}")
    number = int(value)
    if (low is not None and number < low) or (high is not None and number > high):
        bounds = f">= {low}" if high is None else f"<= {high}" if low is None else f"in {low}..{high}"
        raise ValidationError(f"{name} must be {bounds}, got {shown(number)}")
    return number


def bool_arg(value: Any, name: str) -> bool:
    """``value`` if it is a bool (numpy's included), else ValidationError naming the argument: ``shuffle='no'``
    is a non-empty string, which ``bool()`` reads as True, and 0/1 are not what the flag means either."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValidationError(f"{name} must be True or False, got {type(value).__name__} {shown(value)}")
    return bool(value)


def memory_bytes() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def permutation_bytes(dataset_len: int, prefetch: bool) -> int:
    """Bytes a shuffling sampler holds for its permutations: 4 a sample (int32; 8 past 2**31 samples,
    ``runtime.shuffle.epoch_permutation``), twice while the next epoch's is prefetched."""
    return dataset_len * (4 if dataset_len < 2**31 else 8) * (2 if prefetch else 1)


def check_fits_memory(dataset_len: int, prefetch: bool, memory: int | None) -> None:
    """Refuse a shuffle whose permutations exceed ``memory`` bytes (the machine's): unchecked,
    ``HeteroBatchSampler(2**40, [8], 0)`` was accepted, its prefetch thread asked torch for 4 TiB, and the
    process aborted at exit."""
    need = permutation_bytes(dataset_len, prefetch)
    if memory is not None and need > memory:
        raise ValidationError(
            f"dataset_len {dataset_len:,}: shuffling it holds {need / 2**30:,.1f} GiB of permutation"
            f"{'s (this epoch and the prefetched next)' if prefetch else ''}, more than this machine's "
            f"{memory / 2**30:,.1f} GiB of memory; check the dataset's length, or pass shuffle=False")


def _check_sizes(batch_sizes: Sequence[int], min_batch: int, what: str = "batch_sizes") -> tuple[int, ...]:
    if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Sequence):
        raise ValidationError(f"{what}: expected a list of per-rank batch sizes, got {type(batch_sizes).__name__}")
    if not batch_sizes:
        raise ValidationError(f"{what}: needs one batch size per rank, got an empty list")
    if len(batch_sizes) > MAX_WORLD_SIZE:
        raise ValidationError(f"{what}: {len(batch_sizes):,} ranks, more than the {MAX_WORLD_SIZE:,} supported")
    try:
        sizes = tuple(int_arg(b, f"{what}[{i}]") for i, b in enumerate(batch_sizes))
    except ValidationError:
        raise ValidationError(f"{what}: batch sizes must be integers, got {shown(list(batch_sizes), 80)}") from None
    low = [i for i, b in enumerate(sizes) if b < min_batch]
    if low:
        raise ValidationError(
            f"{what}: rank {low[0]} has batch size {sizes[low[0]]}, below min_batch {min_batch}; "
            f"give every rank at least {min_batch} samples (re-plan with --min-batch {min_batch})"
        )
    big = [i for i, b in enumerate(sizes) if b > MAX_BATCH]
    if big:
        raise ValidationError(f"{what}: rank {big[0]} batch size {sizes[big[0]]} exceeds the supported {MAX_BATCH}")
    return sizes


class HeteroBatchSampler(Sampler[list[int]]):
    """Yields this rank's batches of dataset indices with a per-rank batch size; one global step per batch
    (or per ``accumulation_steps[rank]`` micro-batches).

    Use it as ``DataLoader(dataset, batch_sampler=HeteroBatchSampler(...))``. ``rank`` and the batch sizes are
    explicit, so the sampler works (and tests) without a process group.

    Worked example: N = 10 samples, shuffle=False, batch_sizes = [3, 1] (B = 4), drop_last=False. The weighted
    interleave of one step is owners [0, 1, 0, 0]: rank 0 takes step positions 0, 2, 3 and rank 1 position 1.

    ======  =====================  ==========
    step    rank 0                 rank 1
    ======  =====================  ==========
    0       [0, 2, 3]              [1]
    1       [4, 6, 7]              [5]
    2       [8, 0]     (R=2)       [9]
    ======  =====================  ==========

    Step 2 is the partial step: R = 2 left, so r = (ceil(2*3/4), ceil(2*1/4)) = (2, 1); the interleave of [2, 1]
    is owners [0, 1, 0], i.e. positions 8, 9, then 10 which wraps to P[0] = 0. With batch_sizes = [2, 2] the
    batches are rank 0: [0, 2], [4, 6], [8] and rank 1: [1, 3], [5, 7], [9] -- exactly
    ``BatchSampler(DistributedSampler(range(10), 2, rank), 2, drop_last=False)``.

    Micro-batches: the same N = 10, batch_sizes = [3, 1] with accumulation_steps = [2, 1] keeps the steps above
    and cuts rank 0's positions into micro-batches of ceil(3/2) = 2 then 1: rank 0 yields [0, 2], [3], [4, 6],
    [7], [8, 0] (the partial step's 2 samples fit one micro-batch of 2) and rank 1 still [1], [5], [9]; both run
    3 optimizer steps. Use :func:`runtime.accumulate.micro_steps` to know where each step ends.

    .. warning::
        Call :meth:`set_epoch` at the start of every epoch, **before** creating the DataLoader iterator, as with
        DistributedSampler; a DataLoader drawing a second whole pass of the same epoch (a loop that never calls
        it) is refused, since every epoch would repeat that order.

    Checks (runtime/safety.py): under torch.distributed the first pass starts with one small collective on the
    main thread -- every rank raises the same one-line ValidationError when the ranks' layouts differ (another
    plan, dataset length, seed, epoch), two processes took one plan rank, or a DataLoader cuts other batches
    than the plan's (:class:`HeteroDistributedSampler`) -- and, for an uneven plan, the first backward through
    the DDP model raises when nothing weights the gradient (no ``register_weighted_hook``, no loss scale, no
    ``micro_steps``); :meth:`declare_weighting` tells it that your own code does.

    Args:
        dataset_len: number of samples N in the dataset (every rank must pass the same N).
        batch_sizes: local batch size of every rank, indexed by rank; the global batch is their sum.
        rank: this process's rank, 0 <= rank < len(batch_sizes).
        seed: shuffling seed, identical on every rank.
        shuffle: permute the dataset each epoch (seed + epoch) or keep range(N).
        drop_last: drop the last partial global step instead of padding it.
        min_batch: no rank ever gets a batch (or micro-batch) smaller than this (2 for models with BatchNorm).
        accumulation_steps: micro-batches per optimizer step of every rank, k_i (None: 1 everywhere). Each step's
            b_i samples are yielded as k_i micro-batches, larger first; the epoch's partial last step uses the
            fewest micro-batches that fit ceil(b_i/k_i) (see :func:`runtime.accumulate.partial_micro_layout`),
            the same number on every rank when every k_i is equal (FSDP2 needs that).
        prefetch: build the next epoch's shuffle on a background thread, so epoch starts do not wait for
            ``torch.randperm(N)`` (about 3 s at N = 10**8; DistributedSampler waits for it and for N Python ints
            every epoch). The thread starts when the sampler is built and when an epoch's first batch is drawn --
            after a DataLoader has forked its workers -- and is joined before the next epoch's first batch, so it
            never runs across a DataLoader's fork. It holds one extra int32 permutation (4 bytes/sample) while it
            runs ahead. The order is identical with or without it. Default (None): on when shuffling and
            N >= 2**22.
    """

    def __init__(self, dataset_len: int, batch_sizes: Sequence[int], rank: int, *, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False, min_batch: int = 1,
                 prefetch: bool | None = None, accumulation_steps: Sequence[int] | None = None) -> None:
        self.dataset_len = int_arg(dataset_len, "dataset_len", low=1, high=MAX_DATASET_LEN)
        self.min_batch = int_arg(min_batch, "min_batch", low=1, high=MAX_BATCH)
        sizes = _check_sizes(batch_sizes, self.min_batch)
        self.rank = int_arg(rank, "rank", low=0)
        if self.rank >= len(sizes):
            raise ValidationError(f"rank {rank} is outside 0..{len(sizes) - 1} for {len(sizes)} batch sizes")
        self.seed = int_arg(seed, "seed", low=0, high=2**63 - 1 - MAX_EPOCH)
        self.shuffle = bool_arg(shuffle, "shuffle")
        self.drop_last = bool_arg(drop_last, "drop_last")
        if prefetch is not None:
            prefetch = bool_arg(prefetch, "prefetch")
        if self.shuffle:
            will_prefetch = self.dataset_len >= PREFETCH_MIN_LEN if prefetch is None else prefetch
            check_fits_memory(self.dataset_len, will_prefetch, memory_bytes())
        global_batch = sum(sizes)
        if global_batch > max(self.dataset_len, SMALL_LAYOUT):
            # One step would hold the whole dataset and more, and the step's layout costs 8-24 bytes a position of
            # the global batch (2**26 on 100 samples took GBs): bounded by the dataset, as DistributedSampler's
            # padding is, with a small allowance for toy datasets.
            raise ValidationError(
                f"the global batch {global_batch} (batch sizes {shown(list(sizes), 60)}) exceeds the dataset's "
                f"{self.dataset_len} samples; plan a global batch of at most {self.dataset_len}")
        if self.drop_last and self.dataset_len < global_batch:
            raise ValidationError(
                f"dataset has {self.dataset_len} samples, fewer than one global step of {global_batch} "
                f"(batch sizes {list(sizes)}), so drop_last=True leaves 0 steps; use drop_last=False or a smaller "
                "global batch"
            )
        self._epoch = 0
        self._sizes = sizes
        self._steps = check_accumulation(sizes, accumulation_steps, self.min_batch)
        self._pending: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # (batch sizes, accumulation steps)
        # Positions are (step, micro-step of this rank inside it); the micro-step is 0 without accumulation.
        self._resume = (0, 0)  # where the next iteration starts (set by load_state_dict)
        self._generation = 0  # incremented by every __iter__: tells the gradient hook a new pass began
        self._first_pass_checked = False  # runtime.safety.check_first_pass ran (or is not this sampler's to run)
        self._loader_cut: tuple[int, bool] | None = None  # (batch_size, drop_last) of HeteroDistributedSampler's loader
        self._generation_start = (0, 0)  # position the current pass started at
        self._drawn_since_set_epoch = False  # a DataLoader drew a pass since the last set_epoch (or construction)
        self.weighting_fix: str | None = None
        """The fix the first-backward weighting check names when nothing weights an uneven plan's gradient (None:
        an own loop's, runtime.safety.OWN_LOOP_WEIGHTING_FIX); an adapter that builds the sampler names its own."""
        self.epoch_fix = OWN_LOOP_EPOCH_FIX
        """The fix named when a DataLoader draws a second whole pass of one epoch (an adapter may name its own)."""
        self._cursor = (0, 0)  # next position to yield (runs ahead of training when a DataLoader prefetches)
        self._layout_cache: dict[tuple[int, ...], np.ndarray] = {}
        self.prefetch = self.shuffle and (self.dataset_len >= PREFETCH_MIN_LEN if prefetch is None else bool(prefetch))
        self._prefetched: PermutationPrefetch | None = None
        self._start_prefetch(self._epoch)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_prefetched"] = None  # a thread is not copied or pickled; the copy shuffles on demand
        return state

    # -- construction from a plan -------------------------------------------------------------------------
    @classmethod
    def from_plan(cls, plan: Plan | str | os.PathLike[str], rank: int, dataset_len: int, *,
                  mode: str | None = None, **kw: Any) -> HeteroBatchSampler:
        """A sampler with the plan's batch sizes, accumulation steps and min_batch (``kw``: seed, shuffle,
        drop_last, min_batch, accumulation_steps).

        ``plan`` is a Plan or the path of a plan JSON file (loaded and fingerprint-checked).  ``mode="fsdp"``
        names the loop an FSDP2 loop: a plan whose ranks run different numbers of micro-steps is then refused on
        every rank, before the first batch (each FSDP2 forward all-gathers, so a rank that runs fewer forwards
        would leave its peers waiting in an all-gather forever).
        """
        plan = _as_plan(plan)
        kw.setdefault("min_batch", plan.min_batch)
        kw.setdefault("accumulation_steps", plan_accumulation_steps(plan, loop=mode))
        return cls(dataset_len, plan.batch_sizes, rank, **kw)

    # -- what every rank can compute without communicating ----------------------------------------------
    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """Batch sizes of the current epoch (a pending re-plan is not included until it takes effect)."""
        return self._sizes

    @property
    def accumulation_steps(self) -> tuple[int, ...]:
        """Micro-batches per full optimizer step of every rank in the current epoch (k_i)."""
        return self._steps

    @property
    def world_size(self) -> int:
        return len(self._sizes)

    @property
    def global_batch(self) -> int:
        return sum(self._sizes)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def num_full_steps(self) -> int:
        return self.dataset_len // self.global_batch

    @property
    def num_steps(self) -> int:
        """Global (optimizer) steps per epoch, the same on every rank; with one micro-step, the batches yielded."""
        partial = self.dataset_len % self.global_batch != 0 and not self.drop_last
        return self.num_full_steps + int(partial)

    @property
    def generation(self) -> int:
        """Number of passes started (each ``__iter__``); the gradient hook resets its step count on change."""
        return self._generation

    @property
    def start_step(self) -> int:
        """Step the current pass started at (0, or the resumed step after ``load_state_dict``)."""
        return (self._generation_start if self._generation else self._resume)[0]

    @property
    def start_micro_step(self) -> int:
        """This rank's micro-step inside :attr:`start_step` where the current pass started (0 unless resumed
        mid-step)."""
        return (self._generation_start if self._generation else self._resume)[1]

    def _partial_layout(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        # r_i = max(min_batch, ceil(R * b_i / B)), then what the micro-batches need (unchanged with k_i = 1)
        remaining = self.dataset_len - self.num_full_steps * self.global_batch
        big_b = self.global_batch
        proportional = [max(self.min_batch, -(-remaining * b // big_b)) for b in self._sizes]
        return partial_micro_layout(proportional, self._sizes, self._steps, self.min_batch)

    def partial_sizes(self) -> tuple[int, ...]:
        """Every rank's batch size in the last partial step: max(min_batch, ceil(R * b_i / B)), raised where its
        micro-batches would fall below min_batch (:func:`runtime.accumulate.partial_micro_layout`)."""
        return self._partial_layout()[0]

    def counts_at(self, step: int) -> tuple[int, ...]:
        """Every rank's number of samples at global step ``step`` of the current epoch (last step included)."""
        if not 0 <= step < self.num_steps:
            raise IndexError(f"step {step} is outside 0..{self.num_steps - 1} of epoch {self._epoch}")
        return self._sizes if step < self.num_full_steps else self.partial_sizes()

    def micro_sizes_at(self, step: int) -> tuple[tuple[int, ...], ...]:
        """Every rank's micro-batch sizes at global step ``step`` of the current epoch, in the order yielded."""
        counts = self.counts_at(step)
        parts = self._steps if step < self.num_full_steps else self._partial_layout()[1]
        return tuple(tuple(micro_batch_sizes(n, k)) for n, k in zip(counts, parts, strict=True))

    def __len__(self) -> int:
        """Batches (micro-batches) this rank yields per epoch; ``num_steps`` when nobody accumulates."""
        full = self.num_full_steps * self._steps[self.rank]
        return full + (self._partial_layout()[1][self.rank] if self.num_steps > self.num_full_steps else 0)

    # -- epochs and re-plans -----------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the shuffle of epoch ``epoch`` (seed + epoch). Call before creating the DataLoader iterator.

        A new epoch number starts from step 0 and applies a pending :meth:`set_batch_sizes`; setting the same
        epoch again keeps a resumed position (so ``load_state_dict`` followed by ``set_epoch(saved_epoch)`` works).
        """
        epoch = int_arg(epoch, "epoch", low=0, high=MAX_EPOCH)
        self._drawn_since_set_epoch = False
        if epoch != self._epoch:
            self._epoch = epoch
            self._resume = (0, 0)
            self._apply_pending()
            self._drop_stale_prefetch()

    def set_batch_sizes(self, batch_sizes: Sequence[int], accumulation_steps: Sequence[int] | None = None) -> None:
        """Adopt new per-rank batch sizes (and micro-steps) from the next epoch start on (never mid-epoch).

        The global batch must stay the same: then every epoch still covers each sample exactly once, and the
        optimizer's hyper-parameters (tuned for that global batch) stay valid. ``accumulation_steps`` is the new
        plan's k_i (None: one micro-step per rank, as in the constructor): pass it whenever the plan has it.
        """
        sizes = _check_sizes(batch_sizes, self.min_batch)
        if len(sizes) != self.world_size:
            raise ValidationError(f"set_batch_sizes: got {len(sizes)} batch sizes for world size {self.world_size}")
        if sum(sizes) != self.global_batch:
            raise ValidationError(
                f"set_batch_sizes: new batch sizes {list(sizes)} sum to {sum(sizes)} but the global batch is "
                f"{self.global_batch}; a re-plan must keep the global batch"
            )
        steps = check_accumulation(sizes, accumulation_steps, self.min_batch, "set_batch_sizes: accumulation_steps")
        self._pending = None if (sizes, steps) == (self._sizes, self._steps) else (sizes, steps)

    def _apply_pending(self) -> None:
        if self._pending is not None:
            (self._sizes, self._steps), self._pending = self._pending, None

    def declare_weighting(self, how: str = "own") -> None:
        """Say that the gradient is weighted by code the checks cannot see (your own loss factor), so the first
        backward of an uneven plan does not refuse to run unweighted.  Not needed with ``register_weighted_hook``,
        ``runtime.loss_scale``, ``accumulation_weight``, ``micro_steps``, ``step_weights`` or ``PlannedRun``:
        each of them says so itself."""
        note_weighting(str(how))

    # -- checkpointing -----------------------------------------------------------------------------------
    def state_dict(self, steps_done: int | None = None, *, micro_steps_done: int = 0) -> dict[str, Any]:
        """State to resume mid-epoch.

        Args:
            steps_done: steps your training loop has finished in this epoch (batches consumed, without
                accumulation). Pass it when the DataLoader has workers: they prefetch, so the sampler's own
                position runs ahead of training. Default: the sampler's position (exact with ``num_workers=0``).
            micro_steps_done: with ``steps_done``, this rank's micro-batches of the next step already consumed
                (0 when you save after an optimizer step -- the usual place, where every rank's state is the same).
        """
        if steps_done is None:
            step, micro = self._cursor if self._generation else self._resume
        else:
            step, micro = int(steps_done), int(micro_steps_done)
        self._check_position(step, micro, "state_dict: steps_done")
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "step": step,
            "seed": self.seed,
            "dataset_len": self.dataset_len,
            "world_size": self.world_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "min_batch": self.min_batch,
            "batch_sizes": list(self._sizes),
            "pending_batch_sizes": None if self._pending is None else list(self._pending[0]),
            # Absent or None in states without accumulation (and in those saved before it existed): all ones.
            "accumulation_steps": list(self._steps) if max(self._steps) > 1 else None,
            "pending_accumulation_steps": (list(self._pending[1]) if self._pending and max(self._pending[1]) > 1
                                           else None),
            "micro_step": micro,
        }

    def _check_position(self, step: int, micro: int, what: str) -> None:
        if not 0 <= step <= self.num_steps:
            raise ValidationError(f"{what} {step} is outside 0..{self.num_steps}")
        count = len(self.micro_sizes_at(step)[self.rank]) if step < self.num_steps else 1
        if not 0 <= micro < count:
            raise ValidationError(f"{what}: micro-step {micro} is outside 0..{count - 1} of step {step} on rank "
                                  f"{self.rank}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration starts at the saved step of the saved epoch with the saved batch sizes."""
        if not isinstance(state, dict):
            raise ValidationError(f"sampler state: expected a dict, got {type(state).__name__}")
        if state.get("version") != STATE_VERSION:
            raise ValidationError(f"sampler state version {shown(state.get('version'), 20)} is not {STATE_VERSION}")
        required = ("epoch", "step", "batch_sizes", "dataset_len", "seed", "world_size", "shuffle", "drop_last",
                    "min_batch")
        missing = [key for key in required if key not in state]
        if missing:
            raise ValidationError(f"sampler state: missing {', '.join(missing)}; not a state this sampler saved")
        for key in ("dataset_len", "seed", "world_size", "shuffle", "drop_last", "min_batch"):
            mine = getattr(self, key)
            if type(state[key]) is not type(mine) or state[key] != mine:
                raise ValidationError(
                    f"sampler state was saved with {key}={shown(state[key])} but this sampler has {key}={shown(mine)}; "
                    "resume with the same dataset, seed, world size and sampler options"
                )
        sizes = _check_sizes(state["batch_sizes"], self.min_batch, "state.batch_sizes")
        pending = state.get("pending_batch_sizes")
        if pending is not None:
            pending = _check_sizes(pending, self.min_batch, "state.pending")
        # A resume keeps the global batch (a re-plan moves samples between ranks, never adds any): a state with
        # another one is not this run's, and a huge one would train at that size.
        for what, saved in (("state.batch_sizes", sizes), ("state.pending_batch_sizes", pending)):
            if saved is not None and (len(saved) != self.world_size or sum(saved) != sum(self._sizes)):
                raise ValidationError(
                    f"{what} {shown(list(saved), 60)} is not a split of this sampler's global batch {sum(self._sizes)} "
                    f"over {self.world_size} ranks; resume with the plan the run was saved with")
        steps = check_accumulation(sizes, state.get("accumulation_steps"), self.min_batch, "state.accumulation_steps")
        self._pending = None if pending is None else (
            pending, check_accumulation(pending, state.get("pending_accumulation_steps"), self.min_batch,
                                        "state.pending_accumulation_steps"))
        self._sizes, self._steps = sizes, steps
        self._epoch = int_arg(state["epoch"], "sampler state epoch", low=0, high=MAX_EPOCH)
        position = (int_arg(state["step"], "sampler state step", low=0),
                    int_arg(state.get("micro_step", 0), "sampler state micro_step", low=0))
        self._check_position(*position, "sampler state step")
        self._resume = self._generation_start = self._cursor = position
        self._drawn_since_set_epoch = False  # a resumed pass is the saved epoch's, not a repeat
        self._drop_stale_prefetch()

    # -- iteration ---------------------------------------------------------------------------------------
    def _owners(self, sizes: tuple[int, ...]) -> np.ndarray:
        owners = self._layout_cache.get(sizes)
        if owners is None:
            owners = interleave_owners(sizes)
            self._layout_cache = {sizes: owners}  # one vector at a time: re-plans must not grow this
        return owners

    def _shuffle_key(self, epoch: int) -> tuple[int, int]:
        """(N, generator seed) of epoch ``epoch``'s permutation: what a prefetched shuffle is matched on."""
        return self.dataset_len, self.seed + epoch

    def _start_prefetch(self, epoch: int) -> None:
        key = self._shuffle_key(epoch)
        if self.prefetch and (self._prefetched is None or self._prefetched.key != key):
            self._prefetched = PermutationPrefetch(*key)

    def _permutation(self) -> torch.Tensor | None:
        if not self.shuffle:
            return None  # identity: generated block by block instead of holding arange(N)
        key = self._shuffle_key(self._epoch)
        ready = self._prefetched
        if ready is not None and ready.key == key:
            self._prefetched = None
            perm = ready.take()
            if perm is not None:
                return perm
        return epoch_permutation(*key)

    def _drop_stale_prefetch(self) -> None:
        """Forget a shuffle built for another epoch (its thread ends on its own; the memory goes with it)."""
        if self._prefetched is not None and self._prefetched.key != self._shuffle_key(self._epoch):
            self._prefetched = None

    def __iter__(self) -> Iterator[list[int]]:
        _refuse_rebatching(self)
        if self._repeats_epoch():
            # Raised at the first batch, not here: a multi-process DataLoader iterator that fails in its
            # constructor cannot shut itself down (an "Exception ignored in __del__" besides the line).
            return _refused(ValidationError(
                f"the planned sampler is drawn again in epoch {self._epoch} without set_epoch: every epoch would "
                f"repeat epoch {self._epoch}'s order, and a re-plan would never apply; {self.epoch_fix}"))
        return self._batches(self.begin_pass(), self._permutation())

    def _repeats_epoch(self) -> bool:
        """A DataLoader starts a pass from step 0 after a whole pass of the same epoch, with no ``set_epoch`` (nor
        ``load_state_dict``) between: the loop never advances the epoch.  A pass only begun (a first batch looked
        at, a loop that broke off) is not one."""
        return (self._resume == (0, 0) and self._drawn_since_set_epoch and self._cursor == (self.num_steps, 0)
                and drawn_by_dataloader())

    def begin_pass(self) -> tuple[int, int]:
        """Start a pass as ``iter()`` does -- from step 0 (applying a pending re-plan) or from the resumed position
        -- without making its batches; returns the (step, micro-step) it starts at.  For a training loop whose
        DataLoader iterates a copy of this sampler (:class:`EpochStream`): this sampler then still says where the
        pass starts (``start_step``) and that a new pass began (``generation``, which the gradient hook reads).

        The first pass a DataLoader draws runs :func:`runtime.safety.check_first_pass` (collective under
        torch.distributed, on the main thread only: a first pass started on another thread or in a DataLoader
        worker skips it), and every such pass of an uneven plan arms the weighting check
        (:func:`runtime.safety.arm_weighting_check`).  Passes that code draws itself (``list(sampler)``) are not
        checked."""
        start, self._resume = self._resume, (0, 0)
        if start == (0, 0):
            self._apply_pending()  # a pass from step 0 is an epoch start
        if drawn_by_dataloader():
            self._drawn_since_set_epoch = True
            if not self._first_pass_checked:
                self._first_pass_checked = True
                if on_main_thread():
                    check_first_pass(self, start[0], self._loader_cut)
            arm_weighting_check(self)
        self._generation += 1
        self._generation_start = self._cursor = start
        return start

    def batches_in_pass(self, max_steps: int | None = None) -> int:
        """Batches (micro-batches) this rank yields in the current pass, from its start position to the epoch's
        end, or over its first ``max_steps`` steps."""
        step, micro = self._generation_start if self._generation else self._resume
        stop = self.num_steps if max_steps is None else min(self.num_steps, step + max_steps)
        if stop <= step:
            return 0
        full_end = min(stop, self.num_full_steps)
        n = max(0, full_end - step) * self._steps[self.rank]
        if stop > self.num_full_steps:  # the partial last step
            n += len(self.micro_sizes_at(self.num_full_steps)[self.rank])
        return n - micro

    def _cut(self, row: list[int], parts: Sequence[int], step: int, first: int) -> Iterator[list[int]]:
        """Yield ``row`` (this rank's indices of one step) as micro-batches of sizes ``parts``, from ``first``."""
        offsets = np.cumsum([0, *parts]).tolist()
        for j in range(first, len(parts)):
            self._cursor = (step, j + 1) if j + 1 < len(parts) else (step + 1, 0)
            yield row[offsets[j]:offsets[j + 1]]

    def _batches(self, start: tuple[int, int], perm: torch.Tensor | None) -> Iterator[list[int]]:
        # Runs at the first next(): a DataLoader has forked this epoch's workers by then (see ``prefetch``).
        self._start_prefetch(self._epoch + 1)
        big_b, n = self.global_batch, self.dataset_len
        full = self.num_full_steps
        first_step, first_micro = start
        mine = torch.from_numpy(np.flatnonzero(self._owners(self._sizes) == self.rank))
        parts = micro_batch_sizes(self._sizes[self.rank], self._steps[self.rank])
        steps_per_block = max(1, _BLOCK_POSITIONS // big_b)
        for s0 in range(first_step, full, steps_per_block):
            s1 = min(full, s0 + steps_per_block)
            lo, hi = s0 * big_b, s1 * big_b
            block = torch.arange(lo, hi) if perm is None else perm[lo:hi]
            for s, row in enumerate(block.view(s1 - s0, big_b)[:, mine].tolist(), start=s0):
                if len(parts) == 1:  # no accumulation: the step is the batch (the common, fast path)
                    self._cursor = (s + 1, 0)
                    yield row
                else:
                    yield from self._cut(row, parts, s, first_micro if s == first_step else 0)
        if self.num_steps > full and first_step <= full:
            sizes = self.partial_sizes()
            owners = interleave_owners(sizes)
            pos = torch.from_numpy(np.flatnonzero(owners == self.rank)) + full * big_b
            pos = pos % n  # wrap-around padding (repeatedly when N is tiny), as DistributedSampler pads
            row = (pos if perm is None else perm[pos]).tolist()
            yield from self._cut(row, self.micro_sizes_at(full)[self.rank], full, first_micro if first_step == full
                                 else 0)


class EpochStream(Sampler[list[int]]):
    """A :class:`HeteroBatchSampler`'s epochs back to back -- the rest of the current one, then the next, up to
    ``last_epoch`` (exclusive) -- so that one DataLoader iterator lives across epoch boundaries and its workers
    build the next epoch's first batches while the GPU runs this epoch's last ones.

    Why: an iterator made per epoch (``for batch in loader`` after ``set_epoch``) starts empty.  Its first batch
    waits for one worker to build all of it, and its workers then build at once; at the epoch's end they fall idle
    once the sampler has run out.  On 2x H100, ResNet-50, 28 workers building batches of 455 PIL samples:
    step 0 of each epoch waited 2.4-4.9 s for data, and 100-step epochs ran at 0.62-0.69 of the plan's pace by the
    wall clock (docs/PERFORMANCE.md).  Streamed, only the first epoch (and the one after a re-plan, which
    needs a new stream) starts empty.

    The stream iterates a copy of ``sampler`` taken here: its batch sizes, its epoch and its resumed position (a
    checkpoint's mid-epoch step).  Build a new stream (and DataLoader) when the sizes change.  The training loop
    keeps the original for the layout: per epoch ``set_epoch(e)``, then :meth:`HeteroBatchSampler.begin_pass`, and
    it takes :meth:`HeteroBatchSampler.batches_in_pass` batches from the iterator (``planner.cli.steps.StreamedEpochs``).
    ``max_steps``: every epoch cut to its first ``max_steps`` steps, as such a loop stops early.

        stream = EpochStream(sampler, last_epoch=epochs)
        it = iter(DataLoader(dataset, batch_sampler=stream, num_workers=8, persistent_workers=True))
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            sampler.begin_pass()
            for batch in itertools.islice(it, sampler.batches_in_pass()):
                ...
    """

    def __init__(self, sampler: HeteroBatchSampler, last_epoch: int, max_steps: int | None = None) -> None:
        if max_steps is not None and max_steps < 1:
            raise ValidationError(f"max_steps must be >= 1 or None, got {max_steps}")
        self._source = copy.deepcopy(sampler)  # the prefetch thread is not copied (__getstate__) ...
        self._source._first_pass_checked = True  # the loop's own sampler runs the check, in its begin_pass
        # ... but handed over: the stream, not the sampler, now shuffles the epochs (the sampler only lays them out)
        self._prefetched, sampler._prefetched = sampler._prefetched, None
        self.last_epoch, self.max_steps = int(last_epoch), max_steps

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return self._source.batch_sizes

    @property
    def accumulation_steps(self) -> tuple[int, ...]:
        return self._source.accumulation_steps

    def __iter__(self) -> Iterator[list[int]]:
        s = copy.deepcopy(self._source)  # every pass of the stream starts where the stream was made
        if self._prefetched is not None:  # the first pass takes the shuffle the sampler started building
            s._prefetched, self._prefetched = self._prefetched, None
        for epoch in range(s.epoch, self.last_epoch):
            s.set_epoch(epoch)  # the same epoch keeps the resumed position
            batches = iter(s)
            stop = None if self.max_steps is None else s.start_step + self.max_steps
            for batch in batches:
                yield batch
                if stop is not None and s._cursor == (stop, 0):  # the step after this batch
                    break


def _refused(error: ValidationError) -> Iterator[list[int]]:
    raise error
    yield  # a generator: the error comes at the first batch


def _refuse_rebatching(sampler: HeteroBatchSampler) -> None:
    """Refuse a torch ``BatchSampler`` (or subclass) iterating ``sampler``, before its first batch: as its
    ``sampler`` -- a DataLoader given it as ``sampler=`` with a ``batch_size`` groups that many planned batches into
    one -- or as its ``batch_sampler`` -- a wrapper that deals the planned batches out again, as accelerate's
    ``BatchSamplerShard`` does to a plain ``batch_sampler=`` loader passed to ``accelerator.prepare`` (each process
    then trains every W-th of its own batches).  Read from the caller's frames, as ``_loader_cut``."""
    frame: FrameType | None = sys._getframe(2)  # 0: this function, 1: HeteroBatchSampler.__iter__
    mine = f"rank {sampler.rank}: {sampler.batch_sizes[sampler.rank]} samples a step"
    for _ in range(3):
        if frame is None:
            return
        owner = frame.f_locals.get("self")
        if isinstance(owner, BatchSampler) and getattr(owner, "sampler", None) is sampler:
            raise ValidationError(
                f"the planned sampler yields whole batches ({mine}) but the DataLoader got it as sampler= with "
                f"batch_size={owner.batch_size}, which groups {owner.batch_size} of them into one; pass it as "
                "DataLoader(dataset, batch_sampler=sampler) without batch_size")
        if isinstance(owner, BatchSampler) and getattr(owner, "batch_sampler", None) is sampler:
            raise ValidationError(
                f"the planned sampler's batches ({mine}) are dealt out again by a {type(owner).__name__} (what "
                "accelerator.prepare makes of a DataLoader(batch_sampler=...)), so each process would train a share "
                "of its own batches; build the loader with runtime.adapters.accelerate.planned_dataloader, which "
                "prepare leaves as it is")
        frame = frame.f_back


def _loader_cut(sampler: HeteroDistributedSampler) -> tuple[int, bool] | None:
    """(batch_size, drop_last) of the torch BatchSampler iterating ``sampler`` -- how a DataLoader given
    ``sampler=`` and ``batch_size=`` cuts its indices into batches -- read from the caller's frame (the
    BatchSampler's ``__iter__`` calls ``iter(sampler)``); None when something else iterates it."""
    frame: FrameType | None = sys._getframe(2)  # 0: this function, 1: HeteroDistributedSampler.__iter__
    for _ in range(3):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, BatchSampler) and owner.sampler is sampler:
            return int(owner.batch_size), bool(owner.drop_last)
        frame = frame.f_back
    return None


class HeteroDistributedSampler(Sampler[int]):
    """Single-index twin of :class:`HeteroBatchSampler` for code that insists on ``sampler=`` + ``batch_size=``.

    Yields this rank's indices in batch order. Use it with ``DataLoader(ds, sampler=s, batch_size=s.batch_size,
    drop_last=False)``: the loader then cuts exactly the planned batches, and the last batch of the epoch is the
    plan's partial step (r_i <= b_i always holds). Any other ``batch_size`` or ``drop_last=True`` breaks the
    step alignment between ranks: the first pass refuses it, on every rank (it reads the cut from the torch
    ``BatchSampler`` that iterates this sampler, runtime.safety.check_first_pass). Same arguments as HeteroBatchSampler; plans with gradient accumulation are
    refused (a fixed ``batch_size`` cannot cut their uneven micro-batches).
    """

    def __init__(self, dataset_len: int, batch_sizes: Sequence[int], rank: int, **kw: Any) -> None:
        self.batch_sampler = HeteroBatchSampler(dataset_len, batch_sizes, rank, **kw)
        self._check_one_micro_step()

    def _check_one_micro_step(self) -> None:
        # A DataLoader's fixed batch_size cannot cut the plan's uneven micro-batches (ceil then floor).
        steps = self.batch_sampler.accumulation_steps
        if max(steps) > 1:
            raise ValidationError(
                f"HeteroDistributedSampler yields one fixed-size batch per step, but the plan accumulates "
                f"(accumulation_steps {list(steps)}); use HeteroBatchSampler as the DataLoader's batch_sampler="
            )

    @classmethod
    def from_plan(cls, plan: Plan | str | os.PathLike[str], rank: int, dataset_len: int,
                  **kw: Any) -> HeteroDistributedSampler:
        plan = _as_plan(plan)
        kw.setdefault("min_batch", plan.min_batch)
        kw.setdefault("accumulation_steps", plan_accumulation_steps(plan))  # refused: see _check_one_micro_step
        return cls(dataset_len, plan.batch_sizes, rank, **kw)

    @property
    def batch_size(self) -> int:
        """The ``batch_size`` to give the DataLoader: this rank's planned local batch."""
        return self.batch_sampler.batch_sizes[self.batch_sampler.rank]

    def __iter__(self) -> Iterator[int]:
        self._check_one_micro_step()  # a re-plan or a loaded state may have brought accumulation
        self.batch_sampler._loader_cut = _loader_cut(self)
        return self._indices(iter(self.batch_sampler))  # iter(): the pass starts now (and checks the loader's cut)

    @staticmethod
    def _indices(batches: Iterator[list[int]]) -> Iterator[int]:
        for batch in batches:
            yield from batch

    def __len__(self) -> int:
        bs = self.batch_sampler
        full = bs.num_full_steps * self.batch_size
        return full + (bs.partial_sizes()[bs.rank] if bs.num_steps > bs.num_full_steps else 0)

    def __getattr__(self, name: str) -> Any:
        # set_epoch, counts_at, state_dict, num_steps, generation, ...: delegate, so the hook accepts either
        if name == "batch_sampler":
            raise AttributeError(name)
        return getattr(self.batch_sampler, name)
