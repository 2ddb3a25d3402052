"""Host-side state: other processes' CPU on a rank's cores (pure arithmetic, then a real pinned hog)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from profiler import hoststate
from profiler.devstate import DeviceStateSampler
from profiler.hoststate import ProcSample, other_cpu_use


def _p(pid: int, cpu_s: float, aff: set[int] | None, created: float = 0.0, name: str = "x") -> ProcSample:
    return ProcSample(pid=pid, cpu_s=cpu_s, affinity=None if aff is None else frozenset(aff), create_time=created,
                      name=name)


def test_a_process_counts_by_the_share_of_its_cores_that_are_ours() -> None:
    before = {1: _p(1, 10.0, {1}), 2: _p(2, 10.0, {0, 1}), 3: _p(3, 10.0, {0}), 4: _p(4, 10.0, None)}
    after = {1: _p(1, 20.0, {1}), 2: _p(2, 20.0, {0, 1}), 3: _p(3, 20.0, {0}), 4: _p(4, 14.0, None)}
    total, top = other_cpu_use(before, after, {1}, window_s=10.0, window_start=100.0, host_cpus=2)
    # pinned to our core: all of it; unpinned over 2 cores: half; on another core: nothing; unknown affinity:
    # counted over every core of the host.
    assert [(p.pid, p.cpu_cores) for p in top] == [(1, 1.0), (2, 0.5), (4, 0.2)]
    assert total == pytest.approx(1.7)


def test_new_and_reused_pids_count_from_zero_and_unseen_old_ones_not_at_all() -> None:
    before = {7: _p(7, 50.0, {0}, created=1.0)}
    after = {
        7: _p(7, 3.0, {0}, created=105.0),   # pid 7 was reused inside the window: its 3 s are all new
        8: _p(8, 2.0, {0}, created=103.0),   # started inside the window
        9: _p(9, 99.0, {0}, created=50.0),   # existed before but was unreadable then: share unknown
    }
    total, top = other_cpu_use(before, after, {0}, window_s=10.0, window_start=100.0, host_cpus=4)
    assert {p.pid: p.cpu_cores for p in top} == {7: 0.3, 8: 0.2} and total == pytest.approx(0.5)


def test_tick_noise_cannot_exceed_the_cores_a_process_may_use() -> None:
    # 10 ms ticks over a 16 ms window read as 1.25 cores: capped at the one core it shares with us.
    total, top = other_cpu_use({1: _p(1, 0.0, {0, 1})}, {1: _p(1, 0.02, {0, 1})}, {0}, window_s=0.016,
                               window_start=0.0, host_cpus=2)
    assert top[0].cpu_cores <= 1.0 and total <= 1.0


def test_tiny_users_are_not_named() -> None:
    total, top = other_cpu_use({1: _p(1, 0.0, {0})}, {1: _p(1, 0.1, {0})}, {0}, window_s=10.0, window_start=0.0,
                               host_cpus=1)
    assert total == pytest.approx(0.01) and top == ()


def test_cpulists_and_numa_nodes(tmp_path: Path) -> None:
    assert hoststate.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert hoststate.parse_cpulist("") == set()
    for node, cpus in (("node0", "0-3"), ("node1", "4-7")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus + "\n")
    assert hoststate.numa_nodes_of([2, 5], sys_root=str(tmp_path)) == (0, 1)
    assert hoststate.numa_nodes_of([6], sys_root=str(tmp_path)) == (1,)
    assert hoststate.numa_nodes_of([6], sys_root=str(tmp_path / "none")) is None


def test_busy_fraction_of_our_cores() -> None:
    before = [(10.0, 100.0), (50.0, 100.0)]
    after = [(15.0, 110.0), (60.0, 110.0)]
    assert hoststate.busy_fraction(before, after, [1]) == pytest.approx(1.0)
    assert hoststate.busy_fraction(before, after, [0, 1]) == pytest.approx(0.75)
    assert hoststate.busy_fraction(None, after, [0]) is None


def test_steal_is_each_cores_stolen_share_of_its_time_summed() -> None:
    # core 0: 1 s of 2 stolen; core 1: none; core 2: 0.5 s of 2 -- a VM's hypervisor running another guest
    before = [(0.0, 0.0, 0.0), (0.0, 0.0, 0.0), (0.0, 0.0, 0.0)]
    after = [(2.0, 2.0, 1.0), (1.0, 2.0, 0.0), (1.5, 2.0, 0.5)]
    assert hoststate.steal_cores(before, after, [0, 1, 2]) == pytest.approx(0.75)
    assert hoststate.steal_cores(before, after, [1]) == 0.0
    assert hoststate.steal_cores(None, after, [0]) is None and hoststate.steal_cores(before, after[:2], [0]) is None


def test_this_hosts_own_counters_give_a_steal_reading() -> None:
    now = hoststate.per_core_times()
    if now is None:
        pytest.skip("psutil cannot read this host's per-core times")
    assert all(len(c) == 3 and c[2] >= 0 for c in now)
    stolen = hoststate.steal_cores(now, hoststate.per_core_times(), range(len(now)))
    assert stolen is not None and 0.0 <= stolen <= len(now)


@pytest.mark.subprocess
def test_the_job_is_this_process_and_under_torchrun_its_peers() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert {os.getpid(), child.pid} <= hoststate.job_pids({})
        alone = hoststate.job_pids({})
        assert os.getppid() not in alone
        assert os.getppid() in hoststate.job_pids({"TORCHELASTIC_RUN_ID": "x"})  # the agent and its children
    finally:
        child.kill()
        child.wait()


def start_detached_hog(core: int) -> int:
    """A busy loop pinned to ``core``, as another job would run it: not our descendant (this job's own processes
    are never "other"; a shell that exits at once re-parents it) and in a session of its own (with scheduler
    autogroups, CPU is shared fairly between sessions; a hog in the test's own session would take its share from
    every core the session uses, not from the one it is pinned to).  Returns its pid; stop it with SIGKILL."""
    code = f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"
    out = subprocess.run(["sh", "-c", f'setsid "{sys.executable}" -c "$0" >/dev/null 2>&1 & echo $!', code],
                         capture_output=True, text=True, timeout=30, check=True)
    return int(out.stdout.strip())


def stop(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores and sched_setaffinity")
@pytest.mark.alone
@pytest.mark.subprocess
def test_a_real_hog_pinned_to_our_core_is_named() -> None:
    core = max(os.sched_getaffinity(0))
    saved = os.sched_getaffinity(0)
    hog = start_detached_hog(core)
    try:
        os.sched_setaffinity(0, {core})  # this process: the "rank" on that core
        time.sleep(0.3)  # the hog is pinned and running before the window opens
        sampler = DeviceStateSampler("cpu")
        time.sleep(1.5)
        state = sampler.collect()
    finally:
        os.sched_setaffinity(0, saved)
        stop(hog)
    assert state.cpu_affinity == (core,) and state.window_s is not None and state.window_s >= 1.5
    named = {p.pid: p.cpu_cores for p in state.cpu_other_processes or ()}
    # Alone on its core while we sleep it takes most of it on an idle host; on a saturated shared one the
    # scheduler still gives its session a fair share (a quarter of the core at a load average of 10 on 2 cores).
    assert named.get(hog, 0.0) > 0.1, state
    assert (state.cpu_other_cores or 0.0) >= named[hog]
    assert state.cpu_busy_frac is not None and state.cpu_busy_frac > 0.3
