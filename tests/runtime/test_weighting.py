"""Exact gradient weighting: DDP over uneven batches equals one process on the concatenated batches (float64).

Real SyncBatchNorm refuses CPU tensors in torch ("SyncBatchNorm expected input tensor to be on GPU"), so on
gloo we check BatchNorm two other ways: (a) plain BatchNorm through DDP against its exact single-process
objective (per-rank statistics, sample-weighted losses), and (b) SyncBatchNorm's math emulated in one process
(joint statistics, per-rank parameter copies) showing loss_scale is exact and the hook is not.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from runtime.sampler import HeteroBatchSampler
from runtime.weighting import accumulation_weight, loss_scale, register_weighted_hook
from tests._dist import run_distributed

LR = 0.1
EPOCHS = 2


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    # (n, 2, 3) input: BatchNorm1d over n*3 values per channel, so a batch of one sample still trains
    return nn.Sequential(nn.Conv1d(2, 4, 1), nn.BatchNorm1d(4), nn.Tanh(), nn.Flatten(), nn.Linear(12, 2)).double()


def make_data(kind: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    shape = (n, 4) if kind == "mlp" else (n, 2, 3)
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(n, 2, generator=g, dtype=torch.float64)


def windows(num_steps: int, accum: int) -> list[range]:
    return [range(s, min(s + accum, num_steps)) for s in range(0, num_steps, accum)]


def reference(kind: str, n: int, plans: list[list[int]], accum: int) -> nn.Module:
    """One process, one optimizer step per window on all ranks' samples of that window (padding included)."""
    model = make_model(kind)
    x, y = make_data(kind, n)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for epoch, sizes in enumerate(plans):
        per_rank = []
        for r in range(len(sizes)):
            s = HeteroBatchSampler(n, sizes, r, seed=3)
            s.set_epoch(epoch)
            per_rank.append(list(s))
        for win in windows(len(per_rank[0]), accum):
            chunks = [per_rank[r][s] for s in win for r in range(len(sizes))]
            total = sum(len(c) for c in chunks)
            if kind == "mlp":  # literally the concatenated batch, one mean loss
                idx = [i for c in chunks for i in c]
                loss = F.mse_loss(model(x[idx]), y[idx])
            else:  # BatchNorm statistics are per rank and per step, as in DDP
                loss = sum(len(c) / total * F.mse_loss(model(x[c]), y[c]) for c in chunks)
            opt.zero_grad()
            loss.backward()  # type: ignore[union-attr]
            opt.step()
    return model


def train_one(rank: int, kind: str, plans: list[list[int]], mode: str, accum: int, n: int) -> float:
    """Train EPOCHS epochs through DDP; return the worst relative parameter error vs the reference."""
    torch.manual_seed(123 + rank)  # nothing below may depend on it
    model = make_model(kind)
    # tiny buckets: one per parameter, so the hook's step counting sees several buckets per backward
    ddp = DDP(model, bucket_cap_mb=1e-6)
    x, y = make_data(kind, n)
    sampler = HeteroBatchSampler(n, plans[0], rank, seed=3)
    loader = DataLoader(TensorDataset(x, y), batch_sampler=sampler)
    calls: list[int] = []
    state = None
    if mode == "hook":
        state = register_weighted_hook(ddp, sampler, accumulation_steps=accum,
                                       on_last_bucket=lambda: calls.append(state.num_syncs))  # type: ignore[union-attr]
    if mode == "plain":  # stock DDP averaging on purpose: without this the first backward refuses to run unweighted
        sampler.declare_weighting("none: the negative control")
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    syncs = 0
    for epoch, sizes in enumerate(plans):
        sampler.set_batch_sizes(sizes)  # a re-plan: takes effect at this epoch's start
        sampler.set_epoch(epoch)
        num_steps = len(loader)
        for step, (xb, yb) in enumerate(loader):
            assert len(xb) == sampler.counts_at(step)[rank]
            sync = (step + 1) % accum == 0 or step == num_steps - 1
            with contextlib.nullcontext() if sync else ddp.no_sync():
                loss = F.mse_loss(ddp(xb), yb)
                if mode == "hook":
                    loss = loss * accumulation_weight(sampler, step, accum)
                elif mode == "loss_scale":  # DDP's default mean all-reduce, loss scaled by n_i * W / n
                    loss = loss * loss_scale(sampler, step, accumulation_steps=accum)
                else:  # "plain": stock DDP averaging, the negative control
                    loss = loss / accum
                loss.backward()
            if sync:
                opt.step()
                opt.zero_grad()
                syncs += 1
    if state is not None:
        assert calls == list(range(syncs))  # once per synchronizing backward, before the step count advanced
    ref = reference(kind, n, plans, accum)
    return max(((p - q).norm() / q.norm()).item() for p, q in zip(model.parameters(), ref.parameters(), strict=True))


def train_worker(rank: int, world: int, cases: list[tuple[str, list[list[int]], str, int, int]]) -> None:
    # all cases of one world size in one spawn: starting ranks costs seconds, training them milliseconds
    for kind, plans, mode, accum, n in cases:
        err = train_one(rank, kind, plans, mode, accum, n)
        label = f"rank {rank}: {kind} {plans} {mode} accumulation={accum} N={n}"
        if mode == "plain":
            assert err > 1e-3, f"{label}: stock DDP averaging should be visibly wrong, error {err:.2e}"
        else:
            assert err <= 1e-9, f"{label}: parameters differ from the single-process reference by {err:.2e}"


# N chosen so each epoch ends in a partial step (padding and the proportional split both exercised); the second
# plan is a re-plan adopted at the epoch boundary.
TWO_RANKS = [
    ("mlp", [[7, 3], [4, 6]], "hook", 1, 34),
    ("bn", [[7, 3], [4, 6]], "hook", 1, 34),
    ("mlp", [[7, 3], [4, 6]], "loss_scale", 1, 34),
    # 34 samples, B = 10: steps (7,3) (7,3) (7,3) (3,2); windows of 2 with unequal micro-batches in the last
    ("mlp", [[7, 3], [7, 3]], "hook", 2, 34),
    ("mlp", [[7, 3], [7, 3]], "loss_scale", 2, 34),
    ("mlp", [[7, 3], [4, 6]], "plain", 1, 34),
]
THREE_RANKS = [
    ("mlp", [[5, 1, 2], [2, 3, 3]], "hook", 1, 28),
    ("bn", [[5, 1, 2], [2, 3, 3]], "hook", 1, 28),
    ("mlp", [[5, 1, 2], [2, 3, 3]], "loss_scale", 1, 28),
    ("mlp", [[5, 1, 2], [2, 3, 3]], "hook", 3, 28),
]


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "cases"), [(2, TWO_RANKS), (3, THREE_RANKS)], ids=["7-3", "5-1-2"])
def test_ddp_equals_single_process(world: int, cases: list[tuple[str, list[list[int]], str, int, int]]) -> None:
    run_distributed(train_worker, world, cases, timeout_s=150)


def test_hook_would_be_wrong_with_syncbatchnorm_loss_scale_is_exact() -> None:
    """SyncBatchNorm semantics emulated in one process: 2 ranks, per-rank parameter copies, joint BN statistics."""
    torch.manual_seed(0)
    sizes = [7, 3]
    n, world = sum(sizes), len(sizes)
    lin = nn.Linear(4, 3).double()
    head = nn.Linear(3, 1).double()
    x = torch.randn(n, 4, dtype=torch.float64)
    y = torch.randn(n, 1, dtype=torch.float64)
    chunks = torch.split(torch.arange(n), sizes)

    def per_rank_grads(weights: list[float]) -> list[torch.Tensor]:
        # copies[i] = rank i's replica; grads of sum_k weights[k] * L_k w.r.t. each copy, as SyncBN's backward does
        copies = [[p.detach().clone().requires_grad_() for p in (*lin.parameters(), *head.parameters())]
                  for _ in range(world)]
        h = torch.cat([F.linear(x[c], cp[0], cp[1]) for c, cp in zip(chunks, copies, strict=True)])
        z = (h - h.mean(0)) / torch.sqrt(h.var(0, unbiased=False) + 1e-5)  # joint statistics over all ranks
        total = sum(w * F.mse_loss(F.linear(z[c], cp[2], cp[3]), y[c])
                    for w, c, cp in zip(weights, chunks, copies, strict=True))
        total.backward()  # type: ignore[union-attr]
        return [torch.cat([p.grad.flatten() for p in cp]) for cp in copies]  # type: ignore[union-attr]

    true = sum(per_rank_grads([b / n for b in sizes]))  # gradient of the global mean loss, shared parameters
    scales = [b * world / n for b in sizes]  # loss_scale for a full step
    via_loss_scale = sum(per_rank_grads(scales)) / world  # DDP default: mean of replicas
    g = per_rank_grads([1.0, 1.0])
    via_hook = sum(b / n * gi for b, gi in zip(sizes, g, strict=True))
    assert torch.allclose(via_loss_scale, true, rtol=1e-12, atol=1e-14)  # type: ignore[arg-type]
    assert (via_hook - true).norm() > 1e-3 * true.norm()  # type: ignore[union-attr]


def test_loss_scale_values() -> None:
    s = HeteroBatchSampler(34, [7, 3], 1)
    assert [s.counts_at(i) for i in range(4)] == [(7, 3)] * 3 + [(3, 2)]
    assert loss_scale(s, 0) == pytest.approx(3 * 2 / 10)
    assert loss_scale(s, 3) == pytest.approx(2 * 2 / 5)
    # windows of 2: [0, 1] has 20 samples, [2, 3] has 15
    assert loss_scale(s, 1, accumulation_steps=2) == pytest.approx(3 * 2 / 20)
    assert loss_scale(s, 3, accumulation_steps=2) == pytest.approx(2 * 2 / 15)
    assert accumulation_weight(s, 2, 2) == pytest.approx(3 / 5)
    assert accumulation_weight(s, 0, 2) == pytest.approx(1 / 2)
