"""EpochStream and StreamedEpochs: one DataLoader iterator across epoch boundaries yields, epoch by epoch, exactly
the batches a fresh pass per epoch would (shuffle, partial step, micro-batches, a resumed position, a cut epoch),
and a re-plan starts a new stream with the new sizes."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest
from torch.utils.data import DataLoader, Dataset

from planner.cli.steps import StreamedEpochs
from planner.errors import ValidationError
from runtime.sampler import EpochStream, HeteroBatchSampler


def per_epoch(sampler: HeteroBatchSampler, epochs: range, max_steps: int | None = None) -> list[list[list[int]]]:
    """What `for epoch: set_epoch(epoch); for batch in sampler` yields, each epoch cut like a loop that breaks."""
    out = []
    for e in epochs:
        sampler.set_epoch(e)
        batches = list(sampler)
        out.append(batches[:sampler.batches_in_pass(max_steps)])
    return out


@pytest.mark.parametrize("kw", [
    {},  # shuffled, with a partial last step (100 % 12 != 0)
    {"accumulation_steps": [3, 1]},  # micro-batches
    {"drop_last": True},
    {"shuffle": False},
    {"prefetch": True},  # the sampler's background shuffle of its first epoch is handed to the stream
])
def test_stream_is_the_epochs_back_to_back(kw: dict[str, Any]) -> None:
    for rank in (0, 1):
        s = HeteroBatchSampler(100, [9, 3], rank, seed=4, **kw)
        streamed = list(EpochStream(s, last_epoch=3))
        want = per_epoch(HeteroBatchSampler(100, [9, 3], rank, seed=4, **kw), range(3))
        assert streamed == [b for epoch in want for b in epoch]
        assert [len(e) for e in want] == [len(s)] * 3


def test_stream_starts_at_a_resumed_position_then_runs_whole_epochs() -> None:
    first = HeteroBatchSampler(100, [9, 3], 0, seed=1, accumulation_steps=[3, 1])
    first.set_epoch(1)
    state = first.state_dict(steps_done=4, micro_steps_done=2)
    resumed = HeteroBatchSampler(100, [9, 3], 0, seed=1, accumulation_steps=[3, 1])
    resumed.load_state_dict(state)
    resumed.set_epoch(1)
    streamed = list(EpochStream(resumed, last_epoch=3))
    # The stream copied the sampler: the sampler itself still starts its pass where it was resumed.
    resumed.begin_pass()
    assert (resumed.start_step, resumed.start_micro_step) == (4, 2)
    assert resumed.batches_in_pass() == len(resumed) - (4 * 3 + 2)
    fresh = HeteroBatchSampler(100, [9, 3], 0, seed=1, accumulation_steps=[3, 1])
    fresh.set_epoch(1)
    epoch1 = list(fresh)[4 * 3 + 2:]
    fresh.set_epoch(2)
    assert streamed == epoch1 + list(fresh)


def test_stream_cuts_every_epoch_at_max_steps() -> None:
    s = HeteroBatchSampler(100, [9, 3], 0, seed=2, accumulation_steps=[2, 1])
    streamed = list(EpochStream(s, last_epoch=2, max_steps=3))
    want = per_epoch(HeteroBatchSampler(100, [9, 3], 0, seed=2, accumulation_steps=[2, 1]), range(2), max_steps=3)
    assert [len(e) for e in want] == [6, 6]  # 3 steps x 2 micro-batches
    assert streamed == want[0] + want[1]


def test_stream_refuses_a_zero_cut() -> None:
    with pytest.raises(ValidationError, match="max_steps"):
        EpochStream(HeteroBatchSampler(10, [2, 2], 0), last_epoch=1, max_steps=0)


class Indices(Dataset[list[int]]):
    """dataset[index list] -> the list: what a batch sampler handed the worker."""

    def __len__(self) -> int:
        return 100

    def __getitem__(self, indices: list[int]) -> list[int]:  # type: ignore[override]
        return list(indices)


def replay_with_replan(streamed: StreamedEpochs, epochs: int, replan_at: int,
                       as_list: Callable[[Iterable[Any]], list[Any]] = list,
                       each: Callable[[HeteroBatchSampler, int], None] | None = None) -> list[bool]:
    """Run ``epochs`` epochs of ``streamed`` over a [9, 3] split, a re-plan to [6, 6] adopted before epoch
    ``replan_at``; every epoch's batches (``as_list`` of them) must be a reference sampler's.  ``each(sampler,
    epoch)`` checks more after each epoch.  Returns whether each epoch started on a new stream."""
    sampler = HeteroBatchSampler(100, [9, 3], 0, seed=3)
    reference = HeteroBatchSampler(100, [9, 3], 0, seed=3)
    fresh = []
    for epoch in range(epochs):
        if epoch == replan_at:
            sampler.set_batch_sizes([6, 6])
            reference.set_batch_sizes([6, 6])
            streamed.restart()
        sampler.set_epoch(epoch)
        batches, new = streamed.epoch(sampler)
        fresh.append(new)
        reference.set_epoch(epoch)
        assert as_list(batches) == list(reference), epoch
        if each is not None:
            each(sampler, epoch)
    return fresh


@pytest.mark.parametrize("workers", [0, 2])
def test_streamed_epochs_give_each_epoch_its_batches_and_restart_on_a_replan(workers: int) -> None:
    built: list[tuple[int, ...]] = []

    def build(stream: EpochStream) -> DataLoader[Any]:
        built.append(stream.batch_sizes)
        return DataLoader(Indices(), sampler=stream, batch_size=None, num_workers=workers,
                          persistent_workers=workers > 0, prefetch_factor=4 if workers else None)

    def pass_started(sampler: HeteroBatchSampler, epoch: int) -> None:
        assert sampler.start_step == 0 and sampler.generation == epoch + 1

    # a re-plan adopted after epoch 2
    fresh = replay_with_replan(StreamedEpochs(build, last_epoch=5), 5, replan_at=3, each=pass_started)
    assert fresh == [True, False, False, True, False]
    assert built == [(9, 3), (6, 6)]


def test_the_stream_takes_over_the_samplers_background_shuffle() -> None:
    s = HeteroBatchSampler(1000, [9, 3], 0, seed=5, prefetch=True)
    ready = s._prefetched
    assert ready is not None
    stream = EpochStream(s, last_epoch=1)
    assert s._prefetched is None and stream._prefetched is ready
    assert list(stream) == list(HeteroBatchSampler(1000, [9, 3], 0, seed=5, prefetch=False))
    assert stream._prefetched is None  # taken by the first pass


def test_streamed_epochs_pinned_ahead_give_the_same_batches_and_leave_no_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`planner train`'s CUDA path (planner.cli.steps.make_loader): the stream through TimedLoader with PinAhead.  Each
    epoch still gets exactly its batches, a re-plan's new stream stops the old pinning thread, and none is left once
    the run drops its loader.  A stand-in for the pin: a CPU-only torch cannot pin."""
    import gc

    import torch

    from runtime.loader_timing import TimedBatches, TimedLoader
    from tests.runtime.test_pinning import _threads, _wait

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self.clone())

    class Samples(Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return 100

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.tensor(i)

    def build(stream: EpochStream) -> TimedLoader:
        return TimedLoader(DataLoader(TimedBatches(Samples()), sampler=stream, batch_size=None, num_workers=2,
                                      persistent_workers=True, prefetch_factor=2), pin_device=torch.device("cpu"))

    before = _threads()

    def few_threads(_sampler: HeteroBatchSampler, _epoch: int) -> None:
        assert len(_threads() - before) <= 2  # the running stream's thread, and the replaced one on its way out

    streamed = StreamedEpochs(build, last_epoch=4)
    # a re-plan adopted after epoch 1
    replay_with_replan(streamed, 4, replan_at=2, as_list=lambda bs: [b.tolist() for b in bs], each=few_threads)
    del streamed
    gc.collect()
    assert _wait(lambda: _threads() <= before, timeout=10.0)
