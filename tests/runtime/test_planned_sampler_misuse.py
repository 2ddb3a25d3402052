"""Two ways of placing a planned sampler that train silently wrong are refused before the batch they would spoil.

* ``DataLoader(dataset, sampler=run.sampler_for(...), batch_size=5)``: the planned sampler yields whole batches, so
  the loader's BatchSampler would group 5 of them into one (x of shape (5, 7, 8) for a plan of 7 samples a step; a
  CNN then fails inside conv2d).  Refused at the first batch with the line naming ``batch_sampler=``.
* a loop that never advances the epoch (no ``run.epoch``, no ``set_epoch``): every epoch would repeat epoch 0's
  order and batch sizes, and a re-plan would never apply.  The second whole pass of the same epoch is refused with
  the line naming both fixes; with ``set_epoch`` (or a pass only begun, as a first batch looked at) nothing is.

In-process, without a process group: both checks are local, so each rank of a launch raises the same line.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from planner.errors import ValidationError
from runtime import PlannedRun
from runtime.sampler import epoch_permutation
from tests.runtime._plans import linear_cpu_profile

N = 40


def _run(shuffle: bool = True) -> PlannedRun:
    import planner

    plan = planner.evaluate(linear_cpu_profile([1e-3]), [7], num_workers=[0])
    return PlannedRun(plan, shuffle=shuffle, quiet=True)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.arange(N), torch.randn(N, 8, generator=g))


def _loader(workers: int = 0, **kw: object) -> DataLoader:  # type: ignore[type-arg]
    """A DataLoader over the test data; with workers, forked once (persistent: every epoch reuses them) and bounded
    (a stuck worker raises after 60 s)."""
    bounded = {"multiprocessing_context": "fork", "timeout": 60, "persistent_workers": True} if workers else {}
    return DataLoader(_data(), num_workers=workers, **bounded, **kw)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _workers_gone() -> Iterator[None]:
    """After each test, its DataLoaders' workers shut down and their queues' feeder threads end (they close their
    pipes a moment after the shutdown; a worker forked meanwhile could have a descriptor closed under it)."""
    yield
    gc.collect()
    for t in threading.enumerate():
        if t.name == "QueueFeederThread":
            t.join(timeout=30)


def test_the_planned_sampler_given_as_sampler_with_a_batch_size_is_refused_at_the_first_batch() -> None:
    run = _run()
    loader = _loader(sampler=run.sampler_for(N, "cpu"), batch_size=5)
    with pytest.raises(ValidationError) as info:
        next(iter(loader))
    assert str(info.value) == (
        "the planned sampler yields whole batches (rank 0: 7 samples a step) but the DataLoader got it as sampler= "
        "with batch_size=5, which groups 5 of them into one; pass it as DataLoader(dataset, batch_sampler=sampler) "
        "without batch_size")
    conv = torch.nn.Conv2d(1, 2, 3)  # the CNN user's loop: the tool's line comes before any forward
    with pytest.raises(ValidationError, match="pass it as DataLoader"):
        for _, x in _loader(1, sampler=run.sampler, batch_size=5):
            conv(x)
    batches = [i.tolist() for i, _ in _loader(batch_sampler=run.sampler)]
    assert [len(b) for b in batches] == [7] * 5 + [5]  # as a batch sampler: the plan's batches


@pytest.mark.parametrize("workers", [0, 1])
def test_a_second_whole_pass_of_the_same_epoch_is_refused(workers: int) -> None:
    run = _run()
    loader = _loader(workers, batch_sampler=run.sampler_for(N, "cpu"))
    seen = []
    with pytest.raises(ValidationError) as info:
        for _epoch in range(3):  # the mistake: no run.epoch(epoch, loader), no set_epoch(epoch)
            seen.append([int(i) for batch, _ in loader for i in batch])
    assert str(info.value) == (
        "the planned sampler is drawn again in epoch 0 without set_epoch: every epoch would repeat epoch 0's "
        "order, and a re-plan would never apply; iterate `for batch in run.epoch(epoch, loader)`, or call "
        "sampler.set_epoch(epoch) before each epoch's `for batch in loader`")
    assert seen == [epoch_permutation(N, 0).tolist()]  # epoch 0 trained, its repeat did not start


def test_epochs_that_advance_and_a_first_batch_looked_at_are_not_refused() -> None:
    run = _run()
    loader = _loader(1, batch_sampler=run.sampler_for(N, "cpu"))
    next(iter(loader))  # a look at the first batch: a pass begun, not a whole one
    orders = []
    for epoch in range(2):
        run.sampler.set_epoch(epoch)  # type: ignore[union-attr]
        orders.append([int(i) for batch, _ in loader for i in batch])
    orders.append([int(i) for batch, _ in run.epoch(2, loader) for i in batch])
    assert orders == [epoch_permutation(N, e).tolist() for e in range(3)]
