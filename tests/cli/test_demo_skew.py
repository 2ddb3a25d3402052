"""`planner demo`'s emulated skew: on CPU a fixed per-sample cost on rank 1 (which a loaded host neither changes
nor makes noisy), on GPUs repeated compute; given options win, bad ones are one line."""

from __future__ import annotations

import argparse

import pytest
from torch import nn

from planner.cli.demo import (
    CPU_SAMPLE_COST,
    GPU_SLOWDOWN,
    SAMPLE_COST_ENV,
    add_arguments,
    cifar_cnn_with_sample_cost,
    parse_sample_cost,
    skew,
)
from planner.errors import ValidationError


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_cpu_defaults_to_a_per_sample_cost_on_rank_1_and_gpus_to_repeated_compute() -> None:
    assert skew(_args(), on_gpu=False) == ("", CPU_SAMPLE_COST) == ("", "1=25")
    assert skew(_args(), on_gpu=True) == (GPU_SLOWDOWN, "")
    assert skew(_args("--nproc", "1"), on_gpu=False) == ("", "")  # no rank 1 to slow
    assert skew(_args("--model", "mlp"), on_gpu=False) == ("", "")  # the cost is the demo model's
    assert skew(_args("--sample-cost", "", "--emulate-slowdown", "1=3"), on_gpu=False) == ("1=3", "")
    assert skew(_args("--sample-cost", "1=50"), on_gpu=True) == (GPU_SLOWDOWN, "1=50")


@pytest.mark.parametrize(("argv", "message"), [
    (["--sample-cost", "2=25"], "--sample-cost"),
    (["--sample-cost", "1=fast"], "expected RANK=MS"),
    (["--sample-cost", "1=-3"], "expected RANK=MS"),
    (["--sample-cost", "1=25", "--model", "mlp"], "applies to the demo's cifar_cnn"),
])
def test_bad_sample_cost_is_one_line(argv: list[str], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        skew(_args(*argv), on_gpu=False)


def test_only_the_named_rank_gets_the_cost_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_sample_cost("1=25, 0=0") == {1: 0.025, 0: 0.0}
    monkeypatch.setenv(SAMPLE_COST_ENV, "1=25")
    monkeypatch.setenv("RANK", "1")
    slow = cifar_cnn_with_sample_cost(num_classes=10)
    assert isinstance(slow, nn.Sequential) and getattr(slow[0], "seconds", None) == 0.025
    monkeypatch.setenv("RANK", "0")
    fast = cifar_cnn_with_sample_cost(num_classes=10)
    assert isinstance(fast, nn.Sequential) and not hasattr(fast[0], "seconds")
    # The same parameters in the same order on both ranks: DDP's buckets and the plan's model match.
    assert [p.shape for p in slow.parameters()] == [p.shape for p in fast.parameters()]
    assert [type(m) for m in slow[1:]] == [type(m) for m in fast]
