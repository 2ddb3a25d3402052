"""What-if, sweep and scaling numbers on a profile whose optimum is computed by hand (see _fixtures)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner import solve
from planner.profile import MemoryProfile
from planner.solve import SolveOptions
from reports.analysis import analyze
from reports.whatif import (
    best_range,
    device_kinds,
    scaling,
    sweep,
    sweep_batches,
    what_if_add,
    what_if_drop,
    what_if_upgrade,
)
from tests.reports._fixtures import three_rank_profile

B = 700
OPTS = SolveOptions()
BASE = 700 / 0.4  # 400/200/100 at 1/2/4 ms per sample: every rank done at 0.4 s


def test_base_plan_is_the_hand_optimum() -> None:
    plan = solve(three_rank_profile(), global_batch=B)
    assert plan.batch_sizes == (400, 200, 100)
    assert plan.predicted.samples_per_s == pytest.approx(BASE)
    assert plan.predicted.ideal_samples_per_s == pytest.approx(1000 + 500 + 250)
    # Equal split 234/233/233: the 4 ms rank takes 0.932 s.
    assert plan.predicted.equal_split_samples_per_s == pytest.approx(700 / 0.932)


def test_drop_each_rank() -> None:
    got = what_if_drop(three_rank_profile(), B, BASE, OPTS)
    assert [w.label for w in got] == ["drop rank 0 (cuda:0)", "drop rank 1 (cuda:1)", "drop rank 2 (cuda:2)"]
    # 2+4 ms: 467/233 -> max(0.934, 0.932); 1+4 ms: 560/140 -> 0.56; 1+2 ms: 467/233 -> max(0.467, 0.466).
    assert [w.batch_sizes for w in got] == [(467, 233), (560, 140), (467, 233)]
    assert [w.samples_per_s for w in got] == pytest.approx([700 / 0.934, 700 / 0.56, 700 / 0.467])
    assert [w.delta_samples_per_s for w in got] == pytest.approx([700 / 0.934 - BASE, 1250 - BASE, 700 / 0.467 - BASE])
    assert all(w.world_size == 2 and w.feasible for w in got)


def test_add_one_of_each_kind() -> None:
    prof = three_rank_profile()
    # No device names: ranks with different measurements are different kinds.
    assert [r.rank for _, r in device_kinds(prof)] == [0, 1, 2]
    got = what_if_add(prof, B, BASE, OPTS)
    # Smallest T with sum_i floor(T / s_i) >= 700 (integer batches):
    #   +1 ms: 255*2 + 127 + 63 = 700 at T = 0.255;  +2 ms: 312 + 2*156 + 78 >= 700 first at T = 0.312;
    #   +4 ms: 351 + 175 + 2*87 = 700 at T = 0.351.
    assert [w.samples_per_s for w in got] == pytest.approx([700 / 0.255, 700 / 0.312, 700 / 0.351])
    assert all(w.world_size == 4 for w in got)
    assert got[0].label == "add a cuda like rank 0 on node0"


def test_upgrade_slower_ranks_to_the_fastest_kind() -> None:
    got = what_if_upgrade(three_rank_profile(), B, BASE, OPTS)
    assert [w.subject_rank for w in got] == [1, 2]
    # rank 1 -> 1 ms: 1+1+4 ms, T = 0.312 (624 + 78 >= 700);  rank 2 -> 1 ms: 1+2+1 ms, 280+140+280 at T = 0.28.
    assert [w.samples_per_s for w in got] == pytest.approx([700 / 0.312, 2500.0])


def test_scaling_over_the_first_k_ranks() -> None:
    got = scaling(three_rank_profile(), B, OPTS)
    assert [p.samples_per_s for p in got] == pytest.approx([1000.0, 700 / 0.467, BASE])
    assert [p.speedup for p in got] == pytest.approx([1.0, 700 / 0.467 / 1000, 1.75])
    assert all(p.global_batch == B and p.feasible for p in got)


def test_report_numbers_equal_planner_solve() -> None:
    prof = three_rank_profile()
    plan = solve(prof, global_batch=B)
    rep = analyze(prof, plan, OPTS, dataset_size=7000)
    assert rep.throughput.plan_samples_per_s == plan.predicted.samples_per_s
    assert rep.throughput.epoch_time_s == pytest.approx(10 * 0.4)
    assert [r.batch_size for r in rep.ranks] == [400, 200, 100]
    assert [r.predicted_step_time_s for r in rep.ranks] == pytest.approx([0.4, 0.4, 0.4])
    assert B in [p.global_batch for p in rep.sweep]
    for p in rep.sweep:
        ref = solve(prof, global_batch=p.global_batch)
        assert p.samples_per_s == ref.predicted.samples_per_s
        assert p.batch_sizes == ref.batch_sizes
    f = rep.findings
    assert f.binding_ranks == (0, 1, 2)
    assert f.drop_ranks == ()
    assert f.upgrade_ranks == (2, 1)  # +43% before +28%
    assert f.loader_starved == ()


def test_sweep_batches_powers_of_two_and_multiples_of_w_up_to_the_caps() -> None:
    # Uncapped ranks reach 2x their largest measured batch (100): the sweep ends at 600.
    got = sweep_batches(three_rank_profile(), OPTS, include=[700])
    assert got == [3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 600, 700]


def test_infeasible_points_are_reported_not_dropped() -> None:
    prof = three_rank_profile()
    capped = replace(prof, ranks=tuple(replace(r, memory=MemoryProfile(max_batch_size=50)) for r in prof.ranks))
    opts = OPTS.with_overrides({"max_accumulation_steps": 1})  # without accumulation the caps bound the batch
    pts = sweep(capped, [100, 150, 151], opts, dataset_size=1000)
    assert [p.feasible for p in pts] == [True, True, False]
    assert "exceeds the sum of memory caps 150" in pts[2].note
    # At 150 every rank is held at its cap of 50, so the 4 ms rank sets T = 0.2 s: 100 is faster.
    assert best_range(pts) == (100, 100)
    # Scaling lowers the global batch to what the first k ranks hold.
    sc = scaling(capped, 150, opts)
    assert [p.global_batch for p in sc] == [50, 100, 150]
    assert sc[0].note.startswith("caps hold at most 50")
