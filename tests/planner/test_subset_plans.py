"""Leaving ranks out (planner.solve.best_subset, `planner plan --exclude-ranks`): a rank whose all-reduce costs
more than its samples give is named with the launch that leaves it out; a rank that helps never is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import planner
from planner.cli import main
from planner.cli.bench import ideal_with_tail
from planner.solve import best_subset, restrict_profile, subset_candidates, subset_line, with_subset
from tests.planner._profiles import MINIMAL, linear_profile
from tests.runtime._plans import linear_cpu_profile

DATA = Path(__file__).resolve().parents[1] / "data"


def cuda_cpu_profile(exposed_s: float = 0.035, cpu_per_sample_s: float = 1 / 300) -> planner.Profile:
    """One H200 beside the host's CPU as a second rank, ResNet-18 at 32x32, gloo between them, built from the
    measured numbers: the GPU 4 ms + 0.03 ms a sample (256 in 11.7 ms, as it ran alone), the CPU ~300 samples/s,
    35 ms of exposed gloo all-reduce (the 2-rank plan [254, 2] was measured at 44.9 ms a step)."""
    gpu = [(b, 0.004 + 0.00003 * b) for b in (2, 16, 64, 128, 256)]
    cpu = [(b, 0.002 + cpu_per_sample_s * b) for b in (2, 8, 16, 32)]
    return planner.Profile.from_dict({
        "version": 1, "kind": "profile", "hosts": [{"name": "h", "cpu_cores": 16}],
        "ranks": [{"rank": 0, "host": "h", "device": "cuda:0",
                   "compute": [{"batch_size": b, "step_time_s": t} for b, t in gpu]},
                  {"rank": 1, "host": "h", "device": "cpu",
                   "compute": [{"batch_size": b, "step_time_s": t} for b, t in cpu]}],
        "comm": {"backend": "gloo", "allreduce_s": exposed_s * 8 / 7, "exposed_s": exposed_s}})


def test_a_cpu_rank_whose_allreduce_outweighs_its_samples_is_named() -> None:
    profile = cuda_cpu_profile()
    plan = with_subset(profile, planner.solve(profile, global_batch=256))
    assert plan.batch_sizes == (254, 2)  # as measured: the CPU rank takes almost nothing, the all-reduce stays
    found = plan.solver["subset"]
    assert found["exclude_ranks"] == [1] and found["keep_ranks"] == [0] and found["batch_sizes"] == [256]
    assert found["gain"] == pytest.approx(plan.predicted.step_time_s / found["step_time_s"])
    assert found["gain"] > 3.0  # measured: the GPU alone ran 3.3x the 2-rank plan
    line = subset_line(plan, profile, command="planner plan --profile p.json --global-batch 256")
    assert line is not None
    assert line.startswith(f"leaving out rank 1 (cpu) is predicted {found['gain']:.2f}x faster")
    assert line.endswith("planner plan --profile p.json --global-batch 256 --exclude-ranks 1 (then launch 1 rank)")
    # the plan JSON keeps it, and older plans (none recorded) still load
    again = planner.Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.solver["subset"] == found and subset_line(planner.solve(profile, global_batch=256)) is None


def test_a_recorded_rank_slower_alone_than_the_whole_step_is_named() -> None:
    """Recorded on 2 H200s: rank 1 took ~20 ms a step at every batch from 8 to 4096, rank 0 ran all 512 samples in
    7.4 ms; any split waits ~20 ms for rank 1 plus 3.3 ms exposed, so rank 0 alone is predicted 3.3x as fast."""
    profile = planner.Profile.load(DATA / "h200x2_resnet18_cifar_profile.json")
    plan = planner.solve(profile, global_batch=512)
    found = best_subset(profile, plan)
    assert found is not None and found["exclude_ranks"] == [1] and found["batch_sizes"] == [512]
    assert found["gain"] == pytest.approx(plan.predicted.step_time_s / found["step_time_s"]) and found["gain"] > 3


def _helping_profiles() -> list[tuple[str, planner.Profile, int]]:
    out: list[tuple[str, planner.Profile, int]] = [
        (f"linear cpu {c}", linear_cpu_profile(c), 32)
        for c in ([0.01, 0.01], [0.01, 0.02], [0.01, 0.01, 0.03], [0.01, 0.02, 0.04, 0.08], [0.01] * 4)]
    out += [("linear 3 ranks", linear_profile([0.001, 0.002, 0.003], fixed_s=0.002), 512),
            ("linear 4 ranks", linear_profile([0.001, 0.001, 0.0015, 0.004]), 256),
            ("minimal", planner.Profile.load(MINIMAL), 512),
            # the GPU beside a CPU rank over a cheap all-reduce: the CPU's samples are worth it
            ("cuda+cpu, 0.2 ms all-reduce", cuda_cpu_profile(exposed_s=0.0002, cpu_per_sample_s=0.0001), 256)]
    for name, batch in (("cpu2_loaded_cifar_cnn_profile.json", 64), ("cpu2_replan_then_rank0_slowdown_profile.json", 64),
                        ("h100x2_resnet50_compute_skew_426_86_profile.json", 512),
                        ("h100x2_resnet50_loader_skew_465_47_profile.json", 512),
                        ("h100x4_resnet50_profile_noisy_small_batches.json", 512),
                        ("h200x2_own_loop_cotenant_join_profile.json", 512)):
        out.append((name, planner.Profile.load(DATA / name), batch))
    return out


@pytest.mark.parametrize("name, profile, batch", _helping_profiles(), ids=lambda x: x if isinstance(x, str) else "")
def test_a_rank_that_helps_is_never_named(name: str, profile: planner.Profile, batch: int) -> None:
    plan = planner.solve(profile, global_batch=batch)
    assert best_subset(profile, plan) is None, name
    assert "subset" not in with_subset(profile, plan).solver
    # the rule reads the predictions `--exclude-ranks` prints: every candidate is predicted no clearly faster
    for left_out in subset_candidates(profile):
        keep = [r for r in range(profile.world_size) if r not in left_out]
        try:
            sub = planner.solve(restrict_profile(profile, keep), global_batch=batch)
        except planner.PlanError:
            continue
        assert plan.predicted.step_time_s <= sub.predicted.step_time_s * 1.10, (name, left_out)


def test_restrict_profile_renumbers_kept_ranks_and_prices_their_own_links() -> None:
    two_hosts = planner.Profile.from_dict({
        "version": 1, "kind": "profile", "hosts": [{"name": "a", "cpu_cores": 8}, {"name": "b", "cpu_cores": 8}],
        "ranks": [{"rank": r, "host": "ab"[r // 2], "device": f"cuda:{r % 2}",
                   "compute": [{"batch_size": 16, "step_time_s": 0.01}, {"batch_size": 64, "step_time_s": 0.03}]}
                  for r in range(4)],
        "comm": {"allreduce_s": 0.040, "exposed_s": 0.020, "span_factors": [1.01, 1.02, 1.03, 1.04]},
        "meta": {"allreduce_by_host_s": {"a": 0.004, "b": 0.008}}})
    assert subset_candidates(two_hosts) == [(0,), (1,), (2,), (3,), (0, 1), (2, 3)]
    on_b = restrict_profile(two_hosts, [2, 3])
    assert [(r.rank, r.host) for r in on_b.by_rank] == [(0, "b"), (1, "b")]
    assert [h.name for h in on_b.hosts] == ["b"]
    assert on_b.comm is not None and on_b.comm.allreduce_s == pytest.approx(0.008)
    assert on_b.comm.exposed_s == pytest.approx(0.004) and on_b.comm.span_factors == (1.03, 1.04)
    assert on_b.meta["restricted_from"] == {"ranks": [2, 3], "profile_fingerprint": two_hosts.fingerprint()}
    across = restrict_profile(two_hosts, [0, 3])  # still crosses hosts: the whole job's terms
    assert across.comm is not None and across.comm.exposed_s == pytest.approx(0.020)
    alone = restrict_profile(two_hosts, [1])
    assert alone.comm is None and planner.solve(alone, global_batch=64).predicted.comm_s == 0.0


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_names_the_rank_and_exclude_ranks_makes_that_plan(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.json"
    cuda_cpu_profile().save(path)
    rc, out, _ = _cli(["plan", "--profile", str(path), "--global-batch", "256"], capsys)
    assert rc == 0
    named = [line.strip() for line in out.splitlines() if line.strip().startswith("leaving out")]
    assert len(named) == 1 and named[0].endswith(
        f"planner plan --profile {path} --global-batch 256 --exclude-ranks 1 (then launch 1 rank)")
    rc, out, _ = _cli(["plan", "--profile", str(path), "--global-batch", "256", "--exclude-ranks", "1",
                       "--out", str(tmp_path / "plan.json")], capsys)
    assert rc == 0 and "ranks renumbered (profile rank -> plan rank): 0 -> 0" in out and "leaving out" not in out
    sub = planner.Plan.load(tmp_path / "plan.json")
    full = with_subset(cuda_cpu_profile(), planner.solve(cuda_cpu_profile(), global_batch=256))
    assert sub.world_size == 1 and sub.predicted.step_time_s == pytest.approx(full.solver["subset"]["step_time_s"])


@pytest.mark.parametrize("given, says", [
    ("2", "--exclude-ranks: rank 2 given, but the profile has ranks 0..1: give ids in that range"),
    ("-1", "--exclude-ranks: rank -1 given, but the profile has ranks 0..1"),
    ("0,1", "--exclude-ranks 0,1 leaves out all 2 ranks of the profile: keep at least one"),
    ("one", "--exclude-ranks: expected comma-separated rank ids, got 'one'"),
])
def test_exclude_ranks_refuses_a_bad_id_or_every_rank(given: str, says: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.json"
    cuda_cpu_profile().save(path)
    rc, out, err = _cli(["plan", "--profile", str(path), "--global-batch", "256", f"--exclude-ranks={given}"],
                        capsys)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and says in err


def test_bench_ideal_charges_the_unavoidable_allreduce_tail() -> None:
    # flat out 256 samples in 8 ms; the plan's exposed all-reduce 35 ms: what these ranks can reach is 256 / 43 ms
    ideal, tail = ideal_with_tail(256, 32000.0, 0.035, [])
    assert tail == pytest.approx(0.035) and ideal == pytest.approx(256 / 0.043)
    # a run of the split measured at 40 ms a step: the tail is cut so the ideal is never below it
    ideal, tail = ideal_with_tail(256, 32000.0, 0.035, [256 / 0.040])
    assert tail == pytest.approx(0.032) and ideal == pytest.approx(256 / 0.040)
    assert ideal_with_tail(256, 32000.0, 0.0, [5000.0]) == (pytest.approx(32000.0), 0.0)  # one rank: no tail
