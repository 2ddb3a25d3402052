"""Micro-batches under DDP with no_sync and per-rank k_i equal one process on each step's samples (float64, gloo).

Each case trains 3 optimizer steps -- the epoch's partial last step among them -- and compares the parameters
after every step with one process that takes one SGD step on the concatenation of all ranks' samples of that step
(wrap-around padding included). Rank i runs k_i micro-batches per step (fewer in the partial step), ``no_sync`` on
all but its last, so every rank all-reduces once per step whatever its k_i.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from runtime.accumulate import MicroStep, micro_steps
from runtime.sampler import HeteroBatchSampler
from runtime.weighting import register_weighted_hook
from tests._dist import run_distributed
from tests.runtime.test_weighting import make_data, make_model

LR = 0.1
SEED = 3


def samplers_for(n: int, sizes: list[int], steps: list[int]) -> list[HeteroBatchSampler]:
    return [HeteroBatchSampler(n, sizes, r, seed=SEED, accumulation_steps=steps) for r in range(len(sizes))]


def reference_params(kind: str, n: int, sizes: list[int], steps: list[int]) -> list[list[torch.Tensor]]:
    """Parameters after each optimizer step of one process on all ranks' samples of that step."""
    model = make_model(kind)
    x, y = make_data(kind, n)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    per_rank: list[list[list[list[int]]]] = []  # rank -> step -> micro-batches
    for s in samplers_for(n, sizes, steps):
        by_step: list[list[list[int]]] = [[] for _ in range(s.num_steps)]
        for batch, micro in micro_steps(s, s):
            by_step[micro.step].append(batch)
        per_rank.append(by_step)
    out = []
    for step in range(len(per_rank[0])):
        chunks = [b for rank in per_rank for b in rank[step]]
        total = sum(len(c) for c in chunks)
        if kind == "mlp":  # literally the concatenated samples, one mean loss
            idx = [i for c in chunks for i in c]
            loss = F.mse_loss(model(x[idx]), y[idx])
        else:  # BatchNorm statistics are per forward (micro-batch), as in DDP
            loss = sum(len(c) / total * F.mse_loss(model(x[c]), y[c]) for c in chunks)  # type: ignore[assignment]
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def worst_error(got: list[list[torch.Tensor]], ref: list[list[torch.Tensor]]) -> float:
    assert len(got) == len(ref)
    return max(((p - q).norm() / q.norm()).item() for a, b in zip(got, ref, strict=True)
               for p, q in zip(a, b, strict=True))


def loss_factor(mode: str) -> Callable[[MicroStep], float]:
    if mode == "hook":  # the hook applies n_i / n and SUM-all-reduces
        return lambda m: m.accumulation_weight
    if mode == "loss_scale":  # DDP's default mean all-reduce
        return lambda m: m.loss_scale
    return lambda m: 1.0 / m.count  # "plain": the usual mean of micro-batch means, then DDP's mean: wrong


def train_one(rank: int, kind: str, sizes: list[int], steps: list[int], mode: str, n: int) -> float:
    """One epoch through DDP; the worst relative parameter error vs the reference over its optimizer steps."""
    torch.manual_seed(123 + rank)  # nothing below may depend on it
    ddp = DDP(make_model(kind), bucket_cap_mb=1e-6)  # one bucket per parameter: several buckets per sync
    x, y = make_data(kind, n)
    sampler = HeteroBatchSampler(n, sizes, rank, seed=SEED, accumulation_steps=steps)
    loader = DataLoader(TensorDataset(x, y), batch_sampler=sampler)
    state = register_weighted_hook(ddp, sampler) if mode == "hook" else None
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    factor = loss_factor(mode)
    after: list[list[torch.Tensor]] = []
    micro_counts = []
    for (xb, yb), micro in micro_steps(loader, sampler):
        with contextlib.nullcontext() if micro.is_last else ddp.no_sync():
            (F.mse_loss(ddp(xb), yb) * factor(micro)).backward()
        if micro.is_last:
            opt.step()
            opt.zero_grad()
            after.append([p.detach().clone() for p in ddp.module.parameters()])
            micro_counts.append(micro.count)
    assert len(after) == sampler.num_steps == 3
    assert micro_counts == [len(sampler.micro_sizes_at(s)[rank]) for s in range(3)]
    if state is not None:
        assert state.num_syncs == 3  # one all-reduce per optimizer step, whatever this rank's k_i
    return worst_error(after, reference_params(kind, n, sizes, steps))


def ddp_worker(rank: int, world: int, cases: list[tuple[str, list[int], list[int], str, int]]) -> None:
    # all cases of one world size in one spawn: starting ranks costs seconds, training them milliseconds
    for kind, sizes, steps, mode, n in cases:
        err = train_one(rank, kind, sizes, steps, mode, n)
        label = f"rank {rank}: {kind} batches {sizes} micro-steps {steps} {mode} N={n}"
        if mode == "plain":
            assert err > 1e-3, f"{label}: averaging micro-batch means should be visibly wrong, error {err:.2e}"
        else:
            assert err <= 1e-9, f"{label}: parameters differ from the single-process reference by {err:.2e}"


# k = [1, 3]: B = 14, micro-batches [5] and [3, 3, 3]; N = 34 leaves R = 6 -> r = (3, 4), so rank 1 runs its
# partial step as 2 micro-batches [2, 2] (fewer than k).
TWO_RANKS = [
    ("mlp", [5, 9], [1, 3], "hook", 34),
    ("mlp", [5, 9], [1, 3], "loss_scale", 34),
    ("mlp", [5, 9], [1, 3], "plain", 34),
]
# k = [2, 1, 4]: B = 19, micro-batches [3, 3], [3], [3, 3, 2, 2]; N = 45 leaves R = 7 -> r = (3, 2, 4) with 2
# samples of wrap-around padding; rank 2 runs its partial step as [2, 2]. The BatchNorm case checks that
# DDP's buffer broadcast (first forward of each step) stays matched across ranks with different k_i.
THREE_RANKS = [
    ("mlp", [6, 3, 10], [2, 1, 4], "hook", 45),
    ("mlp", [6, 3, 10], [2, 1, 4], "loss_scale", 45),
    ("bn", [6, 3, 10], [2, 1, 4], "hook", 45),
    ("mlp", [6, 3, 10], [2, 1, 4], "plain", 45),
]


def test_cases_cover_a_partial_step_with_fewer_micro_batches() -> None:
    for cases in (TWO_RANKS, THREE_RANKS):
        _, sizes, steps, _, n = cases[0]
        s = samplers_for(n, sizes, steps)[0]
        last = s.micro_sizes_at(2)
        assert s.num_steps == 3 == s.num_full_steps + 1
        assert any(len(m) < k for m, k in zip(last, steps, strict=True))
    assert samplers_for(34, [5, 9], [1, 3])[0].micro_sizes_at(2) == ((3,), (2, 2))
    assert samplers_for(45, [6, 3, 10], [2, 1, 4])[0].micro_sizes_at(2) == ((3,), (2,), (2, 2))


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "cases"), [(2, TWO_RANKS), (3, THREE_RANKS)], ids=["k1-3", "k2-1-4"])
def test_ddp_micro_batches_equal_single_process(world: int,
                                                cases: list[tuple[str, list[int], list[int], str, int]]) -> None:
    run_distributed(ddp_worker, world, cases, timeout_s=150)
