"""An epoch's shuffle: DistributedSampler's permutation as int32, optionally built ahead on a background thread.

HeteroBatchSampler (runtime/sampler.py) takes epoch e's permutation from ``epoch_permutation(N, seed + e)``; with
``prefetch`` it starts the next epoch's on a :class:`PermutationPrefetch` thread so epoch starts do not wait for
``torch.randperm(N)`` (about 3 s at N = 10**8).
"""

from __future__ import annotations

import threading

import torch


def epoch_permutation(dataset_len: int, seed: int) -> torch.Tensor:
    """``torch.randperm(dataset_len)`` from ``Generator().manual_seed(seed)``: DistributedSampler's shuffle.

    int32 halves the memory (4 bytes/sample). torch's CPU randperm is a Fisher-Yates shuffle whose random draws do
    not depend on the dtype, so the permutation equals DistributedSampler's int64 one (tested).
    """
    g = torch.Generator()
    g.manual_seed(seed)
    dtype = torch.int32 if dataset_len < 2**31 else torch.int64
    return torch.randperm(dataset_len, generator=g, dtype=dtype)


class PermutationPrefetch:
    """One epoch's permutation built on a daemon thread; ``torch.randperm`` releases the GIL while it runs."""

    def __init__(self, dataset_len: int, seed: int) -> None:
        self.key = (dataset_len, seed)
        self._result: torch.Tensor | None = None
        self._thread = threading.Thread(target=self._run, name="HeteroBatchSampler-shuffle", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = epoch_permutation(*self.key)
        except BaseException:  # the consumer recomputes synchronously and sees the error there
            self._result = None

    def take(self) -> torch.Tensor | None:
        """The permutation (waits for the thread), or None when the thread failed."""
        self._thread.join()
        result, self._result = self._result, None
        return result
