"""What a rank's DataLoader really costs, timed inside its workers.

The step timer sees only the training loop's side of the loader: how long ``next()`` waited.  A loader that keeps
up shows no wait at all, however close it runs to its limit, and a rank paced by a late peer looks "fast" -- so the
re-planner could only ever *raise* a loader cost (runtime/replan/model.py) and the run log called a loader-bound
rank that its peers paced 84% faster than predicted (2x H200, `--emulate-loader 1=2`: compute 31 ms of a 192 ms
step, while its two workers needed ~190 ms per step between them, by the host's measured per-worker rate).

``TimedBatches`` makes every batch carry the seconds the worker spent producing it (the samples' ``__getitem__``
-- decode, transforms -- and the collate), measured in the worker process with its wall clock, so host contention
between the ranks' workers is in it.  ``TimedLoader`` iterates such a DataLoader, hands each batch's seconds to a
callback (the step timer's ``loader_batch``: the batch is consumed inside ``next()``, so they land on the step that
uses it) and yields the batch alone, so the training loop does not change.  With ``W`` workers producing in
parallel, one rank's loader delivers a step every ``loader_s / W`` seconds (``W = 0``: the loop itself loads, and
the time is its data wait).  Not in it: the main process's side (unpickling from shared memory, pinning), which the
data wait still shows when it paces the rank.

    loader = TimedLoader(DataLoader(TimedBatches(dataset), sampler=batch_sampler, batch_size=None, ...),
                         on_batch=timer.loader_batch)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate

from runtime.pinning import PinAhead


class TimedBatches(Dataset[tuple[Any, float]]):
    """``dataset[indices] -> (collated batch, seconds spent producing it)``: one whole batch per index list, for a
    DataLoader with ``sampler=<a batch sampler>, batch_size=None`` (so the batch is built in the worker)."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any] = default_collate,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.dataset, self.collate_fn, self.clock = dataset, collate_fn, clock

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: Sequence[int]) -> tuple[Any, float]:  # type: ignore[override]
        t0 = self.clock()
        many = getattr(self.dataset, "__getitems__", None)  # torch's batched fetch, where a dataset has one
        samples = many(list(indices)) if many is not None else [self.dataset[i] for i in indices]
        batch = self.collate_fn(samples)
        return batch, self.clock() - t0


class TimedLoader:
    """Iterate a DataLoader over ``TimedBatches``: report each batch's seconds to ``on_batch`` and yield the batch;
    ``len()`` is the DataLoader's.  ``pin_device``: pin the batches for that CUDA device a few steps ahead of the
    loop (runtime.pinning.PinAhead; build the DataLoader with ``pin_memory=False``)."""

    def __init__(self, loader: Any, on_batch: Callable[[float], None] | None = None,
                 pin_device: torch.device | None = None) -> None:
        self.loader = loader
        self.on_batch = on_batch
        self.pin_device = pin_device

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        # iter() of the DataLoader now, not at the first next(): it starts the sampler's pass, whose start position
        # runtime.accumulate.micro_steps reads right after iter(loader) (a resumed epoch starts mid-pass).
        it = iter(self.loader)
        return self._timed(it if self.pin_device is None else PinAhead(it, self.pin_device))

    def _timed(self, it: Iterator[tuple[Any, float]]) -> Iterator[Any]:
        try:
            for batch, seconds in it:
                if self.on_batch is not None:
                    self.on_batch(float(seconds))
                yield batch
        finally:
            if isinstance(it, PinAhead):
                it.close()
