"""Adoption mistakes in a hand-written DDP script are one line at the first step, on every rank.

A script moved onto a plan by hand (docs/ADOPTING.md, forms A/B) can go silently wrong in three easy ways: no
weighting of the uneven batches (a wrong gradient, no word), the DataLoader's old ``batch_size=32`` kept (the ranks'
step counts drift apart and gloo dies mid-epoch), ranks launched with different plans (a whole epoch, then an
abort).  Each must raise the same one-line ``ValidationError`` on both ranks before any optimizer step, and no rank
may proceed or hang (gloo timeout 15 s, harness deadline 60 s).  The exactness of the correct forms is covered by
test_weighting.py, test_accumulation_ddp.py and test_adopting.py; here only that the checks do not fire on them
(loss scale fed by prefetching DataLoader workers, an evaluation forward first, an equal plan without weighting).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from planner.errors import ValidationError
from runtime import HeteroBatchSampler, HeteroDistributedSampler, loss_scale, register_weighted_hook
from tests._dist import run_distributed

N = 80
SPLIT = [32, 8]  # rank 0's planned batch is the 32 a stock script used: only rank 1's loader cuts wrongly


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 4, generator=g, dtype=torch.float64),
                         torch.randn(N, 1, generator=g, dtype=torch.float64))


def _model() -> DDP:
    torch.manual_seed(0)
    return DDP(nn.Linear(4, 1).double())


def _train(model: DDP, loader: DataLoader, sampler: object | None = None, steps: int = 3,
           prelude: bool = False) -> int:
    """A stock training loop; returns the optimizer steps it finished. ``sampler``: scale the loss by it.
    ``prelude``: each step first runs a module without parameters (a GPU transform) and an evaluation forward."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    done = 0
    for step, (x, y) in enumerate(loader):
        if prelude:
            x = nn.Identity()(x)
            with torch.no_grad():
                model(x)
        loss = F.mse_loss(model(x), y)
        if sampler is not None:
            loss = loss * loss_scale(sampler, step)  # type: ignore[arg-type]
        loss.backward()
        opt.step()
        opt.zero_grad()
        done += 1
        if done == steps:
            break
    return done


def _first_step_raises(model: DDP, loader: DataLoader, expected: str, prelude: bool = False) -> None:
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValidationError) as info:
        _train(model, loader, prelude=prelude)
    message = str(info.value)
    assert message == expected and "\n" not in message, message
    # nothing trained: no optimizer step, and no gradient reached the parameters (none was all-reduced)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())


def no_weighting_worker(rank: int, world: int) -> None:
    data = _data()
    # The mistake: form A without register_weighted_hook (an uneven plan trained with DDP's plain average); a GPU
    # transform and an evaluation forward come first in each step, and the check still waits for the training one.
    model = _model()
    sampler = HeteroDistributedSampler(N, SPLIT, rank, seed=1)
    loader = DataLoader(data, batch_size=sampler.batch_size, sampler=sampler)
    _first_step_raises(model, loader, (
        "the plan gives the ranks [32, 8] samples a step, but nothing weights the gradient by them (DDP averages the "
        "ranks' gradients as if their batches were equal); call register_weighted_hook(model, sampler) after "
        "model = DDP(...), or multiply the loss by runtime.loss_scale(sampler, step) (sampler.declare_weighting() "
        "if you weight it yourself)"), prelude=True)
    # An equal plan needs no weighting (DDP's average is then exact): no check fires.
    equal = HeteroDistributedSampler(N, [20, 20], rank, seed=1)
    assert _train(_model(), DataLoader(data, batch_size=equal.batch_size, sampler=equal)) == 2
    # The loss-scale form, batches from 2 prefetching workers, the same prelude: no check fires (the scale is
    # called in training order, after the first training forward and before the first backward).
    batches = HeteroBatchSampler(N, SPLIT, rank, seed=1)
    loader = DataLoader(data, batch_sampler=batches, num_workers=2)
    assert _train(_model(), loader, batches, steps=2, prelude=True) == 2


def wrong_batch_size_worker(rank: int, world: int) -> None:
    data = _data()
    # The mistake: form A with the stock script's DataLoader(batch_size=32) kept.
    model = _model()
    sampler = HeteroDistributedSampler(N, SPLIT, rank, seed=1)
    register_weighted_hook(model, sampler)
    _first_step_raises(model, DataLoader(data, batch_size=32, sampler=sampler), (
        "rank 1's DataLoader cuts batches of 32 but the plan gives rank 1 8 samples a step; build it as "
        "DataLoader(dataset, batch_size=sampler.batch_size, sampler=sampler) with drop_last=False (the default)"))
    # The planned batch size with drop_last=True drops the partial last step on some ranks only: refused too.
    sampler = HeteroDistributedSampler(N - 3, SPLIT, rank, seed=1)
    loader = DataLoader(data, batch_size=sampler.batch_size, sampler=sampler, drop_last=True)
    _first_step_raises(model, loader, (
        "rank 0's DataLoader cuts batches of 32 with drop_last=True but the plan gives rank 0 32 samples a step; "
        "build it as DataLoader(dataset, batch_size=sampler.batch_size, sampler=sampler) with drop_last=False "
        "(the default)"))


def different_plans_worker(rank: int, world: int) -> None:
    data = _data()
    # Only rank 0 weights its gradient before the first batch (a hook registered under `if rank == 0:`).
    model = _model()
    sampler = HeteroBatchSampler(N, SPLIT, rank, seed=1)
    if rank == 0:
        register_weighted_hook(model, sampler)
    _first_step_raises(model, DataLoader(data, batch_sampler=sampler), (
        "rank 0 weights its gradient for the uneven plan [32, 8] (weighted hook, micro_steps or a loss scale) "
        "before its first batch but rank 1 does not; call register_weighted_hook(model, sampler) on every rank"))
    # The mistake: the ranks launched with different plans (form B, the weighted hook registered).
    model = _model()
    sampler = HeteroBatchSampler(N, SPLIT if rank == 0 else [20, 20], rank, seed=1)
    register_weighted_hook(model, sampler)
    _first_step_raises(model, DataLoader(data, batch_sampler=sampler), (
        "ranks disagree on batch sizes: rank 0 has [32, 8], rank 1 has [20, 20]; launch every rank with the same "
        "plan file"))
    # Every rank built its sampler for plan rank 0 (rank= left at a constant): both train rank 0's batches.
    sampler = HeteroBatchSampler(N, SPLIT, 0, seed=1)
    _first_step_raises(model, DataLoader(data, batch_sampler=sampler), (
        "ranks 0, 1 all built their sampler for plan rank 0 (of 2); pass rank=torch.distributed.get_rank() to the "
        "sampler"))


@pytest.mark.distributed
@pytest.mark.parametrize("worker", [no_weighting_worker, wrong_batch_size_worker, different_plans_worker],
                         ids=["no-weighting", "wrong-batch-size", "different-plans"])
def test_mistake_is_one_line_at_the_first_step_on_every_rank(worker: object) -> None:
    run_distributed(worker, 2, timeout_s=60, pg_timeout_s=15)  # type: ignore[arg-type]


def test_wrong_batch_size_without_a_process_group() -> None:
    sampler = HeteroDistributedSampler(N, SPLIT, 1, seed=1)
    with pytest.raises(ValidationError, match="rank 1's DataLoader cuts batches of 32 but the plan gives rank 1 8"):
        next(iter(DataLoader(_data(), batch_size=32, sampler=sampler)))
    batches = list(DataLoader(_data(), batch_size=sampler.batch_size, sampler=sampler))
    assert [len(x) for x, _ in batches] == [8, 8]
