"""`planner train --auto`'s loader check (planner.cli.loader_check): the plan's DataLoaders timed at the plan, the loader
curves scaled to what they measured, the plan solved again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import planner
from planner.cli.loader_check import MIN_CHANGE, checked_profile, measured_line
from planner.loader import loader_costs_s
from planner.plan import Plan
from planner.profile import Profile
from tests._ranks import run_planner

RESULTS = Path(__file__).resolve().parents[2] / "tests" / "data"
# A skew launch on 2x H200 ran its loaders 14% costlier than this profile's curve at its plan.
RECORDED = RESULTS / "h200x2_resnet50_compute_skew_stall_393_119"


def _recorded() -> tuple[Profile, Plan, planner.SolveOptions]:
    profile = Profile.load(f"{RECORDED}_profile.json")
    plan = Plan.load(f"{RECORDED}_plan.json")
    return profile, plan, plan.options


def test_the_checked_profile_predicts_at_the_plan_what_the_check_measured() -> None:
    profile, plan, opts = _recorded()
    workers = [r.num_workers for r in plan.ranks]
    modelled = loader_costs_s(profile, opts, workers=workers)
    measured: list[float | None] = [6.09e-3, 6.08e-3]  # what the launch's workers built a sample in (step logs)
    checked = checked_profile(profile, plan, opts, measured, 3.0)
    assert checked is not None
    assert loader_costs_s(checked, opts, workers=workers) == pytest.approx(measured, rel=1e-3)
    rec = checked.meta["loader_check"]
    assert rec["measured_s_per_sample"] == measured and rec["modelled_s_per_sample"] == pytest.approx(modelled)
    assert rec["factors"] == pytest.approx([m / p for m, p in zip(measured, modelled)])  # type: ignore[operator]
    assert measured_line(checked) == ("loader check, ms a sample costs a worker at the plan: rank 0 6.09 (model 5.33), "
                                      "rank 1 6.08 (model 5.33)")
    # solved again on the measured loaders, the plan predicts the slower loaders it will meet (it was loader-bound)
    again = planner.solve(checked, global_batch=plan.global_batch, options=opts)
    assert again.predicted.step_time_s > 1.1 * plan.predicted.step_time_s
    assert sum(r.batch_size for r in again.ranks) == plan.global_batch


def test_a_check_within_min_change_or_without_a_measurement_keeps_the_profile() -> None:
    profile, plan, opts = _recorded()
    modelled = loader_costs_s(profile, opts, workers=[r.num_workers for r in plan.ranks])
    assert checked_profile(profile, plan, opts, [p * (1 + MIN_CHANGE / 2) for p in modelled], 3.0) is None
    assert checked_profile(profile, plan, opts, [None, None], 3.0) is None
    one = checked_profile(profile, plan, opts, [None, modelled[1] * 1.2], 3.0)
    assert one is not None
    assert one.by_rank[0].loader == profile.by_rank[0].loader and one.by_rank[1].loader != profile.by_rank[1].loader


def test_the_check_is_refused_without_auto(capsys: pytest.CaptureFixture[str]) -> None:
    from planner.cli import main

    assert main(["train", "--plan", "plan.json", "--loader-check-s", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--loader-check-s" in err and "Traceback" not in err


@pytest.mark.distributed
def test_auto_checks_the_plans_loaders_and_keeps_plan_and_profile_together(tmp_path: Path) -> None:
    """Two CPU ranks with DataLoaders: the check runs on both, rank 0 says what it found, and the plan written is
    solved on the profile written (the checked one when the check moved it).  The same run's log holds each rank's
    loader time, timed in its DataLoader workers (runtime.loader_timing)."""
    plan_out, profile_out, log = tmp_path / "plan.json", tmp_path / "profile.json", tmp_path / "run.jsonl"
    rc, out = run_planner(2, ["train", "--auto", "--quick", "--device", "cpu", "--model", "cifar_cnn",
                                       "--image-size", "16", "--num-samples", "256", "--global-batch", "32",
                                       "--epochs", "1", "--max-steps-per-epoch", "4", "--loader-check-s", "0.5",
                                       "--plan-out", str(plan_out), "--profile-out", str(profile_out),
                                       "--log-file", str(log)])
    assert rc == 0, out[-3000:]
    epochs = [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "epoch"]
    assert epochs, log.read_text()[-2000:]
    ranks = epochs[0]["ranks"]
    assert len(ranks) == 2 and all(r["loader_s"] is not None and r["loader_s"] > 0 for r in ranks), ranks
    lines = [x for x in out.splitlines() if x.startswith("loader check")]
    assert len(lines) == 1, out[-3000:]
    profile = Profile.load(str(profile_out))
    # --auto sweeps up to the global batch, no rank can be given more; the series ends there
    assert all(max(p.batch_size for p in r.compute) == 32 for r in profile.by_rank), profile.by_rank
    plan = json.loads(plan_out.read_text())
    assert plan["solver"]["profile_fingerprint"] == profile.fingerprint()
    if "solving again" in lines[0]:
        rec = profile.meta["loader_check"]
        assert rec["seconds"] == 0.5 and len(rec["measured_s_per_sample"]) == 2
    else:
        assert "plan kept" in lines[0] and "loader_check" not in profile.meta


def test_after_the_check_the_split_changes_only_for_a_real_gain() -> None:
    """A skew launch with the check (2x H200): the check put the loaders 3.6% and 6.5% above the
    model, and always taking the new optimum jumped from [393, 119] on [23, 7] workers to [462, 50] on [27, 3]
    (predicted 0.9% faster; it ran 20% slower).  Now the split is kept, with its predictions from the checked
    profile, unless a re-solve gains the Replanner's 5%."""
    import dataclasses

    from planner.cli.loader_check import after_check
    from planner.loader import scaled_loader

    checked = Profile.load(str(RESULTS / "h200x2_resnet50_compute_skew_stall_462_50_profile.json"))
    opts = Plan.load(str(RESULTS / "h200x2_resnet50_compute_skew_stall_462_50_plan.json")).options
    scale = checked.meta["loader_check"]["scale"]
    unchecked = dataclasses.replace(checked, ranks=tuple(
        dataclasses.replace(r, loader=scaled_loader(r.loader, 1 / s)) for r, s in zip(checked.by_rank, scale)))
    first = planner.solve(unchecked, global_batch=512, options=opts)
    assert [r.batch_size for r in first.ranks] == [393, 119] and [r.num_workers for r in first.ranks] == [23, 7]

    kept, said = after_check(checked, first, opts, 0.05)
    assert [r.batch_size for r in kept.ranks] == [393, 119] and [r.num_workers for r in kept.ranks] == [23, 7]
    assert "kept" in said and kept.solver["loader_check"]["kept"] is True
    assert kept.solver["profile_fingerprint"] == checked.fingerprint()
    # its predictions are the checked profile's: slower than the first plan's, as the loaders measured
    again_at = planner.evaluate(checked, [393, 119], num_workers=[23, 7], options=opts)
    assert kept.predicted.step_time_s == pytest.approx(again_at.predicted.step_time_s)
    assert kept.predicted.step_time_s > 1.03 * first.predicted.step_time_s

    moved, said = after_check(checked, first, opts, 0.0)  # no threshold: the far corner the launch ran
    assert [r.batch_size for r in moved.ranks] == [462, 50] and "solved again" in said
