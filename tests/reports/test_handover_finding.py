"""The report's hand-over cause (reports.measured.handover_cause) and drained epochs, on recorded run logs.

A 2x H200 loader-skew launch (streamed, streamed, plan [495, 17] at 107.9 ms): rank 0's 29 workers built a batch
every 93 ms, yet it waited 34 ms a step for data and the step ran 129 ms -- its 298 MB batches reached the loop
slower than they were built (the pinning thread).  The report must name that, not
"the loader is slower than profiled" (more workers would not help) nor "the curve does not match"."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from planner.plan import Plan
from planner.profile import Profile
from planner.runlog import read_run_log
from reports.measured import log_findings, measured_splits

RESULTS = Path(__file__).resolve().parents[2] / "tests" / "data"
H200_LOADER = RESULTS / "h200x2_resnet50_loader_skew_495_17"


def _inputs(tag: Path) -> tuple[Profile, Plan]:
    return Profile.load(f"{tag}_profile.json"), Plan.load(f"{tag}_plan.json")


def test_a_rank_whose_batches_arrive_slower_than_built_is_paced_by_the_hand_over() -> None:
    profile, plan = _inputs(H200_LOADER)
    log = read_run_log(f"{H200_LOADER}_run.jsonl")
    miss = [x for x in log_findings(log, plan, profile, None) if x.startswith("Prediction miss")]
    assert len(miss) == 1 and "[495, 17] measured 129.4 ms per step against 107.9 ms predicted" in miss[0]
    assert "rank 0 waits 34.2 ms per step for data although its workers build a batch every 92.9 ms" in miss[0]
    assert "pinning thread" in miss[0] and "more workers do not" in miss[0]
    # With the profile's sample size (and its hand-over reading) the finding gives the batch's bytes and rates.
    ranks = tuple(replace(r, loader=replace(r.loader, sample_bytes=602_112, handover_bytes_per_s=3.97e9))  # type: ignore[arg-type]
                  for r in profile.ranks)
    sized = [x for x in log_findings(log, plan, replace(profile, ranks=ranks), None) if x.startswith("Prediction")]
    assert "298 MB a batch, 2.3 GB/s as delivered against 4.0 GB/s in the profile" in sized[0]


def test_a_run_without_the_pin_thread_is_named_the_same_way() -> None:
    """The same case launched with --no-pin-memory: the loop copies from shared memory itself (211 ms a step) while its workers
    built a batch every 98 ms: the batches still arrive slower than they are built."""
    tag = RESULTS / "h200x2_resnet50_loader_skew_no_pin_495_17"
    profile, plan = _inputs(tag)
    miss = [x for x in log_findings(read_run_log(f"{tag}_run.jsonl"), plan, profile, None)
            if x.startswith("Prediction miss")]
    assert miss and "slower than they are built" in miss[0]


def test_epochs_wholly_in_the_drain_are_not_measured_as_the_splits_pace() -> None:
    """A streamed run's last epochs run on batches built before (a 2x H100 launch of 4 epochs of 50 steps, the last
    112 steps at the GPUs' pace).  Marked by drain_steps, they are left out of the measured split."""
    log = read_run_log(RESULTS / "h100x2_resnet50_loader_skew_477_35_run.jsonl")
    assert [round(1000 * (e.step_time_s or 0)) for e in log.epochs] == [134, 151, 138, 118]
    marked = tuple(replace(e, ranks=tuple(replace(s, drain_steps=s.num_steps) for s in e.ranks))
                   if e.epoch >= 2 else e for e in log.epochs)
    assert [e.drained for e in marked] == [False, False, True, True]
    split = measured_splits(replace(log, epochs=marked), 0.0)[0]
    assert split.epochs == (1,) and round(1000 * split.step_time_s) == 151


def test_the_report_says_which_rank_its_hand_over_holds() -> None:
    """The 2x H200 loader-skew profile fed the rate its run implies (2.24 GB/s for 602 KB samples): the plan gives rank 0 471
    samples at 129 ms, set by pinning its 284 MB batch, and the report says more workers would not help."""
    import planner
    from reports.analysis import analyze

    profile, _ = _inputs(H200_LOADER)
    ranks = tuple(replace(r, loader=replace(r.loader, sample_bytes=602_112, handover_bytes_per_s=2.24e9))  # type: ignore[arg-type]
                  for r in profile.ranks)
    held = replace(profile, ranks=ranks)
    plan = planner.solve(held, global_batch=512)
    assert plan.batch_sizes == (471, 41)
    lines = [x for x in analyze(held, plan, plan.options).findings.lines if x.startswith("Hand-over-bound")]
    assert len(lines) >= 1 and lines[0].startswith("Hand-over-bound: rank 0's batch of 471 (284 MB) takes 126.6 ms")
    assert "more workers do not relieve it" in lines[0]
    assert not [x for x in analyze(profile, plan, plan.options).findings.lines if x.startswith("Hand-over-bound")]


DATALOADER_PIN = RESULTS / "h100x2_resnet50_loader_skew_dataloader_pin_475_37"


def test_workers_slower_than_their_plan_are_named_before_the_hand_over() -> None:
    """A launch with the DataLoader's own pinning (2x H100, the host losing 0.36 cores to steal by the host monitor): rank 0's
    workers built a batch every 125.4 ms against 104.4 ms in its plan, and it waited 42 ms a step on top.  The
    loaders' own slowdown comes first; the hand-over is what is left."""
    profile, plan = _inputs(DATALOADER_PIN)
    log = read_run_log(f"{DATALOADER_PIN}_run.jsonl")
    (miss,) = [x for x in log_findings(log, plan, profile, None) if x.startswith("Prediction miss")]
    assert "rank 0's workers built a batch every 125.4 ms against 104.4 ms in the plan (+20%)" in miss
    assert "the host gave its workers less than when profiled" in miss and "steal" not in miss  # not recorded then
    assert miss.endswith("beyond that it waits 42.0 ms per step for data, the hand-over of each batch to the "
                         "training loop.")


def test_steal_in_the_log_is_named_as_the_workers_cause() -> None:
    """The same log as if its epochs had recorded the steal the host monitor saw (DeviceState.cpu_steal_cores)."""
    profile, plan = _inputs(DATALOADER_PIN)
    log = read_run_log(f"{DATALOADER_PIN}_run.jsonl")
    epochs = tuple(replace(e, device_state=tuple(None if s is None else replace(s, cpu_steal_cores=0.36)
                                                 for s in e.device_state)) for e in log.epochs)
    (miss,) = [x for x in log_findings(replace(log, epochs=epochs), plan, profile, None) if x.startswith("Prediction")]
    assert "the hypervisor took 0.36 core(s) from its cores (steal) meanwhile: a busy VM host may have slowed" in miss


def test_the_run_log_table_reads_the_last_steady_epoch_not_the_drain() -> None:
    """A launch with the DataLoader's own pinning (2x H100, 4 streamed epochs of 120 steps): epoch 3 holds 112 steps of the
    loaders' final drain, where rank 1's 2-worker loader no longer paces it (-14 to -18% in such epochs).  The
    per-rank table reads epoch 2, and says why."""
    from reports.analysis import analyze, options_for
    from reports.summary import format_summary

    tag = RESULTS / "h100x2_resnet50_loader_skew_dataloader_pin_474_38"
    profile, plan = _inputs(tag)
    log = read_run_log(f"{tag}_run.jsonl")
    assert [e.drain_steps for e in log.epochs] == [0, 0, 0, 112]
    steady = log.steady_epoch()
    assert steady is not None and steady.epoch == 2
    out = format_summary(analyze(profile, plan, options_for(plan), log=log))
    table = out[out.index("Run log, epoch 2 (the last steady one: epoch 3 has 112 steps in the loaders' final drain"):]
    rows = [line.split() for line in table.splitlines()[3:5]]
    assert [r[3] for r in rows] == ["+4.4%", "-2.1%"]


def test_a_re_plans_first_epoch_is_no_steady_reading_either() -> None:
    """A launch with the DataLoader's own pinning that adopted [469, 43] -> [475, 37] after epoch 1: epoch 2 refilled the new
    plan's stream and epoch 3 drained, so the last steady epoch is epoch 1, of the start plan."""
    log = read_run_log(f"{RESULTS / 'h100x2_resnet50_loader_skew_dataloader_pin_469_43_replanned'}_run.jsonl")
    steady = log.steady_epoch()
    assert steady is not None and steady.epoch == 1 and steady.batch_sizes == (469, 43)
    one = replace(log, epochs=log.epochs[:1])
    assert one.steady_epoch() is one.epochs[0]  # nothing steady: the last epoch, as before


LOADER_478_34 = RESULTS / "h100x2_resnet50_loader_skew_478_34"


def test_a_rank_off_in_the_tables_epoch_is_explained_though_its_splits_median_is_not() -> None:
    """A loader-skew launch (2x H100; the host monitor saw 0.52 cores stolen): rank 0 ran +30% in epoch 2,
    the epoch the per-rank table shows, while its split's median over epochs 1-3 stayed under the 15% a split miss
    needs.  The table's miss is explained, with the steal the epoch recorded beside the hand-over."""
    profile, plan = _inputs(LOADER_478_34)
    log = read_run_log(f"{LOADER_478_34}_run.jsonl")
    found = log_findings(log, plan, profile, None)
    assert not [x for x in found if x.startswith("Prediction miss:")]  # the split's median is within tolerance
    (miss,) = [x for x in found if x.startswith("Prediction miss in epoch")]
    assert miss.startswith("Prediction miss in epoch 2 (the run log's per-rank table): rank 0 was busy 151.6 ms a "
                           "step against 116.3 ms predicted (+30%)")
    assert "rank 0 waits 36.6 ms per step for data although its workers build a batch every 116.2 ms" in miss
    assert "the hypervisor took 0.60 core(s) from its cores meanwhile" in miss
    # A quiet launch of the same call has every rank within tolerance in its table's epoch: no line.
    quiet = RESULTS / "h100x2_resnet50_loader_skew_474_38_120_step_epochs"
    q_profile, q_plan = _inputs(quiet)
    assert not [x for x in log_findings(read_run_log(f"{quiet}_run.jsonl"), q_plan, q_profile, None)
                if x.startswith("Prediction miss")]


STALL_SKEW = RESULTS / "h100x2_resnet50_compute_skew_stall_390_122"
EXTRA_PASS_SKEW = RESULTS / "h100x2_resnet50_compute_skew_426_86"


def test_a_rank_over_5_percent_in_the_tables_epoch_gets_a_line_with_its_cause() -> None:
    """A compute-skew launch (2x H100, stall emulation): no split missed by 15%, but rank 0 ran +12.8% in the table's
    epoch; the line names its workers 13% behind the plan first and its compute's long steps beside, with the host's
    busy share.  A compute-skew launch emulated by extra passes: rank 0 on its curve in most steps, a tail of long ones on a host 62%
    busy -- not the loader workers' doing, and the line says so."""
    profile, plan = _inputs(STALL_SKEW)
    found = log_findings(read_run_log(f"{STALL_SKEW}_run.jsonl"), plan, profile, None)
    assert not [x for x in found if x.startswith("Prediction miss")]
    (note,) = [x for x in found if x.startswith("Rank ")]
    assert note.startswith("Rank 0 was busy 107.8 ms a step in epoch 3 (the run log's per-rank table) against 95.6 ms "
                           "predicted (+12.8%; a miss is over 15%); likely cause: rank 0's workers built a batch every "
                           "101.7 ms against 90.0 ms in the plan (+13%)")
    assert "beyond that its compute, 97.6 ms in most steps, averages 106.8 ms: some steps run far longer" in note
    assert "its host's cores 94% busy" in note

    profile, plan = _inputs(EXTRA_PASS_SKEW)
    (note,) = [x for x in log_findings(read_run_log(f"{EXTRA_PASS_SKEW}_run.jsonl"), plan, profile, None) if x.startswith("Rank ")]
    assert "rank 0's compute is on its curve in most steps (median 104.6 ms against 104.6 ms predicted" in note
    # loader-fed with a DDP peer: the only setting where such tails were measured on 2x H100
    assert "averages 110.3 ms" in note and "(its host's cores 62% busy) -- on 2x H100 such long steps came only with " \
        "DataLoaders and DDP peers together" in note


def test_the_compute_tail_names_what_was_measured_not_the_busy_host() -> None:
    """Rank 0's long steps are not the busy host's: probes (30 CPU burners, a 23-worker
    DataLoader beside one GPU, DDP on device batches) left the compute span flat, so the line names what was
    measured: tails only with DataLoaders and DDP peers together, and the suspect, not a remedy."""
    from reports.measured import compute_tail_cause

    line = compute_tail_cause(0, 0.0952, 0.0975, 0.1044, 0.0015, 0.94, loader_and_peers=True)
    assert line.startswith("rank 0's compute is on its curve in most steps (median 97.5 ms against 95.2 ms predicted "
                           "for the rank) but averages 104.4 ms")
    assert "(its host's cores 94% busy) -- on 2x H100 such long steps came only with DataLoaders and DDP peers" in line
    assert "not from a busy CPU or the loader alone" in line and "lead" in line
    # step leads: steps started ahead of a data-late peer, the wait in DDP's buffer broadcast
    assert "waiting for it in DDP's buffer broadcast" in line and "peers' data waits" in line
    assert "waits for a core" not in line and "--max-workers-per-rank" not in line
    alone = compute_tail_cause(0, 0.0952, 0.0975, 0.1044, 0.0015, None, loader_and_peers=False)
    assert "something else stalls it" in alone and "busy" not in alone
