"""Acceptance on CPU: a real CPU hog on one rank's core during `planner profile` on 2 ranks with torchrun's
environment (tests/_ranks.py) is named by `planner report` as that rank's cause, with its pid and the CPU it took."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from planner.cli import main
from planner.profile import Profile
from tests._ranks import run_planner
from tests.profiler.test_hoststate import start_detached_hog, stop


def free_share(core: int, seconds: float = 0.5) -> float:
    """CPU share a busy loop pinned to ``core`` gets right now (1.0 on an idle core)."""
    saved = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {core})
        t0, c0 = time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds:
            pass
        return (time.process_time() - c0) / (time.perf_counter() - t0)
    finally:
        os.sched_setaffinity(0, saved)


@pytest.mark.distributed
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores and sched_setaffinity")
@pytest.mark.alone
def test_a_cpu_hog_on_one_ranks_core_is_the_reports_cause(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cores = sorted(os.sched_getaffinity(0))[:2]
    # The premise: rank 0's core is mostly free.  On a host saturated by unpinned work the scheduler's balancing
    # moves that work onto rank 0's core as soon as the hogs crowd rank 1's, and both ranks slow alike.
    share = free_share(cores[0])
    if share < 0.6:
        pytest.skip(f"host saturated by other work: a busy loop got {share:.0%} of core {cores[0]}")
    out = tmp_path / "p.json"
    # Two busy loops on rank 1's core (tests/profiler/_pinned.py binds rank r to cores[r]), each in a session of
    # its own like another job's, leave rank 1 a third of its core on an idle host.  On a host already saturated by
    # unpinned work the scheduler moves that work to rank 0's core, which narrows the gap.  The sweep stops at the
    # report's global batch: larger batches on the crowded rank (and the DDP steps there) would only cost time.
    hogs = [start_detached_hog(cores[1]) for _ in range(2)]
    try:
        rc, text = run_planner(
            2, ["profile", "--model", "tests.profiler._pinned:pinned_mlp", "--image-size", "28", "--device", "cpu",
                "--quick", "--budget-s", "3", "--max-batch", "64", "--no-loader", "--out", str(out)],
            env={"PLANNER_TEST_CORES": ",".join(map(str, cores))}, timeout_s=240)
    finally:
        for hog in hogs:
            stop(hog)
    assert rc == 0, text[-3000:]
    prof = Profile.load(out)
    s0, s1 = prof.rank(0).device_state, prof.rank(1).device_state
    assert s0 is not None and s1 is not None
    assert s0.cpu_affinity == (cores[0],) and s1.cpu_affinity == (cores[1],)
    on_1 = {p.pid: p.cpu_cores for p in s1.cpu_other_processes or ()}
    assert sum(on_1.get(h, 0.0) for h in hogs) > 0.3, s1  # they shared the core with rank 1 for the whole sweep
    assert not set(hogs) & {p.pid for p in s0.cpu_other_processes or ()}  # pinned elsewhere: not rank 0's load
    assert prof.rank(0).device_name == prof.rank(1).device_name  # twins, so a gap needs a cause

    html = tmp_path / "r.html"
    assert main(["report", "--profile", str(out), "--global-batch", "64", "--out", str(html)]) == 0
    findings = capsys.readouterr().out.split("\n\n")[0]
    line = next((x for x in findings.splitlines() if x.startswith("  - Rank 1 ")), "")
    if not line and (after := free_share(cores[0])) < 0.6:
        # Work that arrived during the run took rank 0's core as well (see the premise above).
        pytest.skip(f"host saturated by other work during the run: a busy loop now gets {after:.0%} of core "
                    f"{cores[0]}")
    assert "below its twin rank 0" in line, findings
    assert "other processes used" in line and any(f"pid {h} " in line for h in hogs), findings
    assert "rank 1 without the other CPU load" in line
    page = html.read_text()
    assert 'id="causes"' in page and any(f"pid {h} " in page for h in hogs)
