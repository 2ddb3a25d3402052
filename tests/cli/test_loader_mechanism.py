"""benchmarks/loader_mechanism.py's loader loop (the session-9 drift measurements)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._scripts import benchmark


class _Tiny(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((2,), float(i)), i


def test_loader_runs_epoch_after_epoch_until_its_seconds() -> None:
    mech = benchmark("loader_mechanism")
    out: dict[str, Any] = {}
    mech.run_loader(_Tiny(), 1, 2, 0.5, out)
    assert out["batches"] > 3  # more than one epoch of 3 batches
    assert out["workers"] == 1 and out["batch"] == 2


def test_a_dataset_without_a_whole_batch_is_refused_instead_of_looping_forever() -> None:
    mech = benchmark("loader_mechanism")
    with pytest.raises(SystemExit, match="6 samples holds no batch of 8"):
        mech.run_loader(_Tiny(), 1, 8, 0.05, {})
