"""A report given a run log says what the run measured: the slow rank by its measured compute, the epoch by the
dataset's size, what-ifs on the measured speeds and communication, split comparisons only at the same rank speeds,
and no drop of a rank the best split needs.

The logs in tests/data are constructed with the runtime's own record types (planner.runlog), numbers as a 2-rank
CPU run over gloo measures them:

  * cpu2_rank1_slow_inside_step_run.jsonl -- two identical ranks, the profile's DDP overhead 94.6 ms a step, rank 1
    5x slower than rank 0 in every epoch (a per-sample cost in the loop, which the profiler's step does not run),
    the measured step ~81 ms; a start record without the dataset size, epochs of 4,096 samples in 64 steps;
  * cpu2_replan_then_rank0_slowdown_run.jsonl -- the plan [7, 3] in epoch 0 with rank 0 at 1.6x its curve,
    re-planned to [5, 5] for epoch 1, rank 0 at 5x its curve in epoch 2.

And two recorded runs of `planner train` on a loaded 2-core box (load average 12-14), cifar_cnn, 2 gloo ranks, global
batch 64, 1,024 samples, 3 epochs, profiled and planned without any added cost (cpu2_loaded_cifar_cnn_profile.json
and _plan.json: the equal split, 404 ms a step plus 100 ms of DDP overhead); then rank 1 waited 40 ms per sample:

  * ..._rank1_sample_cost_in_step_run.jsonl -- in a forward pre-hook of the model's first layer, inside the step
    timer's compute span;
  * ..._rank1_sample_cost_before_timers_run.jsonl -- in a forward pre-hook of the model itself, which runs before
    the span opens: no rank's timer holds it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from planner import Profile, solve
from planner.cli import main
from planner.plan import Plan
from planner.profile import ComputePoint, HostProfile, RankProfile
from planner.quality import check_profile
from planner.runlog import read_run_log
from planner.solve import SolveOptions
from reports.analysis import Report, analyze
from reports.as_measured import as_measured, speed_eras
from reports.causes import INSIDE_STEP
from reports.measured import epoch_size, log_findings

DATA = Path(__file__).resolve().parents[2] / "tests" / "data"
SLOW_PROFILE = DATA / "cpu2_identical_ranks_ddp_overhead_over_step_profile.json"
SLOW_LOG = DATA / "cpu2_rank1_slow_inside_step_run.jsonl"
REPLAN_PROFILE = DATA / "cpu2_replan_then_rank0_slowdown_profile.json"
REPLAN_LOG = DATA / "cpu2_replan_then_rank0_slowdown_run.jsonl"


@pytest.fixture(scope="module")
def slow_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`planner report --profile ... --log ...` on the slow-rank run, as its --json."""
    out = tmp_path_factory.mktemp("report")
    js = out / "r.json"
    assert main(["report", "--profile", str(SLOW_PROFILE), "--log", str(SLOW_LOG), "--out", str(out / "r.html"),
                 "--json", str(js), "--quiet"]) == 0
    rep: dict[str, Any] = json.loads(js.read_text())
    rep["html"] = (out / "r.html").read_text()
    return rep


def test_a_rank_measured_5x_slower_is_named_slow_with_the_cause_inside_the_step(slow_report: dict[str, Any]) -> None:
    lines = slow_report["findings"]["lines"]
    (slow,) = [x for x in lines if x.startswith("Rank 1 (CPU x86_64) is slow in the run log")]
    assert "5.01x its profiled curve where rank 0's is 1.00x" in slow and "4.99x slower than the profile says" in slow
    assert f"{INSIDE_STEP} (" in slow and "`planner train --replan`" in slow
    assert [s["rank"] for s in slow_report["causes"]["slow_ranks"]] == [1]
    # The step as measured, not the profile's "balanced, nobody waits"; the miss not blamed on a 71% noisy point.
    assert not any("nobody waits" in x for x in lines)
    (step,) = [x for x in lines if x.startswith("Step time")]
    assert step.startswith("Step time 81.2 ms measured in the run log (epoch 2) is set by rank 1 (CPU x86_64), busy "
                           "56.2 ms a step; rank 0 is busy 11.5 ms and waits for it"), step
    (miss,) = [x for x in lines if x.startswith("Prediction miss")]
    assert "noisy" not in miss and "rank 1's own step measured 56.1 ms against 11.8 ms predicted" in miss
    page = slow_report["html"]
    assert "No rank is more than 15% slower" not in page
    assert "The scenarios are solved as measured in the run log&#x27;s epoch 2: rank 1 at 5.01x" in page
    assert "rank 1 (CPU x86_64), 80% slower than rank 0 in epoch 2 (run log)" in page and f"<li>{INSIDE_STEP}</li>" in page


def test_the_epoch_is_the_datasets_size_when_the_start_record_lacks_it(slow_report: dict[str, Any]) -> None:
    log = read_run_log(SLOW_LOG)
    assert log.dataset_size is None  # as such a log was written; its epochs trained 4,096 samples in 64 steps
    assert epoch_size(log) == (4096, "the samples the run log's epochs trained")
    thr = slow_report["throughput"]
    assert thr["dataset_size"] == 4096
    assert any("an epoch of 4,096 samples" in x for x in slow_report["findings"]["lines"])


def test_drop_what_ifs_charge_no_more_communication_than_the_measured_step(slow_report: dict[str, Any]) -> None:
    log = read_run_log(SLOW_LOG)
    basis = as_measured(Profile.load(SLOW_PROFILE), log)
    assert basis is not None
    step = log.epochs[-1].step_time_s
    assert step is not None and basis.profile_comm_s == pytest.approx(0.0946) and basis.profile_comm_s > step
    # The step less its slowest rank's own time: 81.2 - 56.2 ms.
    assert basis.comm_s == pytest.approx(0.025, abs=1e-4) and basis.comm_s < step
    assert basis.factors[0] == 1.0 and basis.factors[1] == pytest.approx(5.01, abs=0.01)
    drops = {w["subject_rank"]: w for w in slow_report["what_ifs"] if w["kind"] == "drop"}
    # Dropping the fast rank leaves the slow one alone: slower at the measured speeds, never suggested.
    assert drops[0]["delta_frac"] < 0 and 0 not in slow_report["findings"]["drop_ranks"]
    assert slow_report["what_if_basis"] == ("as measured in the run log's epoch 2: rank 1 at 5.01x its profiled curve; "
                                            "communication 25.0 ms a step as the run measured it, not the "
                                            "profile's 94.6 ms")


def test_splits_are_compared_only_at_the_same_rank_speeds() -> None:
    prof, log = Profile.load(REPLAN_PROFILE), read_run_log(REPLAN_LOG)
    assert log.start_plan is not None
    plan = log.start_plan
    assert speed_eras(prof, log) == [0, 0, 1]
    lines = log_findings(log, plan, prof, check_profile(prof))
    (line,) = [x for x in lines if x.startswith("Measured in the run log")]
    # [5, 5] is measured in epoch 1, before rank 0 slowed, not in epoch 2 (610 samples/s: "2.41x").
    assert line == ("Measured in the run log: the split [7, 3] ran 1,471 samples/s and the equal split [5, 5] 1,600 "
                    "(epochs 0, 1, at the same rank speeds): 0.92x (predicted 1.43x)."), line
    # Without epoch 1 no era ran both splits: no comparison, and the line says why.
    cut = replace(log, epochs=(log.epochs[0], log.epochs[2]))
    lines = log_findings(cut, plan, prof, check_profile(prof))
    assert not any(x.startswith("Measured in the run log") for x in lines)
    (line,) = [x for x in lines if x.startswith("The run log ran the split")]
    assert line == ("The run log ran the split [7, 3] (epoch(s) 0) and the equal split [5, 5] (epoch(s) 2) at "
                    "different rank speeds (rank 0's compute over its curve changed 3.12x between epoch 0 and epoch "
                    "2): their 1,471 and 610 samples/s measure that change, not the splits, so the report does not "
                    "compare them."), line


LOADED_PROFILE = DATA / "cpu2_loaded_cifar_cnn_profile.json"
LOADED_PLAN = DATA / "cpu2_loaded_cifar_cnn_plan.json"


def _loaded_report(log_name: str) -> Report:
    """The report `planner report --profile --plan --log` makes of one of the recorded logs."""
    prof, plan = Profile.load(LOADED_PROFILE), Plan.load(LOADED_PLAN)
    log = read_run_log(DATA / log_name)
    size = epoch_size(log)
    assert size == (1024, "the run log's dataset size")
    return analyze(prof, plan, plan.options, log=log, dataset_size=size[0], quality=check_profile(prof))


def test_a_recorded_per_sample_cost_inside_the_step_names_its_rank_slow() -> None:
    rep = _loaded_report("cpu2_loaded_cifar_cnn_rank1_sample_cost_in_step_run.jsonl")
    lines = rep.findings.lines
    (slow,) = [x for x in lines if x.startswith("Rank 1 (CPU x86_64) is slow in the run log")]
    assert "4.73x its profiled curve where rank 0's is 1.03x" in slow and f"{INSIDE_STEP} (" in slow, slow
    assert rep.causes is not None and [s.rank for s in rep.causes.slow_ranks] == [1]
    (step,) = [x for x in lines if x.startswith("Step time")]
    assert "is set by rank 1 (CPU x86_64), busy 1798.0 ms a step; rank 0 is busy 446.5 ms and waits for it" in step
    assert any("an epoch of 1,024 samples" in x for x in lines)
    # The profile's 100.4 ms of DDP overhead, on a box this loaded, is more than the run paid: 36.3 ms.
    assert "communication 36.3 ms a step as the run measured it, not the profile's 100.4 ms" in rep.what_if_basis
    assert rep.findings.drop_ranks == ()


def test_a_recorded_cost_outside_every_timer_is_named_as_such() -> None:
    rep = _loaded_report("cpu2_loaded_cifar_cnn_rank1_sample_cost_before_timers_run.jsonl")
    (miss,) = [x for x in rep.findings.lines if x.startswith("Prediction miss")]
    assert ("likely cause: 1216.3 ms of each step is in no rank's own time (the step 2017.8 ms, the busiest rank's "
            "compute and data wait 701.2 ms, the predicted communication 100.4 ms): work the loop does outside the "
            "timed forward and backward") in miss, miss
    assert not any("is slow in the run log" in x for x in rep.findings.lines)


def _skewed_profile() -> Profile:
    """Rank 1 2.5x slower than rank 0 (lines through the origin), no communication."""
    def rank(i: int, sec: float) -> RankProfile:
        return RankProfile(rank=i, host="node0", device=f"cuda:{i}",
                           compute=(ComputePoint(batch_size=8, step_time_s=8 * sec),
                                    ComputePoint(batch_size=64, step_time_s=64 * sec)))
    return Profile(hosts=(HostProfile(name="node0", cpu_cores=16),), ranks=(rank(0, 0.001), rank(1, 0.0025)))


def test_a_drop_is_not_suggested_for_a_rank_the_best_split_needs() -> None:
    prof = _skewed_profile()
    # Planned with a min gain that keeps the equal split [32, 32] (80 ms): rank 0 alone takes 64 ms, 25% faster
    # than that, but the uneven optimum with rank 1 takes 46 ms -- the plan needs rank 1.
    opts = SolveOptions(min_gain=0.8)
    plan = solve(prof, global_batch=64, options=opts)
    assert plan.batch_sizes == (32, 32)
    rep = analyze(prof, plan, opts)
    (drop1,) = [w for w in rep.what_ifs if w.kind == "drop" and w.subject_rank == 1]
    assert drop1.delta_frac == pytest.approx(0.25)
    assert rep.findings.drop_ranks == ()
    assert "Every rank adds throughput: dropping any of them lowers samples/s." in rep.findings.lines
    assert not any(x.startswith("Dropping") for x in rep.findings.lines)


def test_a_log_of_equal_ranks_on_their_curves_changes_no_what_if(tmp_path: Path) -> None:
    """Control: a run that measured what the profile said leaves the what-ifs on the profile."""
    prof = Profile.load(SLOW_PROFILE)
    log = read_run_log(SLOW_LOG)
    on_curve = tuple(replace(e, ranks=tuple(replace(s, compute_s=e.ranks[0].compute_s) for s in e.ranks),
                             step_time_s=(e.step_time_s or 0.0) + 0.1) for e in log.epochs)
    log = replace(log, epochs=on_curve)
    plan = log.start_plan
    assert isinstance(plan, Plan)
    rep = analyze(prof, plan, plan.options, log=log)
    assert rep.what_if_basis == "" and rep.causes is not None and rep.causes.slow_ranks == ()


def test_many_ranks_slow_against_their_peers_share_one_finding_line() -> None:
    from planner.runlog import EpochRecord, RunLog
    from planner.stats import StepStats
    from reports.causes import find_causes

    prof = Profile(hosts=(HostProfile(name="node0", cpu_cores=64),),
                   ranks=tuple(RankProfile(rank=i, host="node0", device=f"cuda:{i}", device_name="GPU",
                                           compute=(ComputePoint(batch_size=8, step_time_s=0.008),
                                                    ComputePoint(batch_size=64, step_time_s=0.064)))
                               for i in range(8)))
    # Rank i ran (1 + i/2)x its curve: ranks 1..7 are slow against rank 0, rank 7 the most (4.5x).
    stats = tuple(StepStats(rank=i, epoch=0, num_steps=50, batch_size=32, num_workers=0, data_wait_s=0.0,
                            compute_s=0.032 * (1 + i / 2), step_time_s=0.15) for i in range(8))
    epoch = EpochRecord(epoch=0, plan_fingerprint="x", samples_per_s=1700.0, step_time_s=0.15, loss=1.0,
                        batch_sizes=(32,) * 8, predicted_step_time_s=(0.032,) * 8, ranks=stats)
    log = RunLog(world_size=8, global_batch=256, start_plan=None, epochs=(epoch,), replans=())
    causes = find_causes(prof, global_batch=256, base_samples_per_s=8000.0, opts=SolveOptions(), log=log)
    assert [s.rank for s in causes.slow_ranks] == [7, 6, 5, 4, 3, 2, 1]
    assert [x[:7] for x in causes.lines] == ["Rank 7 ", "Rank 6 ", "Rank 5 ", "4 more "]
    assert causes.lines[-1] == ("4 more ranks ran slow against their profiled curves in the run log (ranks 1..4; the "
                                "worst, rank 4, 3.00x): the HTML report lists each with its state.")
