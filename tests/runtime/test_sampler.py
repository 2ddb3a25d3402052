"""HeteroBatchSampler: literal shard tables, DistributedSampler equivalence and layout properties (single process)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from planner.errors import ValidationError
from runtime.sampler import HeteroBatchSampler, HeteroDistributedSampler, interleave_owners


def shards(n: int, sizes: list[int], **kw: object) -> list[list[list[int]]]:
    return [list(HeteroBatchSampler(n, sizes, r, **kw)) for r in range(len(sizes))]  # type: ignore[arg-type]


# -- literal tables -------------------------------------------------------------------------------------------
def test_docstring_example_3_1() -> None:
    assert shards(10, [3, 1], shuffle=False) == [
        [[0, 2, 3], [4, 6, 7], [8, 0]],
        [[1], [5], [9]],
    ]


def test_equal_sizes_match_rank_stride() -> None:
    assert shards(10, [2, 2], shuffle=False) == [
        [[0, 2], [4, 6], [8]],
        [[1, 3], [5, 7], [9]],
    ]


def test_three_ranks_uneven_with_padding_and_min_batch() -> None:
    # B = 8, owners of [5, 1, 2]: keys 0,.2,.4,.6,.8 | 0 | 0,.5 -> ranks 0 1 2 0 0 2 0 0
    assert interleave_owners([5, 1, 2]).tolist() == [0, 1, 2, 0, 0, 2, 0, 0]
    # N = 11: one full step, R = 3 -> r = (ceil(15/8), ceil(3/8), ceil(6/8)) = (2, 1, 1); min_batch 2 -> (2, 2, 2)
    assert shards(11, [5, 1, 2], shuffle=False, min_batch=1) == [
        [[0, 3, 4, 6, 7], [8, 0]],  # partial step: owners of (2, 1, 1) are 0 1 2 0; position 11 wraps to P[0]
        [[1], [9]],
        [[2, 5], [10]],
    ]
    got = shards(11, [5, 2, 2], shuffle=False, min_batch=2)
    assert [len(b) for b in got[0]] == [5, 2] and [len(b) for b in got[1]] == [2, 2]


def test_drop_last_drops_partial_step_and_refuses_zero_steps() -> None:
    assert shards(10, [3, 1], shuffle=False, drop_last=True) == [[[0, 2, 3], [4, 6, 7]], [[1], [5]]]
    with pytest.raises(ValidationError, match="fewer than one global step of 4"):
        HeteroBatchSampler(3, [3, 1], 0, drop_last=True)


def test_bad_arguments() -> None:
    with pytest.raises(ValidationError, match="below min_batch 2"):
        HeteroBatchSampler(10, [3, 1], 0, min_batch=2)
    with pytest.raises(ValidationError, match="rank 2 is outside"):
        HeteroBatchSampler(10, [3, 1], 2)
    with pytest.raises(ValidationError, match="dataset_len"):
        HeteroBatchSampler(0, [3, 1], 0)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"rank": 1.5}, "rank must be an integer, got float 1.5"),
    ({"rank": float("nan")}, "rank must be an integer, got float nan"),
    ({"rank": None}, "rank must be an integer, got NoneType"),
    ({"rank": True}, "rank must be an integer, got bool"),
    ({"rank": -1}, "rank must be >= 0, got -1"),
    ({"dataset_len": 10**400}, "dataset_len must be in 1..1099511627776"),
    ({"dataset_len": float("inf")}, "dataset_len must be an integer, got float inf"),
    ({"seed": "7"}, 'seed must be an integer, got str "7"'),
    ({"min_batch": 2.5}, "min_batch must be an integer"),
    ({"batch_sizes": [3, None]}, "batch sizes must be integers"),
    ({"batch_sizes": "31"}, "expected a list of per-rank batch sizes"),
    ({"batch_sizes": [2**26, 2**26]}, "exceeds the dataset's 100 samples"),
])
def test_arguments_are_checked_with_the_argument_named(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"dataset_len": 100, "batch_sizes": [3, 1], "rank": 0} | kwargs
    with pytest.raises(ValidationError) as info:
        HeteroBatchSampler(args.pop("dataset_len"), args.pop("batch_sizes"), args.pop("rank"), **args)  # type: ignore[arg-type]
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert HeteroBatchSampler(100, [3, 1], 1.0).rank == 1  # type: ignore[arg-type]  # an integral float is fine


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"shuffle": "no"}, 'shuffle must be True or False, got str "no"'),  # bool("no") is True
    ({"shuffle": 0}, "shuffle must be True or False, got int 0"),
    ({"drop_last": "False"}, 'drop_last must be True or False, got str "False"'),
    ({"prefetch": 1}, "prefetch must be True or False, got int 1"),
])
def test_flags_must_be_bools(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError) as info:
        HeteroBatchSampler(100, [3, 1], 0, **kwargs)  # type: ignore[arg-type]
    assert message in str(info.value), str(info.value)
    assert HeteroBatchSampler(100, [3, 1], 0, shuffle=np.bool_(False)).shuffle is False


def test_a_shuffle_that_cannot_fit_in_memory_is_refused_at_construction() -> None:
    from runtime.sampler import check_fits_memory, memory_bytes, permutation_bytes

    # 2**40 samples: 4 TiB of int64 permutation, twice with the prefetch; it used to be accepted and abort at exit.
    with pytest.raises(ValidationError, match=r"dataset_len 1,099,511,627,776: shuffling it holds 16,384.0 GiB"):
        HeteroBatchSampler(2**40, [8], 0)
    assert HeteroBatchSampler(2**40, [8], 0, shuffle=False).dataset_len == 2**40  # no permutation: no memory
    assert permutation_bytes(2**31 - 1, prefetch=False) == 4 * (2**31 - 1)  # int32 below 2**31 ...
    assert permutation_bytes(2**31, prefetch=True) == 2 * 8 * 2**31  # ... int64 from there, two with the prefetch
    check_fits_memory(10**6, True, memory=8 * 10**6)  # exactly fits
    with pytest.raises(ValidationError, match="more than this machine's"):
        check_fits_memory(10**6, True, memory=8 * 10**6 - 1)
    assert (memory_bytes() or 1) > 0


def test_echoed_arguments_are_cut_and_say_their_length() -> None:
    with pytest.raises(ValidationError) as info:
        HeteroBatchSampler(100, [3, 1], 0, seed="7" * 5000)  # type: ignore[arg-type]
    text = str(info.value)
    assert len(text) < 120 and "(5,000 characters)" in text, text


def test_a_tampered_state_is_refused_in_one_line() -> None:
    good = HeteroBatchSampler(100, [12, 4], 0).state_dict()
    cases = {
        "missing key": ({k: v for k, v in good.items() if k != "batch_sizes"}, "missing batch_sizes"),
        "huge batch": (good | {"batch_sizes": [2**26 - 4, 4]}, "is not a split of this sampler's global batch 16"),
        "other global batch": (good | {"batch_sizes": [60, 4]}, "is not a split of this sampler's global batch 16"),
        "epoch 10^18": (good | {"epoch": 10**18}, "sampler state epoch must be in 0..2147483648"),
        "string seed": (good | {"seed": "0"}, "sampler state was saved with seed=\"0\" but"),
        "not a dict": ([1, 2], "expected a dict"),
    }
    for name, (state, message) in cases.items():
        sampler = HeteroBatchSampler(100, [12, 4], 0)
        with pytest.raises(ValidationError) as info:
            sampler.load_state_dict(state)  # type: ignore[arg-type]
        assert message in str(info.value), (name, str(info.value))
    moved = good | {"batch_sizes": [10, 6]}  # a re-plan's split of the same global batch resumes
    HeteroBatchSampler(100, [12, 4], 0).load_state_dict(moved)


def test_int32_permutation_equals_distributed_sampler_int64() -> None:
    g = torch.Generator().manual_seed(7)
    ref = torch.randperm(200_003, generator=g)
    flat = [i for b in HeteroBatchSampler(200_003, [200_003], 0, seed=7) for i in b]
    assert flat == ref.tolist()


# -- DistributedSampler + BatchSampler equivalence -------------------------------------------------------------
@settings(max_examples=600, deadline=None)
@given(n=st.integers(1, 400), w=st.integers(1, 8), b=st.integers(1, 12), seed=st.integers(0, 3),
       epoch=st.integers(0, 3), shuffle=st.booleans(), drop_last=st.booleans())
def test_equal_plan_equals_distributed_sampler(n: int, w: int, b: int, seed: int, epoch: int, shuffle: bool,
                                               drop_last: bool) -> None:
    for rank in range(w):
        ds = DistributedSampler(range(n), num_replicas=w, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        ds.set_epoch(epoch)
        ref = list(BatchSampler(ds, b, drop_last=drop_last))
        if drop_last and n < w * b:
            assert ref == []  # DistributedSampler silently trains 0 steps; we refuse
            with pytest.raises(ValidationError):
                HeteroBatchSampler(n, [b] * w, rank, seed=seed, shuffle=shuffle, drop_last=drop_last)
            continue
        s = HeteroBatchSampler(n, [b] * w, rank, seed=seed, shuffle=shuffle, drop_last=drop_last)
        s.set_epoch(epoch)
        assert list(s) == ref
        assert len(s) == len(ref)


# -- layout properties -------------------------------------------------------------------------------------------
def small_or_cheap_n() -> st.SearchStrategy[int]:
    # mostly small N (cheap); one draw in four goes up to 10^5
    return st.one_of(st.integers(1, 500), st.integers(1, 2000), st.integers(1, 500), st.integers(501, 100_000))


@st.composite
def layouts(draw: st.DrawFn) -> tuple[int, list[int], int]:
    w = draw(st.integers(1, 16))
    min_batch = draw(st.integers(1, 3))
    big = draw(st.booleans())
    hi = 300 if big else 12
    sizes = draw(st.lists(st.integers(min_batch, hi), min_size=w, max_size=w))
    n = draw(small_or_cheap_n())
    return n, sizes, min_batch


def epoch_layout(n: int, sizes: list[int], min_batch: int, **kw: object) -> list[list[list[int]]]:
    out = []
    for r in range(len(sizes)):
        s = HeteroBatchSampler(n, sizes, r, min_batch=min_batch, **kw)  # type: ignore[arg-type]
        out.append(list(s))
        assert len(s) == len(out[-1])
    return out


@pytest.mark.slow
@settings(max_examples=700, deadline=None)
@given(layout=layouts(), seed=st.integers(0, 2**31), drop_last=st.booleans(), shuffle=st.booleans())
def test_coverage_counts_and_min_batch(layout: tuple[int, list[int], int], seed: int, drop_last: bool,
                                       shuffle: bool) -> None:
    n, sizes, min_batch = layout
    big_b = sum(sizes)
    if drop_last and n < big_b:
        with pytest.raises(ValidationError):
            HeteroBatchSampler(n, sizes, 0, drop_last=True, min_batch=min_batch)
        return
    per_rank = epoch_layout(n, sizes, min_batch, seed=seed, drop_last=drop_last, shuffle=shuffle)
    steps = {len(b) for b in per_rank}
    assert len(steps) == 1  # equal batch counts: nobody waits in an all-reduce that never comes
    num_steps = steps.pop()
    ref = HeteroBatchSampler(n, sizes, 0, seed=seed, drop_last=drop_last, min_batch=min_batch, shuffle=shuffle)
    seen: Counter[int] = Counter()
    for step in range(num_steps):
        counts = ref.counts_at(step)
        for r in range(len(sizes)):
            batch = per_rank[r][step]
            assert len(batch) == counts[r] >= min_batch
            seen.update(batch)
        if step < n // big_b:
            assert counts == tuple(sizes)
    if drop_last:
        assert num_steps == n // big_b and sum(seen.values()) == num_steps * big_b
        assert max(seen.values()) == 1
    else:
        assert set(seen) == set(range(n))  # every sample at least once
        remaining = n - (n // big_b) * big_b
        # padding only in the partial step, and only what ceil/min_batch rounding asks for
        padding = sum(seen.values()) - n
        expected = sum(ref.partial_sizes()) - remaining if remaining else 0
        assert padding == expected
        if n >= sum(ref.partial_sizes()):
            assert max(seen.values()) <= 2


@settings(max_examples=400, deadline=None)
@given(layout=layouts(), seed=st.integers(0, 1000), epoch=st.integers(0, 5))
def test_deterministic_per_seed_and_epoch(layout: tuple[int, list[int], int], seed: int, epoch: int) -> None:
    n, sizes, min_batch = layout
    rank = len(sizes) - 1
    a = HeteroBatchSampler(n, sizes, rank, seed=seed, min_batch=min_batch)
    b = HeteroBatchSampler(n, sizes, rank, seed=seed, min_batch=min_batch)
    a.set_epoch(epoch)
    b.set_epoch(epoch)
    first = list(a)
    assert first == list(b) == list(a)  # same (seed, epoch): same batches, also on a second pass
    if n > 2 * sum(sizes):
        b.set_epoch(epoch + 1)
        assert list(b) != first


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(layout=layouts(), seed=st.integers(0, 1000), data=st.data())
def test_replan_between_epochs_keeps_coverage(layout: tuple[int, list[int], int], seed: int,
                                              data: st.DataObject) -> None:
    n, sizes, min_batch = layout
    w = len(sizes)
    # a new vector with the same global batch: move samples between ranks, keeping each >= min_batch
    new = list(sizes)
    for _ in range(data.draw(st.integers(0, 5))):
        i, j = data.draw(st.integers(0, w - 1)), data.draw(st.integers(0, w - 1))
        if new[i] > min_batch:
            k = data.draw(st.integers(1, new[i] - min_batch))
            new[i] -= k
            new[j] += k
    samplers = [HeteroBatchSampler(n, sizes, r, seed=seed, min_batch=min_batch) for r in range(w)]
    first = [list(s) for s in samplers]
    for s in samplers:
        s.set_batch_sizes(new)
        assert s.batch_sizes == tuple(sizes)  # not mid-epoch
        s.set_epoch(1)
    second = [list(s) for s in samplers]
    for epoch_batches in (first, second):
        assert len({len(b) for b in epoch_batches}) == 1
        assert {i for rank in epoch_batches for b in rank for i in b} == set(range(n))
    assert all(len(b) == new[r] for r in range(w) for b in second[r][: n // sum(sizes)])
    with pytest.raises(ValidationError, match="must keep the global batch"):
        samplers[0].set_batch_sizes([*new[:-1], new[-1] + 1])


@settings(max_examples=400, deadline=None)
@given(layout=layouts(), seed=st.integers(0, 1000), data=st.data())
def test_resume_equals_uninterrupted(layout: tuple[int, list[int], int], seed: int, data: st.DataObject) -> None:
    n, sizes, min_batch = layout
    rank = data.draw(st.integers(0, len(sizes) - 1))
    full = HeteroBatchSampler(n, sizes, rank, seed=seed, min_batch=min_batch)
    full.set_epoch(3)
    ref = list(full)
    stop = data.draw(st.integers(0, len(ref)))
    first = HeteroBatchSampler(n, sizes, rank, seed=seed, min_batch=min_batch)
    first.set_epoch(3)
    it = iter(first)
    consumed = [next(it) for _ in range(stop)]
    state = first.state_dict()
    assert state["step"] == stop
    resumed = HeteroBatchSampler(n, sizes, rank, seed=seed, min_batch=min_batch)
    resumed.load_state_dict(state)
    resumed.set_epoch(3)  # same epoch: keeps the resumed position
    assert resumed.start_step == stop
    assert consumed + list(resumed) == ref
    resumed.set_epoch(4)  # next epoch starts from 0 again
    assert len(list(resumed)) == len(ref)


def test_state_dict_with_prefetch_and_refusals() -> None:
    s = HeteroBatchSampler(100, [7, 3], 0, seed=1)
    it = iter(s)
    for _ in range(5):  # a DataLoader with workers prefetched 5 batches; training consumed 2
        next(it)
    state = s.state_dict(steps_done=2)
    assert state["step"] == 2 and state["batch_sizes"] == [7, 3]
    other = HeteroBatchSampler(101, [7, 3], 0, seed=1)
    with pytest.raises(ValidationError, match="dataset_len=100 but this sampler has dataset_len=101"):
        other.load_state_dict(state)
    with pytest.raises(ValidationError, match="seed"):
        HeteroBatchSampler(100, [7, 3], 0, seed=2).load_state_dict(state)
    with pytest.raises(ValidationError, match="world_size"):
        HeteroBatchSampler(100, [5, 3, 2], 0, seed=1).load_state_dict(state)


def test_counts_at_does_not_depend_on_iteration_position() -> None:
    s = HeteroBatchSampler(25, [7, 3], 1, seed=0)
    before = [s.counts_at(i) for i in range(s.num_steps)]
    it = iter(s)
    next(it)
    next(it)
    assert [s.counts_at(i) for i in range(s.num_steps)] == before == [(7, 3), (7, 3), (4, 2)]
    with pytest.raises(IndexError):
        s.counts_at(3)


def test_from_plan_and_distributed_twin_through_dataloader() -> None:
    from planner.plan import Plan, Predicted, RankPlan

    ranks = tuple(
        RankPlan(rank=i, batch_size=b, share=b / 10, num_workers=0, predicted_step_time_s=0.1, bottleneck="compute")
        for i, b in enumerate((7, 3))
    )
    plan = Plan(world_size=2, global_batch=10, ranks=ranks, min_batch=2,
                predicted=Predicted(step_time_s=0.1, samples_per_s=100.0, equal_split_samples_per_s=80.0,
                                    ideal_samples_per_s=100.0))
    bs = HeteroBatchSampler.from_plan(plan, 1, 23, seed=4)
    assert bs.batch_sizes == (7, 3) and bs.min_batch == 2
    twin = HeteroDistributedSampler.from_plan(plan, 1, 23, seed=4)
    loader = DataLoader(list(range(23)), sampler=twin, batch_size=twin.batch_size, drop_last=False)
    assert [b.tolist() for b in loader] == list(bs)
    assert len(twin) == sum(len(b) for b in bs) and twin.num_steps == len(bs) == 3
    assert twin.counts_at(2) == (3, 2)


# -- background shuffle (prefetch) ----------------------------------------------------------------------------
def _shuffle_threads() -> list[object]:
    import threading

    return [t for t in threading.enumerate() if t.name == "HeteroBatchSampler-shuffle"]


def test_prefetch_yields_the_same_epochs_with_replans_and_resume() -> None:
    n, sizes = 5003, [7, 3, 5]
    for rank in range(3):
        on = HeteroBatchSampler(n, sizes, rank, seed=3, prefetch=True)
        off = HeteroBatchSampler(n, sizes, rank, seed=3, prefetch=False)
        assert on.prefetch and not off.prefetch
        for epoch in range(4):
            for s in (on, off):
                s.set_epoch(epoch)
                if epoch == 2:
                    s.set_batch_sizes([9, 2, 4])
            assert list(on) == list(off)
        # epoch jump (a resumed run): the shuffle prefetched for epoch 4 is dropped, epoch 9 is built on demand
        state = off.state_dict(steps_done=5)
        state["epoch"] = 9
        for s in (on, off):
            s.load_state_dict(state)
            s.set_epoch(9)
        assert list(on) == list(off)
    one = HeteroBatchSampler(n, [n], 0, seed=3, prefetch=True)
    one.set_epoch(9)
    ref = torch.randperm(n, generator=torch.Generator().manual_seed(3 + 9))
    assert [i for b in one for i in b] == ref.tolist()  # DistributedSampler's shuffle of epoch 9


def test_prefetch_thread_starts_after_first_batch_and_is_joined_by_next_epoch() -> None:
    s = HeteroBatchSampler(2000, [3, 1], 0, seed=0, prefetch=True)
    it = iter(s)  # takes epoch 0's shuffle (started by the constructor)
    assert s._prefetched is None
    assert not _shuffle_threads() or all(not t.is_alive() for t in _shuffle_threads())  # type: ignore[attr-defined]
    next(it)  # first batch drawn: a DataLoader has forked its workers by now; epoch 1's shuffle starts
    assert s._prefetched is not None and s._prefetched.key == (2000, 1)
    rest = list(it)
    s.set_epoch(1)
    epoch1 = list(s)
    assert epoch1 == list(HeteroBatchSampler(2000, [3, 1], 0, seed=1, prefetch=False)) and len(rest) + 1 == len(epoch1)
    s.set_epoch(5)  # stale prefetch (epoch 2) is forgotten, not used
    assert s._prefetched is None
    assert list(s) == list(HeteroBatchSampler(2000, [3, 1], 0, seed=5, prefetch=False))


def test_prefetch_default_threshold_and_no_shuffle() -> None:
    from runtime.sampler import PREFETCH_MIN_LEN

    assert not HeteroBatchSampler(PREFETCH_MIN_LEN - 1, [2, 2], 0, prefetch=None).prefetch
    assert not HeteroBatchSampler(10, [2, 2], 0, shuffle=False, prefetch=True).prefetch
    # the default turns on at 2**22 samples (and costs no more than the first epoch's own shuffle)
    big = HeteroBatchSampler(PREFETCH_MIN_LEN, [2, 2], 0)
    assert big.prefetch and big._prefetched is not None
    assert big._prefetched.take() is not None


def test_prefetching_sampler_copies_pickles_and_feeds_forked_workers() -> None:
    import copy
    import pickle

    s = HeteroBatchSampler(4000, [5, 3], 1, seed=2, prefetch=True)
    clone = copy.deepcopy(s)
    restored = pickle.loads(pickle.dumps(s))
    assert clone._prefetched is None and restored._prefetched is None
    expected = list(HeteroBatchSampler(4000, [5, 3], 1, seed=2, prefetch=False))
    assert list(clone) == list(restored) == expected
    for epoch in range(2):  # DataLoader with forked workers, fresh iterator every epoch
        s.set_epoch(epoch)
        loader = DataLoader(list(range(4000)), batch_sampler=s, num_workers=2,
                            multiprocessing_context="fork", timeout=60)
        got = [b.tolist() for b in loader]
        assert got == list(HeteroBatchSampler(4000, [5, 3], 1, seed=2 + epoch, prefetch=False))
