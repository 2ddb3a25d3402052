"""Resume is bit-identical with the default ``fake`` dataset: its random crop and flip are seeded by the sample's
index (profiler.workloads.specs.IndexSeeded), so a loader that restarts on resume builds the same tensors.

Before, the transforms drew from the loader workers' generators, which a restarted loader re-seeds and assigns
batches afresh: after a kill -9 and ``--resume`` the weights differed from the uninterrupted run's by up to 0.0275.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from planner.cli import main
from tests.reliability.test_divergence import one_rank_plan

COMMON = ["--device", "cpu", "--model", "mlp", "--dataset", "fake", "--num-samples", "96", "--quiet"]


def _weights(ckpt: Path) -> dict[str, Any]:
    state = torch.load(ckpt / "checkpoint.pt", map_location="cpu", weights_only=True)
    return state["model"]  # type: ignore[no-any-return]


@pytest.mark.slow
def test_resume_with_loader_workers_equals_the_uninterrupted_run(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    plan = one_rank_plan(tmp_path / "plan.json", 16, num_workers=2)  # workers: the generators that used to differ
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert main(["train", "--plan", str(plan), *COMMON, "--epochs", "2", "--checkpoint", str(whole)]) == 0
    # The same run stopped after epoch 0 and resumed: the loader (and its workers) start afresh.
    assert main(["train", "--plan", str(plan), *COMMON, "--epochs", "1", "--checkpoint", str(parts)]) == 0
    assert main(["train", "--plan", str(plan), *COMMON, "--epochs", "2", "--checkpoint", str(parts),
                 "--resume"]) == 0
    capsys.readouterr()
    a, b = _weights(whole), _weights(parts)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), (key, (a[key] - b[key]).abs().max().item())


def test_a_fake_sample_is_the_same_tensor_whatever_the_generator() -> None:
    from profiler.workloads.specs import build_workload

    ds = build_workload("mlp", "fake", num_samples=16).dataset
    first = ds[3][0]
    torch.manual_seed(99)
    torch.rand(7)
    assert torch.equal(ds[3][0], first)
    assert not torch.equal(ds[4][0], first)
