"""What the solver knows about each rank: its curve, caps, loader and micro-step costs (the loader's cost under
host contention and the worker budgets come from planner.loader).  Used by planner.solve
(which re-exports these names) and planner._search; the model's formulas are in planner._accumulation and
planner._program."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.comm_model import applied_span_factors, rank_factors
from planner.curves import Envelope, fit_envelope, memory_cap
from planner.loader import handover_costs_s, loader_costs_s, worker_budgets
from planner.options import SolveOptions
from planner.profile import Profile

DDP_BUCKET_BYTES = 25 * 1024 * 1024
"""DDP's default bucket_cap_mb: the last bucket's all-reduce runs after backward and is exposed."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankModel:
    """What the solver knows about one rank."""

    rank: int
    host: str
    device: str
    compute: Envelope
    sec_per_sample: float
    """Loader seconds per sample per worker at the host's training load (planner.loader: the measured scaling
    curve under contention; the profile's sec_per_sample without a scaling run; 0 without loader data)."""
    cap: int | None
    """Most samples in one optimizer step without accumulation: the memory cap and --max-batch-per-rank."""
    cap_reason: str
    serial_loader: bool
    """True when the host has too few cores for one worker per rank: data is loaded in the training process."""
    max_workers: int = 8
    """Most loader workers this rank may get (``SolveOptions.worker_cap``: --max-workers-per-rank, the profile's
    loader.max_workers and the host's worker budget)."""
    micro_cap: int | None = None
    """Memory cap on one micro-batch (forward+backward); None = no memory cap."""
    batch_cap: int | None = None
    """--max-batch-per-rank: a cap on the rank's whole batch per optimizer step, micro-steps or not."""
    handover_s: float = 0.0
    """Seconds per sample the training process spends taking batches over from its workers (pinning them): a
    floor under the step, whatever the workers (planner.loader.handover_costs_s); 0 when not measured."""
    optimizer_s: float = 0.0
    """o_i: the optimizer step's time inside every measured step, charged once per optimizer step."""
    max_steps: int = 1
    """Most micro-steps per optimizer step (1 under ddp for a rank without a memory cap: it never needs more)."""

    def compute_time(self, b: float, steps: int = 1) -> float:
        """tau(b, k): compute time of an optimizer step of b samples in k micro-steps (planner._accumulation)."""
        t = self.compute(b)
        if steps == 1:
            return t
        o = self.optimizer_s
        micro = [s * b + (c - o) * steps + o for s, c in zip(self.compute.slopes, self.compute.intercepts,
                                                               strict=True) if c > o]
        return max([t, *micro])

    def busy_time(self, b: float, workers: int, steps: int = 1) -> tuple[float, float, float]:
        """(step time, compute part, loader part) of this rank alone at batch b with `workers` workers."""
        tc = self.compute_time(b, steps)
        if self.serial_loader or workers == 0:
            tl = (self.sec_per_sample + self.handover_s) * b
            return tc + tl, tc, tl
        tl = max(self.sec_per_sample * b / workers, self.handover_s * b)  # the workers, or the hand-over
        return max(tc, tl), tc, tl


def build_models(profile: Profile, opts: SolveOptions, workers: Sequence[int] | None = None) -> list[RankModel]:
    """Each rank's model; its loader cost at the host's load with ``workers`` (by rank; default: the budget split
    equally -- planner.loader.loader_costs_s)."""
    budgets = worker_budgets(profile, opts)
    per_host = Counter(r.host for r in profile.ranks)
    per_gpu = Counter((r.host, r.device) for r in profile.ranks)  # >1: ranks sharing one GPU share its memory
    # f_i: rank i's curve under DDP, slowed by all-reduce kernels waiting for later peers (planner.comm_model);
    # 1 for every rank unless the profile carries factors (profiler.comm_cost keeps its own in the meta).
    wait = rank_factors(profile.comm.wait_factors if profile.comm else None, len(profile.ranks))
    envelopes = [fit_envelope(r.compute).scaled(wait[r.rank]) for r in profile.by_rank]
    loader_costs = loader_costs_s(profile, opts, envelopes, workers)
    models = []
    for r, env, p_eff, q in zip(profile.by_rank, envelopes, loader_costs, handover_costs_s(profile), strict=True):
        mem = memory_cap(r.memory, headroom=opts.memory_headroom, sharing=per_gpu[(r.host, r.device)])
        reason = "memory"
        if opts.max_micro_batch is not None and (mem is None or opts.max_micro_batch < mem):
            mem, reason = opts.max_micro_batch, "max-micro-batch"  # a stated memory cap: one micro-batch
        cap = mem
        if opts.max_batch_per_rank is not None and (cap is None or opts.max_batch_per_rank < cap):
            cap, reason = opts.max_batch_per_rank, "max-batch-per-rank"
        # Under fsdp every rank runs the shared K, capped or not; under ddp only a memory cap calls for steps.
        steps = opts.max_accumulation_steps if (opts.mode == "fsdp" or mem is not None) else 1
        models.append(
            RankModel(
                rank=r.rank,
                host=r.host,
                device=r.device,
                compute=env,
                sec_per_sample=p_eff,
                cap=cap,
                cap_reason=reason,
                serial_loader=budgets[r.host] < per_host[r.host],
                max_workers=opts.worker_cap(budgets[r.host], r.loader.max_workers if r.loader else None),
                micro_cap=mem,
                batch_cap=opts.max_batch_per_rank,
                handover_s=q,
                optimizer_s=r.optimizer_step_s or 0.0,
                max_steps=steps,
            )
        )
    return models


def fewest_steps(models: Sequence[RankModel], batch_sizes: Sequence[int], opts: SolveOptions) -> tuple[list[int], bool]:
    """(k, fits): the fewest micro-steps that fit each rank's batch in its memory cap (the largest of them on
    every rank under fsdp), and whether the split fits every cap -- memory per micro-batch within
    max_accumulation_steps, --max-batch-per-rank, min_batch per micro-batch.  Where nothing fits a rank, k is 1."""
    steps, fits = [], True
    for m, b in zip(models, batch_sizes, strict=True):
        k = 1
        if m.micro_cap is not None and b > m.micro_cap:
            need = math.ceil(b / m.micro_cap) if m.micro_cap >= 1 else opts.max_accumulation_steps + 1
            k = need if need <= min(opts.max_accumulation_steps, b) else 1
            fits = fits and k > 1
        fits = fits and (m.batch_cap is None or b <= m.batch_cap)
        steps.append(k)
    if opts.mode == "fsdp":
        steps = [max(steps)] * len(steps)
    fits = fits and all(k == 1 or b // k >= opts.min_batch for b, k in zip(batch_sizes, steps, strict=True))
    return steps, fits


def equal_split_workers(profile: Profile, models: list[RankModel], opts: SolveOptions) -> np.ndarray:
    """What a DataLoader user sets without a planner: the host's worker budget split equally."""
    budgets = worker_budgets(profile, opts)
    per_host = Counter(m.host for m in models)
    w = np.zeros(len(models), dtype=np.int64)
    for i, m in enumerate(models):
        if not m.serial_loader:
            w[i] = min(m.max_workers, max(1, budgets[m.host] // per_host[m.host]))
    return w


def exposed_comm_s(profile: Profile, mode: str = "ddp") -> float:
    """Communication left exposed after the slowest rank's backward ends (0 on one rank), the term a plan adds to
    its slowest rank's predicted step (``planner.plan.synchronous_step_s``).

    Under DDP with span factors the ranks' predictions are their spans under DDP (``planner.solve.rank_step_s``),
    so the term is the tail measured after those spans, ``comm.span_tail_s``; ``comm.exposed_s`` was taken
    against the standalone steps and already holds the slowest rank's stretch.  Otherwise ``exposed_s``; with
    neither, the last bucket's share of one all-reduce."""
    comm = profile.comm
    if profile.world_size == 1 or comm is None:
        return 0.0
    if comm.span_tail_s is not None and applied_span_factors(profile, mode) is not None:
        return comm.span_tail_s
    if comm.exposed_s is not None:
        return comm.exposed_s
    if comm.allreduce_s is None:
        return 0.0
    grad = profile.model.grad_bytes if profile.model and profile.model.grad_bytes else None
    # Buckets fill in reverse layer order; all but the last overlap backward, the last one is pure tail.
    frac = 1.0 if not grad else min(1.0, DDP_BUCKET_BYTES / grad)
    return comm.allreduce_s * frac
