"""Gradient accumulation in the program: the solver against exhaustive search, fewest micro-steps, fsdp, messages."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import planner
from planner.curves import Envelope, fit_envelope
from planner.errors import PlanError, ValidationError
from planner.profile import ComputePoint, HostProfile, MemoryProfile, Profile, RankProfile
from planner.solve import accumulation_note, equal_accumulation_split
from tests.planner._profiles import MINIMAL, linear_profile

CAPS_3100 = [900, 900, 650, 650]


def _profile(curves: list[list[tuple[int, float]]], caps: list[int | None],
             optimizer_s: list[float | None] | None = None) -> Profile:
    ranks = tuple(
        RankProfile(rank=i, host="h", device=f"cuda:{i}",
                    compute=tuple(ComputePoint(batch_size=b, step_time_s=t) for b, t in pts),
                    memory=None if caps[i] is None else MemoryProfile(max_batch_size=caps[i]),
                    optimizer_step_s=None if optimizer_s is None else optimizer_s[i])
        for i, pts in enumerate(curves)
    )
    return Profile(hosts=(HostProfile(name="h", cpu_cores=64),), ranks=ranks)


def _step_s(plan: planner.Plan) -> float:
    return max(r.predicted_step_time_s for r in plan.ranks)


# -- exhaustive search under the model ---------------------------------------------------------------------
def _model_time(env: Envelope, o: float, b: int, k: int) -> float:
    """The model written out, not linearized: k micro-steps of b/k (t - o each) plus one optimizer step, and never
    faster than the same samples in one step."""
    return max(env(b), k * (env(b / k) - o) + o)


def _tables(profile: Profile, B: int, kmax: int, min_batch: int) -> list[np.ndarray]:
    """Per rank, tau[b, k-1] for b = 0..B, k = 1..kmax (inf where the micro-batches break a cap or min_batch)."""
    out = []
    for r in profile.by_rank:
        env = fit_envelope(r.compute)
        cap = r.memory.max_batch_size if r.memory is not None else None
        tab = np.full((B + 1, kmax), np.inf)
        for b in range(min_batch, B + 1):
            for k in range(1, kmax + 1):
                if b // k >= min_batch and (cap is None or math.ceil(b / k) <= cap):
                    tab[b, k - 1] = _model_time(env, r.optimizer_step_s or 0.0, b, k)
        out.append(tab)
    return out


def _exhaustive(profile: Profile, B: int, kmax: int, min_batch: int, fsdp: bool) -> tuple[float, int]:
    """(optimal step time, fewest total micro-steps among the optimal splits) by trying every (b, k)."""
    tabs = _tables(profile, B, kmax, min_batch)
    W = len(tabs)
    splits = [(*head, B - sum(head)) for head in itertools.product(range(B + 1), repeat=W - 1) if sum(head) <= B]

    def times(b: tuple[int, ...]) -> np.ndarray:  # (W, kmax): rank i's time at b_i with k micro-steps
        return np.stack([t[x] for t, x in zip(tabs, b, strict=True)])

    if fsdp:  # one K for every rank: the step is the slowest rank at that K
        best = min(float(times(b).max(axis=0).min()) for b in splits)
    else:  # each rank its own k: its best k, then the slowest rank
        best = min(float(times(b).min(axis=1).max()) for b in splits)
    if not math.isfinite(best):
        return best, 0
    ok = best * (1 + 1e-9)
    fewest = 10**9
    for b in splits:
        fits = times(b) <= ok
        if fsdp:
            K = np.flatnonzero(fits.all(axis=0))
            if K.size:
                fewest = min(fewest, W * (int(K[0]) + 1))
        elif fits.any(axis=1).all():
            fewest = min(fewest, int(sum(int(np.argmax(row)) + 1 for row in fits)))
    return best, fewest


def _random_case(rng: np.random.Generator) -> tuple[Profile, int, int]:
    n = int(rng.integers(2, 4))
    B = int(rng.integers(4, 25 if n == 3 else 41))
    curves, caps, opt = [], [], []
    for _ in range(n):
        batches = sorted(rng.choice(np.arange(1, 33), size=int(rng.integers(1, 4)), replace=False).tolist())
        base, slope = float(rng.uniform(0.001, 0.02)), float(rng.uniform(1e-4, 2e-3))
        pts = [(b, (base + slope * b) * float(rng.uniform(0.85, 1.15))) for b in batches]
        curves.append(pts)
        caps.append(None if rng.random() < 0.25 else int(rng.integers(1, max(2, B // 2))))
        opt.append(None if rng.random() < 0.4 else float(rng.uniform(0, 0.8)) * min(t for _, t in pts))
    return _profile(curves, caps, opt), B, int(rng.choice([1, 1, 2]))


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_solver_matches_exhaustive_search_on_small_random_profiles(mode: str) -> None:
    rng = np.random.default_rng(13 if mode == "ddp" else 14)
    kmax, solved, accumulated = 5, 0, 0
    for _ in range(50):
        profile, B, mb = _random_case(rng)
        best_t, fewest = _exhaustive(profile, B, kmax, mb, fsdp=mode == "fsdp")
        opts = {"min_batch": mb, "max_accumulation_steps": kmax, "mode": mode, "min_gain": 0.0}
        if not math.isfinite(best_t):
            with pytest.raises(PlanError):
                planner.solve(profile, global_batch=B, **opts)
            continue
        plan = planner.solve(profile, global_batch=B, **opts)
        solved += 1
        accumulated += plan.accumulates
        label = f"{mode} B={B} min_batch={mb} plan={plan.batch_sizes} x {plan.accumulation_steps}"
        assert _step_s(plan) == pytest.approx(best_t, rel=1e-9), label
        assert sum(plan.accumulation_steps) == fewest, label  # the fewest micro-steps among the optimal splits
        if mode == "fsdp":
            assert len(set(plan.accumulation_steps)) == 1, label
        for r in plan.ranks:  # the plan's predictions are the model's
            tau = _model_time(fit_envelope(profile.rank(r.rank).compute), profile.rank(r.rank).optimizer_step_s or 0.0,
                              r.batch_size, r.accumulation_steps)
            assert r.predicted_step_time_s == pytest.approx(tau, rel=1e-12), label
    assert solved >= 35 and accumulated >= 20  # most cases are feasible and accumulate: the check is not vacuous


def test_accumulation_beats_or_ties_the_best_split_without_it_with_the_fewest_micro_steps() -> None:
    rng = np.random.default_rng(7)
    compared = 0
    for _ in range(40):
        profile, B, mb = _random_case(rng)
        try:
            plain = planner.solve(profile, global_batch=B, min_batch=mb, min_gain=0.0, max_accumulation_steps=1)
        except PlanError:
            continue
        plan = planner.solve(profile, global_batch=B, min_batch=mb, min_gain=0.0, max_accumulation_steps=5)
        assert _step_s(plan) <= _step_s(plain) * (1 + 1e-12)
        if _step_s(plan) >= _step_s(plain) * (1 - 1e-9):  # a tie: no micro-step more than needed
            assert plan.accumulation_steps == (1,) * profile.world_size
        assert sum(plan.accumulation_steps) == _exhaustive(profile, B, 5, mb, fsdp=False)[1]
        compared += 1
    assert compared >= 15


def test_a_fast_rank_short_of_memory_accumulates_to_take_more() -> None:
    # t = 1 ms and 4 ms per sample, no fixed cost: rank 0 (cap 300) runs 2 x 200 and finishes with rank 1 at 0.4 s,
    # where without accumulation it stops at 300 and rank 1 needs 0.8 s for the other 200.
    prof = linear_profile([0.001, 0.004], caps=[300, None])
    plan = planner.solve(prof, global_batch=500)
    assert plan.batch_sizes == (400, 100)
    assert plan.accumulation_steps == (2, 1)
    assert [r.micro_batch_size for r in plan.ranks] == [200, 100]
    assert plan.predicted.step_time_s == pytest.approx(0.4)
    assert plan.ranks[0].bottleneck == "memory"
    assert plan.solver["no_accumulation_step_time_s"] == pytest.approx(0.8)
    note = accumulation_note(plan)
    assert note is not None and "rank 0: 2 x 200" in note and "800.00 ms without accumulation" in note


def test_above_the_sum_of_caps_ranks_accumulate_and_ddp_steps_differ_while_fsdp_steps_are_equal() -> None:
    prof = linear_profile([0.001, 0.001, 0.004, 0.004], fixed_s=0.01, caps=CAPS_3100)
    ddp = planner.solve(prof, global_batch=4096)
    assert sum(ddp.batch_sizes) == 4096 and ddp.accumulates
    assert all(r.micro_batch_size <= c for r, c in zip(ddp.ranks, CAPS_3100, strict=True))
    # 0.02 + 0.001 b = 0.01 + 0.004 (2048 - b): the fast ranks run 2 micro-steps, the slow ones one, below their cap
    assert ddp.accumulation_steps == (2, 2, 1, 1)
    assert ddp.batch_sizes[0] in (1636, 1637) and ddp.batch_sizes[2] < 650
    note = accumulation_note(ddp)
    assert note is not None and note.startswith("global batch 4096 exceeds the sum of memory caps 3100: ranks "
                                                "accumulate (rank 0: 2 x ")
    fsdp = planner.solve(prof, global_batch=4096, mode="fsdp")
    assert fsdp.mode == "fsdp" and len(set(fsdp.accumulation_steps)) == 1 and fsdp.accumulation_steps[0] >= 2
    assert all(r.micro_batch_size <= c for r, c in zip(fsdp.ranks, CAPS_3100, strict=True))
    assert fsdp.predicted.step_time_s >= ddp.predicted.step_time_s * (1 - 1e-12)  # fsdp has fewer choices


def test_the_optimizer_is_charged_once_per_optimizer_step() -> None:
    # One rank, t(b) = 10 ms + 1 ms/sample (one piece: the model is exact), cap 100, B = 400 -> 4 micro-steps.
    def one(o: float | None) -> planner.Plan:
        return planner.solve(_profile([[(10, 0.02), (100, 0.11)]], [100], [o]), global_batch=400)

    assert one(None).accumulation_steps == (4,)
    assert one(None).predicted.step_time_s == pytest.approx(4 * 0.01 + 0.4)  # o absent: on every micro-step
    assert one(0.005).predicted.step_time_s == pytest.approx(4 * (0.01 - 0.005) + 0.005 + 0.4)


def test_caps_that_do_not_bind_plan_exactly_as_without_accumulation() -> None:
    for prof, B in ((Profile.load(MINIMAL), 512), (linear_profile([0.001, 0.002, 0.004], caps=[500, 300, 200]), 700),
                    (linear_profile([0.001, 0.001], fixed_s=0.005, caps=[1000, 1000], loader_s=[0.004, 0.001],
                                    cores=4), 400)):
        a = planner.solve(prof, global_batch=B)
        b = planner.solve(prof, global_batch=B, max_accumulation_steps=1)
        assert a.accumulation_steps == (1,) * prof.world_size
        assert a.batch_sizes == b.batch_sizes and a.fingerprint == b.fingerprint
        assert a.ranks == b.ranks and a.solver["method"] == b.solver["method"]
        # Only the equal-split baseline may differ: with accumulation a split over a cap still runs.
        assert (a.predicted.step_time_s, a.predicted.ideal_samples_per_s) == (b.predicted.step_time_s,
                                                                               b.predicted.ideal_samples_per_s)
    assert planner.solve(Profile.load(MINIMAL), global_batch=512).batch_sizes == (400, 112)


def test_only_what_no_accumulation_reaches_is_refused_and_the_message_says_what_would() -> None:
    prof = linear_profile([0.001] * 4, caps=CAPS_3100)
    with pytest.raises(PlanError, match=r"global batch 8000 exceeds the sum of memory caps 3100: ranks 0\.\.3 cap at "
                                        r"900, 900, 650, 650; with at most 2 accumulation steps per rank they hold "
                                        r"6200: --max-accumulation-steps 3 would reach it"):
        planner.solve(prof, global_batch=8000, max_accumulation_steps=2)
    assert planner.solve(prof, global_batch=8000, max_accumulation_steps=3).accumulates
    with pytest.raises(PlanError, match="max-batch-per-rank"):  # a cap on the whole step: accumulation cannot help
        planner.solve(prof, global_batch=4096, max_batch_per_rank=1000)
    with pytest.raises(PlanError, match=r"min batch 8 exceeds the memory cap of rank 1 \(4\)"):
        planner.solve(linear_profile([0.001, 0.001], caps=[100, 4]), global_batch=500, min_batch=8)
    with pytest.raises(PlanError, match="under fsdp every rank would run 2 micro-steps"):
        planner.solve(linear_profile([0.001, 0.001], caps=[3, 2]), global_batch=7, mode="fsdp", min_batch=2)


def test_micro_batches_keep_min_batch() -> None:
    plan = planner.solve(linear_profile([0.001, 0.003], fixed_s=0.001, caps=[5, 5]), global_batch=40, min_batch=2)
    assert all(b // k >= 2 for b, k in zip(plan.batch_sizes, plan.accumulation_steps, strict=True))
    assert all(r.micro_batch_size <= 5 for r in plan.ranks)


def test_evaluate_takes_given_or_fewest_micro_steps() -> None:
    prof = linear_profile([0.001, 0.002], fixed_s=0.01, caps=[300, 100])
    fewest = planner.evaluate(prof, [600, 250])
    assert fewest.accumulation_steps == (2, 3)
    assert [r.micro_batch_size for r in fewest.ranks] == [300, 84]
    given = planner.evaluate(prof, [600, 250], [3, 5])
    assert given.ranks[1].predicted_step_time_s == pytest.approx(5 * 0.01 + 0.5)
    with pytest.raises(ValidationError, match="micro_batch_size 150 is above the rank's max_batch_size 100"):
        planner.evaluate(prof, [550, 300], [2, 2])
    with pytest.raises(ValidationError, match="mode is fsdp"):
        planner.evaluate(prof, [600, 250], [2, 3], mode="fsdp")
    assert planner.evaluate(prof, [600, 250], mode="fsdp").accumulation_steps == (3, 3)
    with pytest.raises(ValidationError, match="3 accumulation steps given for 2 ranks"):
        planner.evaluate(prof, [600, 250], [1, 2, 3])


def test_equal_split_baseline_accounts_for_accumulation() -> None:
    prof = linear_profile([0.001, 0.003], fixed_s=0.01, caps=[200, 200])
    plan = planner.solve(prof, global_batch=1000)
    eq = planner.evaluate(prof, [500, 500])
    assert eq.accumulation_steps == (3, 3)
    assert plan.predicted.equal_split_step_time_s == pytest.approx(eq.predicted.step_time_s)
    assert plan.predicted.samples_per_s > plan.predicted.equal_split_samples_per_s > 0
    hand = equal_accumulation_split(prof, 1000)  # the same micro-batch and K everywhere, at the smallest cap
    assert hand.accumulation_steps == (3, 3) and hand.solver["method"] == "equal accumulation"
    assert plan.predicted.samples_per_s >= hand.predicted.samples_per_s
    small = equal_accumulation_split(linear_profile([0.001, 0.001], caps=[400, 100]), 1000)
    assert small.accumulation_steps == (5, 5) and {r.micro_batch_size for r in small.ranks} == {100}


def test_min_gain_compares_with_the_equal_split_at_its_fewest_micro_steps() -> None:
    # Two equal ranks, cap 300, B = 1024: the equal split (2 x 256 each) is the optimum; nothing to keep.
    prof = linear_profile([0.001, 0.001], fixed_s=0.01, caps=[300, 300])
    plan = planner.solve(prof, global_batch=1024)
    assert plan.batch_sizes == (512, 512) and plan.accumulation_steps == (2, 2)
    # Slightly different ranks: the optimum moves a few samples for < 5%: the equal split with accumulation is kept.
    prof = linear_profile([0.001, 0.00102], fixed_s=0.01, caps=[300, 300])
    kept = planner.solve(prof, global_batch=1024)
    assert kept.batch_sizes == (512, 512) and kept.accumulation_steps == (2, 2)
    assert kept.solver["method"].startswith("equal (")


def test_with_loaders_and_host_budgets_accumulating_plans_keep_every_constraint() -> None:
    # Random memory-capped ranks with loader costs and few cores, B above and below the sum of the caps: every plan
    # holds B, keeps each micro-batch within its cap and at min_batch, feeds b_i per optimizer step within the
    # step (p b <= w T), respects the hosts' worker budgets, predicts what the model says, and is never slower
    # than the best plan without accumulation.
    from planner.profile import LoaderProfile
    from planner.solve import build_models

    rng = np.random.default_rng(5)
    for case in range(30):
        n = int(rng.integers(2, 12))
        hosts = tuple(HostProfile(name=f"h{j}", cpu_cores=int(rng.integers(1, 12))) for j in range(int(rng.integers(1, 3))))
        ranks = []
        for i in range(n):
            f, base = float(rng.uniform(1, 4)), float(rng.uniform(0.003, 0.01))
            pts = tuple(ComputePoint(batch_size=b, step_time_s=f * (base + 1e-4 * max(b, 32))) for b in (8, 32, 128, 512))
            ranks.append(RankProfile(rank=i, host=hosts[i % len(hosts)].name, device=f"cuda:{i}", compute=pts,
                                     memory=MemoryProfile(max_batch_size=int(rng.integers(16, 300))),
                                     loader=LoaderProfile(sec_per_sample=float(rng.uniform(1e-4, 3e-3))),
                                     optimizer_step_s=float(rng.uniform(0, 0.004))))
        prof = Profile(hosts=hosts, ranks=tuple(ranks))
        caps = [r.memory.max_batch_size for r in ranks if r.memory is not None]
        B = int(sum(caps) * float(rng.choice([0.6, 1.0, 1.7, 3.0])))
        mb = int(rng.choice([1, 2]))
        mode = str(rng.choice(["ddp", "fsdp"]))
        plan = planner.solve(prof, global_batch=B, min_batch=mb, mode=mode, min_gain=0.0)
        label = f"case {case}: {plan.batch_sizes} x {plan.accumulation_steps} ({plan.solver['method']})"
        assert sum(plan.batch_sizes) == B, label
        models = build_models(prof, plan.options)
        for r, m in zip(plan.ranks, models, strict=True):
            assert r.micro_batch_size <= (m.micro_cap or B) and r.batch_size // r.accumulation_steps >= mb, label
            t, _, tl = m.busy_time(r.batch_size, r.num_workers, r.accumulation_steps)
            assert r.predicted_step_time_s == pytest.approx(t, rel=1e-12) and tl <= plan.predicted.step_time_s, label
        for h in prof.hosts:
            on_h = [r for r in plan.ranks if r.host == h.name]
            assert sum(r.num_workers for r in on_h) <= max(0, h.cpu_cores - len(on_h)) or all(
                r.num_workers == 0 for r in on_h), label
        if mode == "fsdp":
            assert len(set(plan.accumulation_steps)) == 1, label
        try:
            plain = planner.solve(prof, global_batch=B, min_batch=mb, mode=mode, min_gain=0.0, max_accumulation_steps=1)
        except PlanError:
            continue
        assert _step_s(plan) <= _step_s(plain) * (1 + 1e-9), label
