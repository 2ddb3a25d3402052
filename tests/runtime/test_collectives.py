"""JSON collectives: what ranks send each other is data (JSON over uint8 tensors), never pickle."""

from __future__ import annotations

import math

import pytest

from planner.errors import PlanError, ValidationError
from runtime.collectives import RemoteError, all_gather_json, broadcast_json, decide_on_rank0
from tests._dist import run_distributed


def test_without_a_process_group_everything_is_local() -> None:
    assert all_gather_json({"a": 1}) == [{"a": 1}]
    assert broadcast_json([1, 2]) == [1, 2]
    assert decide_on_rank0(lambda: "x") == "x"


def _exchange(rank: int, world_size: int) -> None:
    # Different lengths, unicode, nesting and a NaN measurement (rank 0 must see it to refuse it).
    mine = {"rank": rank, "text": "é" * (rank * 50 + 1), "nested": [[rank] * rank], "nan": math.nan}
    got = all_gather_json(mine)
    assert [g["rank"] for g in got] == list(range(world_size))
    assert [len(g["text"]) for g in got] == [r * 50 + 1 for r in range(world_size)]
    assert all(math.isnan(g["nan"]) for g in got)
    assert broadcast_json({"from": rank, "big": list(range(1000 * (rank + 1)))}, src=1)["from"] == 1
    assert decide_on_rank0(lambda: {"decided_by": rank}) == {"decided_by": 0}
    # Objects that are not data are never sent: they fail on the sender, before any collective.
    with pytest.raises(TypeError):
        all_gather_json(object())


@pytest.mark.distributed
def test_gather_broadcast_and_decide_across_ranks() -> None:
    run_distributed(_exchange, 3, timeout_s=60)


def _errors(rank: int, world_size: int) -> None:
    def user_error() -> None:
        raise ValidationError("global batch 4096 exceeds the sum of memory caps 3100")

    with pytest.raises(ValidationError, match="exceeds the sum of memory caps 3100"):
        decide_on_rank0(user_error)

    def infeasible() -> None:
        raise PlanError("no split fits")

    with pytest.raises(PlanError, match="no split fits"):
        decide_on_rank0(infeasible)

    def bug() -> None:
        raise KeyError("oops")

    # Rank 0 re-raises its own error; the others learn of it instead of waiting forever.
    with pytest.raises(KeyError if rank == 0 else RemoteError, match="oops"):
        decide_on_rank0(bug)
    assert decide_on_rank0(lambda: 7) == 7  # the group is still usable afterwards


@pytest.mark.distributed
def test_an_error_on_rank_0_reaches_every_rank_with_its_kind() -> None:
    run_distributed(_errors, 2, timeout_s=60)


def _kept_after_exchanges(rank: int, world: int) -> None:
    import sys

    from runtime import collectives

    all_gather_json({"rank": rank})
    broadcast_json("x" if rank == 0 else None)
    kept = collectives._BUFFERS._kept
    # The latest exchanges' tensors outlive the calls (the gloo worker's reference is never the last one): the
    # broadcast's two and the all-gather's 2 + 2 * world.
    assert [len(f.value()) for f in kept[-2:]] == [3 + 2 * world, 2], [len(f.value()) for f in kept]
    for _ in range(10):
        all_gather_json(rank)
    kept = collectives._BUFFERS._kept
    assert len(kept) == collectives._Buffers.KEEP  # bounded
    before = sys.getrefcount(kept)
    collectives._BUFFERS.leak_at_exit()
    assert sys.getrefcount(kept) == before + 1  # kept alive past the interpreter's clean-up


@pytest.mark.distributed
def test_exchanged_tensors_outlive_the_exchange_and_the_interpreters_clean_up() -> None:
    run_distributed(_kept_after_exchanges, 2)
