"""What synchronous data parallelism adds to a step: measured, not assumed.

The plan predicts a synchronous step under DDP as  max_i [f_i (t_i(b_i) - o_i) + o_i] + tail  (planner.solve),
where t_i are the ranks' standalone steps and o_i their optimizer steps.  Both terms come from a few real DDP
steps, run with the same step code as the compute sweep (and the trainer), emulated slowdowns included, at two
splits interleaved round by round:

  * equal: every rank at one common batch b.  ``exposed = t_DDP(b) - max_i t_i(b)`` with t_DDP the slowest
    rank's mean step (every rank waits for it): the all-reduce tail after the last bucket, DDP's per-step CPU
    work (bucket copies, hooks, the buffer broadcast) and the kernel launches it delays.  On a launch-bound GPU
    this is most of the gap between prediction and measurement (ResNet-18 at 32x32 on H200: 9.4 ms predicted,
    13.9 ms measured under DDP).
  * balanced: the split that makes the standalone times equal (planner.comm_model.balanced_split), the one a
    plan lands near.  Each rank's compute -- its step start to its last gradient bucket, marked by a comm hook
    (CUDA events on GPU, the host clock on CPU) -- over its standalone compute gives f_i: a rank whose
    all-reduce kernels wait for a later peer's buckets runs its own backward slower (+7-14% at F = 3 on 2x H100/H200).
    The same split's step less the slowest span and its optimizer step is the tail; ``exposed`` above is taken
    against standalone steps, holds the slowest rank's stretch, and stands in where no factors apply (FSDP).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from planner.comm_model import balanced_split, relative_spread, span_factors, span_tail_s, wait_factors
from planner.curves import fit_envelope
from planner.profile import RankProfile
from profiler.compute import TimedSteps
from runtime.compress import WIRE_DTYPES, check_compress, sum_on_wire

BALANCED_MAX_STEPS = 4.0
"""The balanced split's step is at most this many times the equal split's (its cost stays near the equal one's)."""


def common_batch(ranks: Sequence[RankProfile]) -> int:
    """A batch every rank has measured near: the smallest of the ranks' median measured batch sizes."""
    return min(int(statistics.median_low([p.batch_size for p in r.compute])) for r in ranks)


DDP_EQUAL_STEP_LIMIT_S = 0.25
"""The equal split's DDP measurement uses the largest batch whose slowest step stays under this (cheap, and
compute-bound where it can be)."""


def ddp_equal_batch(ranks: Sequence[RankProfile]) -> int:
    """The equal split's batch for the DDP measurement: the largest batch every rank ran safely whose slowest step
    is under DDP_EQUAL_STEP_LIMIT_S, never below common_batch.  In a launch-bound regime DDP's reducer work is not
    hidden: on 2x H100 (ResNet-50 bf16, rank 1 emulated 3x) the equal split at 48 added 15 ms per step, at 96
    1.2 ms, and the plans' own regime (~400/110) ~6 ms -- so measure where plans run, not at the median batch."""
    curves = [fit_envelope(r.compute) for r in ranks]
    cap = min(safe_batch(r) for r in ranks)
    sizes = sorted({p.batch_size for r in ranks for p in r.compute if p.batch_size <= cap}, reverse=True)
    for b in sizes:
        if max(c(b) for c in curves) <= DDP_EQUAL_STEP_LIMIT_S:
            return max(b, common_batch(ranks))
    return common_batch(ranks)


def safe_batch(rank: RankProfile) -> int:
    """The largest measured batch of a rank that leaves room for DDP's buckets: its largest, or the one below
    when the sweep stopped at a batch that did not fit (the largest then sits just under the memory limit)."""
    sizes = sorted(p.batch_size for p in rank.compute)
    if rank.meta.get("sweep_stop") == "does not fit" and len(sizes) > 1:
        return sizes[-2]
    return sizes[-1]


def balanced_batches(ranks: Sequence[RankProfile], *, min_batch: int = 1) -> list[int]:
    """The largest balanced split within what every rank ran safely: the common time T = min_i t_i(cap_i), at
    which the first rank reaches its largest safe batch (at most BALANCED_MAX_STEPS equal steps), and each rank's
    batch at T.  A plan's regime (the wait
    a fast rank sees is a share of its SMs, small while a small batch leaves the GPU half idle), never a batch
    beyond what the rank was seen to run."""
    caps = [safe_batch(r) for r in ranks]
    curves = [fit_envelope(r.compute) for r in ranks]
    b = common_batch(ranks)
    # At most BALANCED_MAX_STEPS equal steps long: a long sweep must not make the DDP measurement long.
    t = min(min(c(cap) for c, cap in zip(curves, caps, strict=True)), BALANCED_MAX_STEPS * max(c(b) for c in curves))
    lo = min(min_batch, min(caps))
    # A flat curve fits any batch within T (inf): its cap bounds it.
    total = sum(max(lo, int(min(float(cap), c.max_batch_within(t)))) for c, cap in zip(curves, caps, strict=True))
    return balanced_split(curves, total, min_batch=lo, caps=caps)


class _Marks:
    """Step start and last-bucket-ready times of this rank: device events on CUDA (read after a sync), the host
    clock on CPU (ops there are synchronous, so the hook runs when the bucket's gradients exist)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.steps: list[list[Any]] = []  # [start, last bucket] per step

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def start(self) -> None:
        self.steps.append([self._now(), None])

    def bucket(self) -> None:
        if self.steps:
            self.steps[-1][1] = self._now()  # the last call of a step wins: the last bucket

    def take_compute_s(self) -> list[float]:
        """Seconds from start to last bucket of each marked step (call after the device is synchronized)."""
        out = []
        for s, e in self.steps:
            if e is None:
                continue
            out.append(s.elapsed_time(e) / 1000.0 if self.cuda else e - s)
        self.steps = []
        return out


def _hooked_ddp(model: torch.nn.Module, device: torch.device, group: Any, marks: _Marks,
                compress: str = "none") -> DDP:
    """DDP with a plain averaging all-reduce hook that marks each bucket (what the trainer's weighted hook does,
    one Python hook per bucket, so the measured overhead is the trainer's).  With ``compress`` ("bf16", "fp16")
    the bucket goes over the wire as the weighted compressed hook sends it (runtime.compress): scaled in its own
    dtype, cast, SUM-all-reduced, copied back."""
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, process_group=group)
    world = dist.get_world_size(group)
    wire = WIRE_DTYPES.get(check_compress(compress))

    def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        marks.bucket()
        buf = bucket.buffer().div_(world)
        if wire is not None:
            return sum_on_wire(buf, buf, wire, group)
        work = dist.all_reduce(buf, group=group, async_op=True)
        assert work is not None
        return work.get_future().then(lambda fut: fut.value()[0])

    # DDP checks the hook's annotations as objects; this module's are strings (from __future__ import annotations).
    hook.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    ddp.register_comm_hook(None, hook)
    return ddp


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitRounds:
    """DDP steps at one split, the same on every rank after the exchange."""

    batch_sizes: tuple[int, ...]
    step_s: tuple[float, ...]
    """Slowest rank's mean step per round (every rank waits for it)."""
    compute_s: tuple[float, ...]
    """By rank: median over every timed step of step start to last gradient bucket."""
    compute_spread: float
    """Largest relative spread, over ranks, of the per-round median compute: the noise of compute_s."""


def measure_splits(make_runner: Callable[[], TimedSteps], splits: Sequence[Sequence[int]], *, group: Any = None,
                   warmup: int = 2, rounds: int = 3, repeats: int = 4, compress: str = "none") -> list[SplitRounds]:
    """Collective over `group`: `rounds` rounds of `repeats` DDP steps at each split (interleaved, so a drift
    in the machine hits every split alike); this rank runs batch ``split[rank]``."""
    runner = make_runner()
    device = runner.device
    me = dist.get_rank(group)
    marks = _Marks(device)
    per_split: list[tuple[list[float], list[list[float]]]] = [([], []) for _ in splits]
    try:
        ddp = _hooked_ddp(runner.model, device, group, marks, compress)
        batches = [runner.make_batch(int(s[me])) for s in splits]  # made once: no input work in a timed step
        for batch in batches:  # cuDNN picks algorithms per shape: every split warms up alike
            for _ in range(warmup):
                runner.train_step(batch, ddp)
        for _ in range(rounds):
            for k, batch in enumerate(batches):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dist.barrier(group=group)  # every round starts together, so no rank's wait is counted as work
                marks.steps = []
                t0 = time.perf_counter()
                for _ in range(repeats):
                    marks.start()
                    runner.train_step(batch, ddp)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                per_split[k][0].append((time.perf_counter() - t0) / repeats)
                per_split[k][1].append(marks.take_compute_s())
    finally:
        runner.close()
    return [_exchange(tuple(int(x) for x in s), steps, comp, device, group)
            for s, (steps, comp) in zip(splits, per_split, strict=True)]


def _exchange(split: tuple[int, ...], steps: list[float], compute: list[list[float]], device: torch.device,
              group: Any) -> SplitRounds:
    """Slowest rank's step per round, and every rank's compute median and its spread, on every rank."""
    # The backend's own device: NCCL reduces CUDA tensors, gloo CPU ones.
    red_dev = device if str(dist.get_backend(group)) == "nccl" else torch.device("cpu")
    worst = torch.tensor(steps, dtype=torch.float64, device=red_dev)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    flat = [x for r in compute for x in r]
    mine = statistics.median(flat) if flat else 0.0
    spread = relative_spread([statistics.median(r) for r in compute if r])
    world = dist.get_world_size(group)
    table = torch.zeros(world, 2, dtype=torch.float64, device=red_dev)
    table[dist.get_rank(group)] = torch.tensor([mine, spread], dtype=torch.float64)
    dist.all_reduce(table, group=group)  # each rank filled its own row: the sum is everyone's
    rows = table.cpu().tolist()
    return SplitRounds(batch_sizes=split, step_s=tuple(float(x) for x in worst.tolist()),
                       compute_s=tuple(float(r[0]) for r in rows), compute_spread=max(float(r[1]) for r in rows))


@dataclass(frozen=True, kw_only=True, slots=True)
class DDPCost:
    """What the profile records from the two splits (planner.comm_model)."""

    exposed_s: float
    """Median over rounds of the equal split's step minus max_i t_i(b) (>= 0): what DDP adds to a step (the
    all-reduce tail, its own per-step work)."""
    exposed_rounds_s: tuple[float, ...]
    """The same per round."""
    wait_factors: tuple[float, ...]
    """f_i by rank (1 within noise): evidence in the profile's meta, not in the plan's model (comm_cost)."""
    equal: SplitRounds
    balanced: SplitRounds
    predicted_balanced_s: float
    """max_i t_i(b_i) + exposed at the balanced split: the plan's model checked against balanced.step_s."""
    span_factors: tuple[float, ...] = ()
    """By rank (>= 1): the compute span under DDP at the balanced split over the standalone step less its optimizer
    step (planner.profile.CommProfile.span_factors): what the step timer reads, not snapped to a noise band."""
    span_tail_s: float | None = None
    """The balanced split's median step less max_i (span_i + o_i) (>= 0): what the step adds after the slowest
    rank's span under DDP and its optimizer step (planner.profile.CommProfile.span_tail_s).  The plan adds it to
    spans stretched by the factors above; ``exposed_s`` is taken against standalone steps and holds the stretch."""

    @property
    def some_rank_waits(self) -> bool:
        """A rank's factor stands above the least one's (snapped to it within noise): peers make it wait."""
        return max(self.wait_factors) > min(self.wait_factors)

    def cost_s(self, *, warmup: int, rounds: int, repeats: int) -> float:
        """Seconds the same two splits take again with these counts (the same on every rank: slowest steps)."""
        per_step = statistics.median(self.equal.step_s) + statistics.median(self.balanced.step_s)
        return per_step * (warmup + rounds * repeats)


def measure_ddp_cost(make_runner: Callable[[], TimedSteps], ranks: Sequence[RankProfile], *, group: Any = None,
                     min_batch: int = 1, warmup: int = 2, rounds: int = 3, repeats: int = 4,
                     compress: str = "none") -> DDPCost:
    """Collective over `group`: exposed communication and wait factors from DDP steps at the equal and the
    balanced split, gradients sent as ``compress`` says (``_hooked_ddp``); the same result on every rank."""
    b = ddp_equal_batch(ranks)
    equal = [b] * len(ranks)
    bal = balanced_batches(ranks, min_batch=min_batch)
    eq_r, bal_r = measure_splits(make_runner, [equal, bal], group=group, warmup=warmup, rounds=rounds,
                                 repeats=repeats, compress=compress)
    curves = [fit_envelope(r.compute) for r in ranks]
    # Alone, the marked part of a step is all of it but the optimizer step (it runs after the last bucket).
    alone = [max(1e-9, c(bi) - (r.optimizer_step_s or 0.0)) for c, bi, r in zip(curves, bal, ranks, strict=True)]
    factors = wait_factors(bal_r.compute_s, alone, noise=max(0.01, bal_r.compute_spread))
    spans = span_factors(bal_r.compute_s, alone)
    # What DDP adds to a step over the slowest rank alone.  The factors are evidence only (profiler.comm_cost
    # keeps them out of the plan's model), so the tail is taken against the unscaled curves.
    slowest = max(c(b) for c in curves)
    rounds_s = tuple(max(0.0, x - slowest) for x in eq_r.step_s)
    exposed = statistics.median(rounds_s)
    predicted = max(c(bi) for c, bi in zip(curves, bal, strict=True)) + exposed
    # Both terms of the plan's step under DDP, measured at one split: the slowest span plus optimizer, then the tail.
    tail = span_tail_s(bal_r.step_s, bal_r.compute_s, [r.optimizer_step_s or 0.0 for r in ranks])
    return DDPCost(exposed_s=exposed, exposed_rounds_s=rounds_s, wait_factors=factors, equal=eq_r, balanced=bal_r,
                   predicted_balanced_s=predicted, span_factors=spans, span_tail_s=tail)


def measure_exposed_rounds_s(make_runner: Callable[[], TimedSteps], ranks: Sequence[RankProfile], *,
                             group: Any = None, rounds: int = 3, repeats: int = 4) -> list[float]:
    """Collective over `group`: the synchronization cost of one DDP step (>= 0) in each of `rounds` rounds of
    `repeats` steps at the common batch, the same list on every rank."""
    b = common_batch(ranks)
    (eq,) = measure_splits(make_runner, [[b] * len(ranks)], group=group, rounds=rounds, repeats=repeats)
    alone = max(fit_envelope(r.compute)(b) for r in ranks)
    return [max(0.0, x - alone) for x in eq.step_s]
