"""Micro-batches from HeteroBatchSampler: literal tables, layout properties, re-plans, resume (single process)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from planner.errors import ValidationError
from runtime.accumulate import MicroStep, micro_batch_sizes, micro_step_at, micro_steps, partial_micro_layout
from runtime.sampler import HeteroBatchSampler, HeteroDistributedSampler
from runtime.weighting import accumulation_weight, loss_scale, register_weighted_hook


def micro_shards(n: int, sizes: list[int], steps: list[int], **kw: object) -> list[list[list[int]]]:
    return [list(HeteroBatchSampler(n, sizes, r, accumulation_steps=steps, **kw))  # type: ignore[arg-type]
            for r in range(len(sizes))]


# -- literal tables -------------------------------------------------------------------------------------------
def test_even_split_larger_first() -> None:
    assert micro_batch_sizes(10, 3) == [4, 3, 3]
    assert micro_batch_sizes(7, 1) == [7]
    assert micro_batch_sizes(6, 6) == [1] * 6


def test_docstring_example_3_1_with_two_micro_steps_on_rank_0() -> None:
    assert micro_shards(10, [3, 1], [2, 1], shuffle=False) == [
        [[0, 2], [3], [4, 6], [7], [8, 0]],  # partial step: 2 samples fit one micro-batch of ceil(3/2) = 2
        [[1], [5], [9]],
    ]


def test_ddp_k_1_3_with_partial_step() -> None:
    # B = 8, owners of [2, 6]: keys 0, .5 | 0, 1/6, ..., 5/6 -> ranks 0 1 1 1 0 1 1 1; rank 1 cuts its 6 positions
    # into 3 micro-batches of 2. N = 20: 2 full steps, R = 4 -> r = (ceil(4*2/8), ceil(4*6/8)) = (1, 3), owners of
    # [1, 3] are 0 1 1 1; rank 1's 3 samples need ceil(3/2) = 2 micro-batches, [2, 1].
    assert micro_shards(20, [2, 6], [1, 3], shuffle=False) == [
        [[0, 4], [8, 12], [16]],
        [[1, 2], [3, 5], [6, 7], [9, 10], [11, 13], [14, 15], [17, 18], [19]],
    ]


def test_fsdp_equal_k_gives_equal_micro_counts_in_the_partial_step() -> None:
    # b = [10, 4], K = 2 (micro-batches 5 and 2); N = 33: 2 full steps, R = 5 -> r = (ceil(50/14), ceil(20/14)) =
    # (4, 2); rank 0 needs ceil(4/5) = 1 micro-batch, rank 1 ceil(2/2) = 1: both run one.
    s0 = HeteroBatchSampler(33, [10, 4], 0, accumulation_steps=[2, 2], shuffle=False)
    s1 = HeteroBatchSampler(33, [10, 4], 1, accumulation_steps=[2, 2], shuffle=False)
    assert [s0.micro_sizes_at(s) for s in range(3)] == [((5, 5), (2, 2))] * 2 + [((4,), (2,))]
    assert [len(b) for b in s0] == [5, 5, 5, 5, 4] and [len(b) for b in s1] == [2, 2, 2, 2, 2]
    # N = 36 (R = 8 -> r = (6, 3)): rank 0 needs 2 micro-batches, so rank 1 runs 2 as well; min_batch 2 pads it
    # to 2 * 2 = 4 samples (one wrap-around sample), so none of its micro-batches holds 1 sample
    s = HeteroBatchSampler(36, [10, 4], 1, accumulation_steps=[2, 2], min_batch=2, shuffle=False)
    assert s.micro_sizes_at(2) == ((3, 3), (2, 2)) and s.partial_sizes() == (6, 4)
    assert partial_micro_layout([6, 3], [10, 4], [2, 1], 2) == ((6, 3), (2, 1))  # unequal k: counts per rank
    # b = [10, 3], K = 2 (micro-batches 5 and 2), N = 33: R = 7 -> r = (6, 2); rank 0 needs 2 micro-batches,
    # rank 1 alone would need 1 but runs 2 of 1 sample each, so both ranks run 2 forwards (FSDP2 all-gathers)
    s = HeteroBatchSampler(33, [10, 3], 1, accumulation_steps=[2, 2], shuffle=False)
    assert s.micro_sizes_at(2) == ((3, 3), (1, 1)) and list(s)[-2:] == [[27], [31]]


# -- validation -------------------------------------------------------------------------------------------------
def test_bad_accumulation_steps_are_refused() -> None:
    with pytest.raises(ValidationError, match="rank 1 splits its batch of 3 into 4 micro-batches"):
        HeteroBatchSampler(10, [7, 3], 0, accumulation_steps=[1, 4])
    with pytest.raises(ValidationError, match="below min_batch 2; use at most 1 micro-steps on rank 1"):
        HeteroBatchSampler(10, [7, 3], 0, accumulation_steps=[1, 2], min_batch=2)
    with pytest.raises(ValidationError, match="integer >= 1"):
        HeteroBatchSampler(10, [7, 3], 0, accumulation_steps=[0, 1])
    with pytest.raises(ValidationError, match="got 1 values for 2 ranks"):
        HeteroBatchSampler(10, [7, 3], 0, accumulation_steps=[1])
    with pytest.raises(ValidationError, match="use HeteroBatchSampler as the DataLoader's batch_sampler"):
        HeteroDistributedSampler(10, [7, 3], 0, accumulation_steps=[2, 1])
    twin = HeteroDistributedSampler(10, [7, 3], 0)
    twin.set_batch_sizes([7, 3], [2, 1])
    twin.set_epoch(1)
    with pytest.raises(ValidationError, match="accumulation_steps \\[2, 1\\]"):
        list(twin)


def _plan(sizes: list[int], steps: list[int], mode: str = "ddp") -> SimpleNamespace:
    # The fields from_plan reads (an fsdp plan with unequal steps is built here on purpose: Plan refuses it).
    ranks = [SimpleNamespace(rank=i, batch_size=b, accumulation_steps=k) for i, (b, k) in enumerate(zip(sizes, steps))]
    return SimpleNamespace(ranks=ranks, batch_sizes=tuple(sizes), min_batch=1, mode=mode)


def test_from_plan_reads_accumulation_and_refuses_unequal_fsdp() -> None:
    s = HeteroBatchSampler.from_plan(_plan([7, 3], [2, 1]), 0, 25)  # type: ignore[arg-type]
    assert s.accumulation_steps == (2, 1) and s.micro_sizes_at(0) == ((4, 3), (3,))
    assert HeteroBatchSampler.from_plan(_plan([7, 3], [1, 1]), 0, 25).accumulation_steps == (1, 1)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="mode 'fsdp' needs the same accumulation_steps"):
        HeteroBatchSampler.from_plan(_plan([7, 3], [2, 1], "fsdp"), 0, 25)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="use HeteroBatchSampler as the DataLoader's batch_sampler"):
        HeteroDistributedSampler.from_plan(_plan([7, 3], [2, 1]), 0, 25)  # type: ignore[arg-type]


# -- layout properties -------------------------------------------------------------------------------------------
@st.composite
def accumulating_layouts(draw: st.DrawFn) -> tuple[int, list[int], list[int], int]:
    w = draw(st.integers(1, 6))
    min_batch = draw(st.integers(1, 3))
    sizes = draw(st.lists(st.integers(min_batch, 40), min_size=w, max_size=w))
    if draw(st.booleans()):  # fsdp-like: one K for everyone
        k = draw(st.integers(1, min(b // min_batch for b in sizes)))
        steps = [k] * w
    else:
        steps = [draw(st.integers(1, b // min_batch)) for b in sizes]
    n = draw(st.one_of(st.integers(1, 300), st.integers(1, 3000)))
    return n, sizes, steps, min_batch


def group_by_step(sampler: HeteroBatchSampler, micro: list[list[int]]) -> list[list[list[int]]]:
    """This rank's micro-batches grouped into optimizer steps by the layout, checking their sizes on the way."""
    steps, pos = [], 0
    for s in range(sampler.num_steps):
        parts = sampler.micro_sizes_at(s)[sampler.rank]
        group = micro[pos:pos + len(parts)]
        assert [len(b) for b in group] == list(parts)
        steps.append(group)
        pos += len(parts)
    assert pos == len(micro) == len(sampler)  # nothing left over: every rank ends with its last optimizer step
    return steps


def check_epoch(n: int, sizes: list[int], steps: list[int], min_batch: int, samplers: list[HeteroBatchSampler],
                per_rank: list[list[list[int]]]) -> None:
    ref = samplers[0]
    grouped = [group_by_step(s, b) for s, b in zip(samplers, per_rank, strict=True)]
    assert len({len(g) for g in grouped}) == 1  # the same number of optimizer steps on every rank
    num_steps = ref.num_steps
    seen: Counter[int] = Counter()
    for s in range(num_steps):
        counts, micro = ref.counts_at(s), ref.micro_sizes_at(s)
        if len(set(steps)) == 1:
            assert len({len(m) for m in micro}) == 1  # fsdp: the same micro-step count on every rank
        for r in range(len(sizes)):
            upper = -(-sizes[r] // steps[r])  # the planned micro-batch: never exceeded
            assert sum(micro[r]) == counts[r] and all(min_batch <= m <= upper for m in micro[r])
            assert len(micro[r]) == steps[r] if s < n // sum(sizes) else len(micro[r]) <= steps[r]
            seen.update(i for b in grouped[r][s] for i in b)
    remaining = n - (n // sum(sizes)) * sum(sizes)
    if ref.drop_last:
        assert sum(seen.values()) == num_steps * sum(sizes) and max(seen.values()) == 1
    else:
        assert set(seen) == set(range(n))  # exactly once, plus the partial step's wrap-around padding
        assert sum(seen.values()) - n == (sum(ref.partial_sizes()) - remaining if remaining else 0)


@settings(max_examples=300, deadline=None)
@given(layout=accumulating_layouts(), seed=st.integers(0, 1000), drop_last=st.booleans())
def test_coverage_and_equal_step_counts(layout: tuple[int, list[int], list[int], int], seed: int,
                                        drop_last: bool) -> None:
    n, sizes, steps, min_batch = layout
    if drop_last and n < sum(sizes):
        return
    kw = {"seed": seed, "drop_last": drop_last, "min_batch": min_batch}
    samplers = [HeteroBatchSampler(n, sizes, r, accumulation_steps=steps, **kw) for r in range(len(sizes))]  # type: ignore[arg-type]
    per_rank = [list(s) for s in samplers]
    check_epoch(n, sizes, steps, min_batch, samplers, per_rank)
    # full steps are the unaccumulated layout, cut: same samples per rank and step
    plain = [list(HeteroBatchSampler(n, sizes, r, **kw)) for r in range(len(sizes))]  # type: ignore[arg-type]
    for r, s in enumerate(samplers):
        for step, group in enumerate(group_by_step(s, per_rank[r])[: n // sum(sizes)]):
            assert [i for b in group for i in b] == plain[r][step]
    # the weights of one optimizer step add up to the true gradient's
    for step in range(samplers[0].num_steps):
        micro = [micro_step_at(s, step, j) for s in samplers for j in range(len(s.micro_sizes_at(step)[s.rank]))]
        assert sum(m.weight for m in micro) == pytest.approx(1.0)
        assert sum(m.loss_scale for m in micro) == pytest.approx(len(sizes))  # W, then the framework's 1/W
        for s in samplers:  # with the hook: this rank's micro-batch weights average its step's samples
            mine = [micro_step_at(s, step, j) for j in range(len(s.micro_sizes_at(step)[s.rank]))]
            assert sum(m.accumulation_weight for m in mine) == pytest.approx(1.0)


@settings(max_examples=200, deadline=None)
@given(layout=accumulating_layouts(), seed=st.integers(0, 1000), data=st.data())
def test_replan_between_epochs_changes_k(layout: tuple[int, list[int], list[int], int], seed: int,
                                         data: st.DataObject) -> None:
    n, sizes, steps, min_batch = layout
    w = len(sizes)
    new = list(sizes)
    for _ in range(data.draw(st.integers(0, 4))):  # move samples between ranks, keeping each >= min_batch
        i, j = data.draw(st.integers(0, w - 1)), data.draw(st.integers(0, w - 1))
        if new[i] > min_batch:
            k = data.draw(st.integers(1, new[i] - min_batch))
            new[i] -= k
            new[j] += k
    new_steps = [data.draw(st.integers(1, b // min_batch)) for b in new]
    samplers = [HeteroBatchSampler(n, sizes, r, seed=seed, min_batch=min_batch, accumulation_steps=steps)
                for r in range(w)]
    first = [list(s) for s in samplers]
    for s in samplers:
        s.set_batch_sizes(new, new_steps)
        assert s.accumulation_steps == tuple(steps)  # not mid-epoch
        s.set_epoch(1)
    assert samplers[0].accumulation_steps == tuple(new_steps)
    second = [list(s) for s in samplers]
    check_epoch(n, new, new_steps, min_batch, samplers, second)
    for s in samplers:
        s.set_batch_sizes(sizes, steps)
        s.set_epoch(0)
    check_epoch(n, sizes, steps, min_batch, samplers, first)
    assert [list(s) for s in samplers] == first  # epoch 0 again: the same micro-batches


@settings(max_examples=300, deadline=None)
@given(layout=accumulating_layouts(), seed=st.integers(0, 1000), data=st.data())
def test_resume_mid_epoch_and_mid_step(layout: tuple[int, list[int], list[int], int], seed: int,
                                       data: st.DataObject) -> None:
    n, sizes, steps, min_batch = layout
    rank = data.draw(st.integers(0, len(sizes) - 1))
    kw = {"seed": seed, "min_batch": min_batch, "accumulation_steps": steps}
    full = HeteroBatchSampler(n, sizes, rank, **kw)  # type: ignore[arg-type]
    full.set_epoch(2)
    ref = list(full)
    stop = data.draw(st.integers(0, len(ref)))
    first = HeteroBatchSampler(n, sizes, rank, **kw)  # type: ignore[arg-type]
    first.set_epoch(2)
    it = iter(first)
    consumed = [next(it) for _ in range(stop)]
    state = first.state_dict()
    # the same position counted by the loop: MicroStep.step / index of the next micro-batch
    positions = [(m.step, m.index) for _, m in micro_steps(ref, full)]
    assert (state["step"], state["micro_step"]) == (positions[stop] if stop < len(ref) else (full.num_steps, 0))
    assert first.state_dict(state["step"], micro_steps_done=state["micro_step"]) == state
    resumed = HeteroBatchSampler(n, sizes, rank, **kw)  # type: ignore[arg-type]
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # same epoch: keeps the resumed position
    rest = list(micro_steps(resumed, resumed))
    assert consumed + [b for b, _ in rest] == ref
    assert [(m.step, m.index) for _, m in rest] == positions[stop:]
    resumed.set_epoch(3)  # next epoch starts from step 0 again
    assert len(list(resumed)) == len(resumed)


def test_state_without_accumulation_keys_loads_as_one_micro_step() -> None:
    s = HeteroBatchSampler(50, [7, 3], 0, seed=1)
    state = s.state_dict(steps_done=2)
    assert state["accumulation_steps"] is None and state["micro_step"] == 0
    for key in ("accumulation_steps", "pending_accumulation_steps", "micro_step"):  # a checkpoint written before accumulation
        del state[key]
    acc = HeteroBatchSampler(50, [7, 3], 0, seed=1, accumulation_steps=[2, 1])
    acc.load_state_dict(state)
    assert acc.accumulation_steps == (1, 1) and acc.start_step == 2
    with pytest.raises(ValidationError, match=r"micro-step 2 is outside 0\.\.1 of step 1 on rank 0"):
        HeteroBatchSampler(50, [7, 3], 0, accumulation_steps=[2, 1]).state_dict(1, micro_steps_done=2)


# -- weights -------------------------------------------------------------------------------------------------------
def test_micro_step_weights_and_the_step_level_helpers() -> None:
    s = HeteroBatchSampler(34, [7, 3], 0, accumulation_steps=[3, 1])  # steps (7,3) x3, then (3,2) in one micro-batch
    assert s.micro_sizes_at(0) == ((3, 2, 2), (3,)) and s.micro_sizes_at(3) == ((3,), (2,))
    got = [m for _, m in micro_steps(s, s)]
    assert [(m.step, m.index, m.count, m.num_samples) for m in got[:4]] == [(0, 0, 3, 3), (0, 1, 3, 2), (0, 2, 3, 2),
                                                                             (1, 0, 3, 3)]
    assert [m.is_last for m in got] == [False, False, True] * 3 + [True]
    m = got[1]
    assert m == MicroStep(step=0, index=1, count=3, num_samples=2, rank_samples=7, step_samples=10, world_size=2)
    assert (m.weight, m.loss_scale, m.accumulation_weight) == pytest.approx((2 / 10, 2 * 2 / 10, 2 / 7))
    assert loss_scale(s, 0, micro_step=1) == pytest.approx(m.loss_scale)
    assert accumulation_weight(s, 0, micro_step=1) == pytest.approx(m.accumulation_weight)
    assert loss_scale(s, 3) == pytest.approx(3 * 2 / 5)  # one micro-batch in the partial step: the old call works
    with pytest.raises(ValidationError, match="step 0 runs as 3 micro-batches on rank 0"):
        loss_scale(s, 0)
    with pytest.raises(RuntimeError, match="more batches than the sampler's 4 steps"):
        list(micro_steps([[0]] * 11, s))
    with pytest.raises(ValidationError, match="already splits every step into micro-batches"):
        register_weighted_hook(None, s, accumulation_steps=2)  # type: ignore[arg-type]  # refused before any use


def test_micro_steps_through_a_prefetching_dataloader() -> None:
    s = HeteroBatchSampler(200, [9, 4], 0, seed=3, accumulation_steps=[3, 2])
    ref = [(b, (m.step, m.index)) for b, m in micro_steps(s, s)]
    loader = DataLoader(list(range(200)), batch_sampler=s, num_workers=2, multiprocessing_context="fork", timeout=60,
                        prefetch_factor=4)
    got = [(b.tolist(), (m.step, m.index)) for b, m in micro_steps(loader, s)]
    assert got == ref and ref[-1][1] == (s.num_steps - 1, len(s.micro_sizes_at(s.num_steps - 1)[0]) - 1)
