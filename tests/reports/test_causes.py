"""Why a rank is slow: findings from device states in the profile and the run log (reports.causes)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

import planner
from planner.cli import main
from planner.devstate import CpuProcess, DeviceState, GpuProcess
from planner.profile import ComputePoint, HostProfile, Profile, RankProfile
from planner.runlog import EpochRecord, ReplanRecord, RunLog
from planner.stats import StepStats
from reports.analysis import analyze, options_for
from reports.causes import NOT_VISIBLE, Causes, find_causes, state_table
from reports.evidence import cores_text

H100 = "NVIDIA H100 80GB HBM3"
GIB = 2**30
CLEAN = DeviceState(other_processes=(), sm_clock_mhz=1980, sm_clock_max_mhz=1980, throttle_reasons=("gpu_idle",),
                    power_w=650.0, power_limit_w=700.0, temperature_c=60.0)
COTENANT = replace(CLEAN, other_processes=(GpuProcess(pid=4242, used_bytes=int(12.1 * GIB), name="python"),),
                   throttle_reasons=())


def rank(i: int, sec_per_sample: float, state: DeviceState | None, *, name: str | None = H100, device: str = "cuda",
         meta: dict | None = None, host: str = "node0") -> RankProfile:
    return RankProfile(rank=i, host=host, device=f"{device}:{i}" if device == "cuda" else device, device_name=name,
                       compute=(ComputePoint(batch_size=32, step_time_s=32 * sec_per_sample),
                                ComputePoint(batch_size=256, step_time_s=256 * sec_per_sample)),
                       device_state=state, meta=meta or {})


def profile(*ranks: RankProfile) -> Profile:
    hosts = sorted({r.host for r in ranks})
    return Profile(hosts=tuple(HostProfile(name=h, cpu_cores=32) for h in hosts), ranks=ranks)


def causes(prof: Profile, global_batch: int = 512, log: RunLog | None = None) -> Causes:
    base = planner.solve(prof, global_batch=global_batch)
    return find_causes(prof, global_batch=global_batch, base_samples_per_s=base.predicted.samples_per_s,
                       opts=base.options, log=log)


def test_a_rank_with_a_co_tenant_is_named_with_its_process_and_memory() -> None:
    c = causes(profile(rank(0, 0.0005, CLEAN), rank(1, 0.001, COTENANT)))
    (slow,) = c.slow_ranks
    assert slow.rank == 1 and slow.reference == "rank 0" and slow.visible
    assert slow.slower_frac == pytest.approx(0.5)
    assert [e.kind for e in slow.evidence if e.explains] == ["co-tenant"]
    assert slow.text.startswith(f"Rank 1 ({H100}) measured 1,000 samples/s, 50% below its twin rank 0 (2,000): "
                                "1 other process on the GPU holding 12.1 GiB (pid 4242 python 12.1 GiB); "
                                "no throttling; SM clock at max 1980 of 1980 MHz.")
    # What-if: rank 1 on rank 0's curve = two identical ranks = 2 x 2000 samples/s.
    assert slow.what_if is not None and slow.what_if.label == "rank 1 without its co-tenant (rank 0's curve)"
    assert slow.what_if.samples_per_s == pytest.approx(4000, rel=1e-6)
    base = planner.solve(profile(rank(0, 0.0005, CLEAN), rank(1, 0.001, COTENANT)), global_batch=512)
    assert slow.what_if.delta_frac == pytest.approx(4000 / base.predicted.samples_per_s - 1, rel=1e-6)


def test_nothing_measured_differs_says_so_honestly() -> None:
    c = causes(profile(rank(0, 0.0005, CLEAN), rank(1, 0.001, CLEAN)))
    (slow,) = c.slow_ranks
    assert not slow.visible and slow.evidence == ()
    assert f"{NOT_VISIBLE} (no other process on the GPU; no throttling; SM clock at max 1980 of 1980 MHz)" in slow.text
    assert "at its twin's speed" in (slow.what_if.label if slow.what_if else "")


def test_a_profile_without_device_state_is_not_guessed_about() -> None:
    (slow,) = causes(profile(rank(0, 0.0005, None), rank(1, 0.001, None))).slow_ranks
    assert not slow.visible and f"{NOT_VISIBLE} (no device state was recorded for it in the profile)" in slow.text
    assert state_table(causes(profile(rank(0, 0.0005, None), rank(1, 0.001, None))).states) == ([], [])


def test_what_the_twin_shares_is_context_not_the_cause() -> None:
    both = causes(profile(rank(0, 0.0005, COTENANT), rank(1, 0.001, COTENANT)))
    (slow,) = both.slow_ranks
    assert not slow.visible and NOT_VISIBLE in slow.text and "(rank 0 too)" in slow.text


def test_throttling_and_a_low_clock_are_causes_with_their_numbers() -> None:
    hot = replace(CLEAN, sm_clock_mhz=1290, throttle_reasons=("gpu_idle", "sw_thermal", "hw_slowdown"),
                  temperature_c=91.0)
    (slow,) = causes(profile(rank(0, 0.0005, CLEAN), rank(1, 0.0008, hot))).slow_ranks
    explains = {e.kind: e.text for e in slow.evidence if e.explains}
    assert explains == {"throttle": "clocks throttled: sw_thermal, hw_slowdown",
                        "sm-clock": "SM clock 1290 MHz vs 1980 on rank 0 (max 1980)",
                        "thermal": "temperature 91 C vs 60 C on rank 0"}
    assert slow.what_if is not None and "without throttling" in slow.what_if.label


@pytest.mark.parametrize(("changes", "kind", "text"), [
    ({"power_limit_w": 400.0}, "power-limit", "power limit 400 W vs 700 W on rank 0"),
    ({"pcie_gen": 3, "pcie_width": 8, "pcie_gen_max": 5, "pcie_width_max": 16}, "pcie", "PCIe link gen3 x8 of gen5 x16"),
    ({"mig_mode": True}, "mig", "MIG mode on: the rank runs on a slice of the GPU"),
    ({"gpu_numa_node": 1, "numa_nodes": (0,)}, "numa", "its GPU is on NUMA node 1, the process on node(s) 0"),
    ({"load_avg_1m": 70.0, "host_cpus": 64}, "host-load", "host load average 70.0 on 64 CPUs"),
    ({"cpu_steal_cores": 0.36}, "steal", "the hypervisor took 0.36 core(s) from its cores (steal): a busy VM host, "
                                         "which slows the loader's workers first"),
])
def test_each_device_and_host_fact_can_be_the_cause(changes: dict, kind: str, text: str) -> None:
    (slow,) = causes(profile(rank(0, 0.0005, CLEAN), rank(1, 0.001, replace(CLEAN, **changes)))).slow_ranks
    assert [(e.kind, e.text) for e in slow.evidence if e.explains] == [(kind, text)] and slow.visible


def test_ranks_within_15_percent_or_of_other_kinds_get_no_finding() -> None:
    assert causes(profile(rank(0, 0.0010, CLEAN), rank(1, 0.00115, COTENANT))).slow_ranks == ()
    a100 = rank(1, 0.002, COTENANT, name="NVIDIA A100-SXM4-40GB")
    assert causes(profile(rank(0, 0.001, CLEAN), a100)).slow_ranks == ()  # a slower kind is no mystery
    assert causes(profile(rank(0, 0.001, CLEAN, name=None), rank(1, 0.002, COTENANT, name=None))).slow_ranks == ()


def test_four_h100s_two_with_co_tenants() -> None:
    # A recorded profile: 1891, 1891, 834 and 548 samples/s on four identical cards.
    two = replace(COTENANT, other_processes=(GpuProcess(pid=7, used_bytes=8 * GIB), GpuProcess(pid=8, used_bytes=4 * GIB)))
    prof = profile(rank(0, 1 / 1891, CLEAN), rank(1, 1 / 1891, CLEAN), rank(2, 1 / 834, COTENANT), rank(3, 1 / 548, two))
    c = causes(prof, global_batch=1024)
    assert [s.rank for s in c.slow_ranks] == [2, 3] and all(s.visible for s in c.slow_ranks)
    assert "2 other processes on the GPU holding 12.0 GiB (pid 7 8.0 GiB; pid 8 4.0 GiB)" in c.slow_ranks[1].text
    assert "rank 3 without its co-tenant" in c.slow_ranks[1].text


def test_cpu_ranks_name_other_load_and_shared_cores() -> None:
    hog = CpuProcess(pid=999, cpu_cores=0.93, name="python")
    r0 = DeviceState(cpu_affinity=(0,), cpu_other_cores=0.05, cpu_other_processes=(), cpu_busy_frac=1.0,
                     load_avg_1m=2.0, host_cpus=2)
    r1 = replace(r0, cpu_affinity=(1,), cpu_other_cores=0.95, cpu_other_processes=(hog,))
    prof = profile(rank(0, 0.001, r0, name="CPU x86_64", device="cpu"), rank(1, 0.002, r1, name="CPU x86_64",
                                                                               device="cpu"))
    (slow,) = causes(prof).slow_ranks
    assert [e.kind for e in slow.evidence if e.explains] == ["cpu-load"]
    assert ("other processes used 0.95 of its 1 core(s) (cores 1: pid 999 python 0.93); its cores were 100% busy"
            in slow.text)
    assert "rank 1 without the other CPU load" in slow.text
    # CPU ranks pinned to overlapping cores compete: rank 1 shares with both neighbours, its twin with one.
    shared = profile(rank(0, 0.001, replace(r0, cpu_affinity=(0, 1)), name="CPU", device="cpu"),
                     rank(1, 0.002, replace(r0, cpu_affinity=(1, 2)), name="CPU", device="cpu"),
                     rank(2, 0.001, replace(r0, cpu_affinity=(2, 3)), name="CPU", device="cpu"))
    (slow,) = causes(shared, global_batch=96).slow_ranks
    assert "its cores overlap those of rank 0 (cores 1), rank 2 (cores 2)" in slow.text and slow.visible


def test_an_emulated_slowdown_is_its_own_cause_even_without_state() -> None:
    c = causes(profile(rank(0, 0.001, None), rank(1, 0.003, None, meta={"emulate_slowdown": 3.0})))
    (slow,) = c.slow_ranks
    assert slow.visible and "an emulated slowdown of 3x (--emulate-slowdown)" in slow.text


def test_state_table_keeps_the_columns_some_rank_has() -> None:
    headers, rows = state_table((CLEAN, COTENANT, None))
    assert headers == ["rank", "other GPU procs", "SM MHz", "throttle", "power W", "temp C"]
    assert rows[1] == ["1", "1 (12.1 GiB)", "1980/1980", "none", "650/700", "60"] and rows[2][1:] == ["-"] * 5
    assert cores_text((0, 1, 2, 3, 8, 10, 11)) == "0-3,8,10-11"
    headers, rows = state_table((replace(CLEAN, cpu_steal_cores=0.36), CLEAN))
    assert headers[-1] == "steal" and [r[-1] for r in rows] == ["0.36", "-"]


# -- the run log ------------------------------------------------------------------------------------------------
def _epoch(e: int, batches: tuple[int, ...], compute_s: tuple[float, ...], states: tuple[DeviceState, ...]) -> EpochRecord:
    stats = tuple(StepStats(rank=i, epoch=e, num_steps=50, batch_size=b, num_workers=2, data_wait_s=0.0,
                            compute_s=c, step_time_s=max(compute_s)) for i, (b, c) in enumerate(zip(batches, compute_s)))
    return EpochRecord(epoch=e, plan_fingerprint="f", samples_per_s=1.0, step_time_s=max(compute_s), loss=1.0,
                       batch_sizes=batches, predicted_step_time_s=(0.256, 0.256), ranks=stats, device_state=states)


def midrun_log() -> RunLog:
    """Two identical ranks (1 ms/sample); a co-tenant arrives on rank 1 in epoch 2 and doubles its compute; the
    re-planner moves 256/256 -> 341/171 after epoch 2, and epoch 3 runs balanced again."""
    late = replace(CLEAN, other_processes=(GpuProcess(pid=5151, used_bytes=3 * GIB, name="train_other.py"),),
                   throttle_reasons=())
    epochs = (
        _epoch(0, (256, 256), (0.30, 0.30), (CLEAN, CLEAN)),  # warm-up: slower than the curve on both
        _epoch(1, (256, 256), (0.256, 0.257), (CLEAN, CLEAN)),
        _epoch(2, (256, 256), (0.256, 0.512), (CLEAN, late)),
        _epoch(3, (341, 171), (0.341, 0.342), (CLEAN, late)),
    )
    replans = (ReplanRecord(epoch=2, adopted=True, reason="rank 1 slowed", predicted_gain=0.33,
                            old_batch_sizes=(256, 256), new_batch_sizes=(341, 171)),)
    return RunLog(world_size=2, global_batch=512, start_plan=None, epochs=epochs, replans=replans, ended=True)


def test_a_mid_run_slowdown_the_replanner_absorbed_is_attributed_from_the_log() -> None:
    prof = profile(rank(0, 0.001, CLEAN), rank(1, 0.001, CLEAN))
    c = causes(prof, log=midrun_log())
    (slow,) = c.slow_ranks
    assert slow.source == "run log" and slow.rank == 1 and slow.epoch == 2 and slow.reference == "epoch 1"
    assert slow.slower_frac == pytest.approx(1 - 0.257 / 0.512, abs=1e-3)
    assert slow.visible and [e.kind for e in slow.evidence if e.explains] == ["co-tenant"]
    assert "slowed 1.99x in epoch 2 against epoch 1" in slow.text
    assert "the re-planner moved its batch 256 -> 171 after epoch 2" in slow.text
    assert "1 other process on the GPU holding 3.0 GiB (pid 5151 train_other.py 3.0 GiB)" in slow.text


def test_a_log_without_device_state_says_the_cause_is_not_visible() -> None:
    log = midrun_log()
    bare = replace(log, epochs=tuple(replace(e, device_state=()) for e in log.epochs), replans=())
    (slow,) = causes(profile(rank(0, 0.001, CLEAN), rank(1, 0.001, CLEAN)), log=bare).slow_ranks
    assert "no re-plan absorbed it" in slow.text and f"{NOT_VISIBLE} (no device state was recorded in the run log)" \
        in slow.text


# -- through the report: terminal, HTML and JSON -----------------------------------------------------------------
@pytest.mark.slow
def test_planner_report_prints_and_renders_the_co_tenant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = profile(rank(0, 0.0005, CLEAN), rank(1, 0.001, COTENANT))
    prof.save(tmp_path / "p.json")
    out, js = tmp_path / "r.html", tmp_path / "r.json"
    assert main(["report", "--profile", str(tmp_path / "p.json"), "--global-batch", "512", "--out", str(out),
                 "--json", str(js)]) == 0
    printed = capsys.readouterr().out
    findings = printed.split("\n\n")[0]
    assert "Rank 1 (NVIDIA H100 80GB HBM3) measured 1,000 samples/s, 50% below its twin rank 0" in findings
    assert "1 other process on the GPU holding 12.1 GiB (pid 4242 python 12.1 GiB)" in findings
    assert "Device and host state while profiled" in printed and "1 (12.1 GiB)" in printed
    page = out.read_text()
    assert '<h2 id="causes">Why ranks are slow</h2>' in page
    assert "<li>1 other process on the GPU holding 12.1 GiB (pid 4242 python 12.1 GiB)</li>" in page
    assert page.count("pid 4242") == 2  # the findings list and the evidence section
    rep = json.loads(js.read_text())
    assert rep["causes"]["slow_ranks"][0]["rank"] == 1 and rep["causes"]["slow_ranks"][0]["visible"] is True


def test_the_report_of_a_balanced_profile_has_no_cause_section() -> None:
    prof = profile(rank(0, 0.001, None), rank(1, 0.001, None))
    plan = planner.solve(prof, global_batch=512)
    rep = analyze(prof, plan, options_for(plan))
    assert rep.causes is not None and rep.causes.slow_ranks == ()
    from reports.html import render_html

    assert 'id="causes"' not in render_html(rep, {})


def test_steal_both_ranks_share_is_context_and_a_quiet_reading_is_said() -> None:
    from reports.evidence import checked, compare

    busy_host = replace(CLEAN, cpu_steal_cores=0.36)
    shared = compare(busy_host, replace(CLEAN, cpu_steal_cores=0.30), ref_name="rank 0", is_cpu=False)
    assert [(e.kind, e.explains) for e in shared] == [("steal", False)] and "vs 0.30 on rank 0" in shared[0].text
    assert checked(replace(CLEAN, cpu_steal_cores=0.02), set())[-1] == "steal 0.02 core(s)"
