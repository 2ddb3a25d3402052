"""Device-state sampling with an injected fake NVML, and its JSON form in the profile and the run log."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import jsonschema
import pytest
from referencing import Registry, Resource

from planner.devstate import CpuProcess, DeviceState, GpuProcess
from planner.errors import ValidationError
from planner.profile import Profile
from planner.runlog import EpochRecord, RunLogWriter, read_run_log
from planner.stats import StepStats
from profiler import nvml
from profiler.devstate import DeviceStateSampler, GpuSample, other_gpu_processes, own_pid_by_memory
from tests.planner._profiles import linear_profile
from tests.profiler.fakes import FakeNvml, unsupported_everywhere

SCHEMAS = Path(__file__).resolve().parents[2] / "planner" / "schemas"
GIB = 2**30
ME = os.getpid()


def _sampler(fake: FakeNvml, *, own_bytes: int | None = GIB) -> DeviceStateSampler:
    return DeviceStateSampler(None, nvml=fake, own_gpu_bytes=lambda: own_bytes, track_processes=False)


def test_throttle_bits_decode_to_names() -> None:
    assert nvml.throttle_names(0) == ()
    assert nvml.throttle_names(0x1 | 0x4 | 0x20) == ("gpu_idle", "sw_power_cap", "sw_thermal")
    assert nvml.throttle_names(0x8 | 0x1000) == ("hw_slowdown", "0x1000")  # an unknown bit is kept, in hex


def test_other_processes_exclude_this_rank_and_keep_the_most_memory_seen() -> None:
    fake = FakeNvml(processes=[[(ME, 2 * GIB)], [(ME, 2 * GIB), (4242, 8 * GIB)], [(ME, 2 * GIB), (4242, 12 * GIB)]])
    s = _sampler(fake)
    for _ in range(3):
        s.sample()
    state = s.collect()
    assert state.other_processes == (GpuProcess(pid=4242, used_bytes=12 * GIB, name=state.other_processes[0].name),)
    assert state.other_gpu_bytes == 12 * GIB and state.own_pid_by_memory is None and state.num_samples == 3


def test_alone_on_the_gpu_is_a_measured_empty_list() -> None:
    state = _sampler(FakeNvml(processes=[[(ME, GIB)]])).collect()  # collect takes one sample when none was taken
    assert state.other_processes == () and state.num_samples == 1
    assert state.to_dict()["other_processes"] == []


def test_in_a_container_our_entry_is_told_apart_by_its_memory() -> None:
    # NVML lists host pids: ours is not there; the entry closest to what this rank holds (3 GiB) is ours.
    fake = FakeNvml(processes=[[(91001, int(3.2 * GIB)), (91002, 12 * GIB)]])
    state = _sampler(fake, own_bytes=3 * GIB).collect()
    assert [p.pid for p in state.other_processes or ()] == [91002] and state.own_pid_by_memory is True
    assert state.other_processes[0].name is None  # a host pid names nothing in this namespace
    # Before this rank holds a CUDA context, every listed process is another one.
    assert len(_sampler(FakeNvml(processes=[[(91001, GIB)]]), own_bytes=None).collect().other_processes or ()) == 1


def test_the_own_process_vote_survives_an_emptied_allocator() -> None:
    # Three samples while this rank held ~30 GiB, then one after an out-of-memory probe emptied its cache: that
    # last comparison alone would pick the 4.5 GiB co-tenant as ours.
    ours, tenant = 91001, 91002
    samples = [GpuSample(processes=((ours, 31 * GIB), (tenant, int(4.5 * GIB))), own_bytes=30 * GIB)] * 3 + \
        [GpuSample(processes=((ours, 31 * GIB), (tenant, int(4.5 * GIB))), own_bytes=0)]
    assert own_pid_by_memory(samples) == ours
    assert own_pid_by_memory([GpuSample(processes=((ours, GIB),), own_bytes=None)]) is None  # no context: no vote


def test_peer_ranks_on_the_gpu_are_named_as_such() -> None:
    procs, by_memory = other_gpu_processes({ME: GIB, 77: GIB, 78: None}, own_pid=ME, own_guess=None, job={ME, 77},
                                           names=lambda pid: "python")
    assert not by_memory
    assert procs == (GpuProcess(pid=77, used_bytes=GIB, name="python (a peer rank of this job)"),
                     GpuProcess(pid=78, used_bytes=None, name="python"))


def test_clocks_are_medians_temperature_the_max_and_throttle_reasons_the_union() -> None:
    fake = FakeNvml(sm_clocks=[1980, 1410, 1410, 1980, 1410], throttle_masks=[0x1, 0x20, 0x0, 0x4, 0x0],
                    temperatures_c=[70, 88, 75, 71, 72], powers_w=[600, 700, 650, 640, 660])
    s = _sampler(fake)
    for _ in range(5):
        s.sample()
    state = s.collect()
    assert state.sm_clock_mhz == 1410 and state.sm_clock_max_mhz == 1980
    assert state.temperature_c == 88 and state.power_w == 650 and state.power_limit_w == 700
    assert state.throttle_reasons == ("gpu_idle", "sw_power_cap", "sw_thermal")
    assert state.slowing_throttle_reasons == ("sw_power_cap", "sw_thermal")  # idle between steps is no slowdown
    assert (state.pcie_gen, state.pcie_width, state.pcie_gen_max, state.pcie_width_max) == (5, 16, 5, 16)
    assert state.mig_mode is False and state.compute_mode == "default"


def test_collect_starts_a_new_window() -> None:
    fake = FakeNvml(processes=[[(ME, GIB), (4242, GIB)], [(ME, GIB)]])
    s = _sampler(fake)
    s.sample()
    assert len(s.collect().other_processes or ()) == 1
    s.sample()
    assert s.collect().other_processes == ()  # the co-tenant left: the next window does not remember it


def test_fields_the_card_does_not_answer_are_absent_not_zero() -> None:
    s = _sampler(unsupported_everywhere())
    s.sample()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning spam either
        state = s.collect()
    gpu = {k: v for k, v in state.to_dict().items() if k not in ("window_s", "num_samples")}
    host_only = set(DeviceState.__slots__) - {"other_processes", "own_pid_by_memory", "sm_clock_mhz",  # type: ignore[attr-defined]
                                                "sm_clock_max_mhz", "mem_clock_mhz", "mem_clock_max_mhz",
                                                "throttle_reasons", "power_w", "power_limit_w", "temperature_c",
                                                "pcie_gen", "pcie_gen_max", "pcie_width", "pcie_width_max",
                                                "mig_mode", "compute_mode", "gpu_numa_node"}
    assert set(gpu) <= host_only


def test_gpu_numa_node_comes_from_sysfs(tmp_path: Path) -> None:
    from profiler import hoststate

    dev = tmp_path / "0000:17:00.0"
    dev.mkdir()
    (dev / "numa_node").write_text("1\n")
    assert hoststate.pci_numa_node("00000000:17:00.0", sys_root=str(tmp_path)) == 1
    (dev / "numa_node").write_text("-1\n")  # a single-node machine
    assert hoststate.pci_numa_node("00000000:17:00.0", sys_root=str(tmp_path)) is None
    assert hoststate.pci_numa_node("00000000:99:00.0", sys_root=str(tmp_path)) is None


def test_a_cpu_rank_without_nvml_samples_the_host_silently() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = DeviceStateSampler("cpu")
        state = s.collect()
        s.close()
    assert state.other_processes is None and state.sm_clock_mhz is None and state.num_samples is None
    if hasattr(os, "sched_getaffinity"):
        assert state.cpu_affinity == tuple(sorted(os.sched_getaffinity(0))) and state.host_cpus == os.cpu_count()


def test_nvml_is_absent_here_without_a_word(capsys: pytest.CaptureFixture[str]) -> None:
    assert nvml.open_torch_device("cpu") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dev = nvml.open_device(0)
    if dev is not None:  # a machine with a GPU and a driver
        dev.close()
    assert capsys.readouterr() == ("", "")


def test_sampler_closes_its_nvml() -> None:
    fake = FakeNvml()
    s = _sampler(fake)
    s.close()
    assert fake.closed


# -- the JSON form ----------------------------------------------------------------------------------------------
FULL = DeviceState(window_s=12.5, num_samples=9, other_processes=(GpuProcess(pid=4242, used_bytes=13 * GIB,
                                                                               name="python"),),
                   sm_clock_mhz=1410, sm_clock_max_mhz=1980, mem_clock_mhz=2619, mem_clock_max_mhz=2619,
                   throttle_reasons=("sw_thermal",), power_w=690.0, power_limit_w=700.0, temperature_c=88.0,
                   pcie_gen=4, pcie_gen_max=5, pcie_width=16, pcie_width_max=16, mig_mode=False, mps=False,
                   compute_mode="default", gpu_numa_node=1, cpu_affinity=(0, 1, 2, 3), numa_nodes=(0,), host_cpus=64,
                   load_avg_1m=3.5, mem_available_bytes=100 * GIB, mem_total_bytes=512 * GIB, cpu_busy_frac=0.4,
                   cpu_other_cores=1.2, cpu_steal_cores=0.3, cpu_other_processes=(CpuProcess(pid=99, cpu_cores=1.0, name="gzip"),))


def _validator(name: str) -> jsonschema.protocols.Validator:
    schemas = {n: json.loads((SCHEMAS / f"{n}.schema.json").read_text()) for n in ("runlog", "plan", "profile")}
    registry: Registry = Registry().with_resources((s["$id"], Resource.from_contents(s)) for s in schemas.values())
    jsonschema.Draft202012Validator.check_schema(schemas[name])
    return jsonschema.Draft202012Validator(schemas[name], registry=registry)


def test_a_profile_with_device_state_round_trips_and_validates(tmp_path: Path) -> None:
    base = linear_profile([0.001, 0.002])
    ranks = (base.ranks[0], type(base.ranks[1])(**{**{k: getattr(base.ranks[1], k) for k in base.ranks[1].__slots__},
                                                   "device_state": FULL}))
    prof = Profile(hosts=base.hosts, ranks=ranks)
    prof.save(tmp_path / "p.json")
    back = Profile.load(tmp_path / "p.json")
    assert back.rank(1).device_state == FULL and back.rank(0).device_state is None
    _validator("profile").validate(json.loads((tmp_path / "p.json").read_text()))
    assert DeviceState.from_dict(DeviceState().to_dict()) == DeviceState()  # every field optional


def test_profiles_refuse_unknown_or_mistyped_state_fields_and_run_logs_skip_unknown_ones() -> None:
    with pytest.raises(ValidationError, match=r'device_state: unknown field "sm_clock"'):
        DeviceState.from_dict({"sm_clock": 1980})
    with pytest.raises(ValidationError, match=r"device_state.other_processes\[0\]: missing required field 'pid'"):
        DeviceState.from_dict({"other_processes": [{"used_bytes": 1}]})
    with pytest.raises(ValidationError, match=r"device_state.mig_mode: expected true or false"):
        DeviceState.from_dict({"mig_mode": 1})
    newer = {"sm_clock_mhz": 1980, "fan_pct": 40, "other_processes": [{"pid": 1, "container": "x"}]}
    assert DeviceState.from_dict(newer, strict=False) == DeviceState(sm_clock_mhz=1980,
                                                                      other_processes=(GpuProcess(pid=1),))
    with pytest.raises(jsonschema.ValidationError):
        _validator("profile").validate({"version": 1, "kind": "profile", "hosts": [{"name": "h", "cpu_cores": 1}],
                                        "ranks": [{"rank": 0, "host": "h", "device": "cpu", "device_state": {"x": 1},
                                                   "compute": [{"batch_size": 1, "step_time_s": 1.0}]}]})


def test_epoch_records_carry_each_ranks_state(tmp_path: Path) -> None:
    stats = tuple(StepStats(rank=i, epoch=0, num_steps=5, batch_size=8, num_workers=0, data_wait_s=0.0,
                            compute_s=0.01, step_time_s=0.012) for i in range(2))
    rec = EpochRecord(epoch=0, plan_fingerprint="f", samples_per_s=1.0, step_time_s=0.012, loss=1.0,
                      batch_sizes=(8, 8), predicted_step_time_s=(0.01, 0.01), ranks=stats,
                      device_state=(None, FULL))
    plain = EpochRecord(epoch=1, plan_fingerprint="f", samples_per_s=1.0, step_time_s=0.012, loss=1.0,
                        batch_sizes=(8, 8), predicted_step_time_s=(0.01, 0.01), ranks=stats)
    path = tmp_path / "run.jsonl"
    with RunLogWriter(path) as log:
        log.write(rec)
        log.write(plain)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    for line in lines:
        _validator("runlog").validate(line)
    assert "device_state" not in lines[1]  # nothing sampled, nothing written: old readers see old lines
    got = read_run_log(path)
    assert got.epochs[0].device_state == (None, FULL) and got.epochs[1].device_state == ()


def test_a_window_long_enough_for_the_cores_busy_share_also_gives_their_steal() -> None:
    import time

    from profiler import hoststate

    s = DeviceStateSampler("cpu")
    time.sleep(hoststate.MIN_WINDOW_S + 0.05)
    state = s.collect()
    s.close()
    if state.cpu_busy_frac is None:
        pytest.skip("no per-core times here (psutil or affinity missing)")
    assert state.cpu_steal_cores is not None and 0.0 <= state.cpu_steal_cores <= len(state.cpu_affinity or ())
    assert DeviceState.from_dict(state.to_dict()) == state  # and it survives the JSON round trip
