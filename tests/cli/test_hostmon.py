"""benchmarks/hostmon.py: the host monitor beside the loader-fed GPU runs.

On a recorded monitor file (tests/data/h100x2_hostmon_beside_loader_skew_bench.jsonl, 2x H100 VM): the idle host's probe -- fixed
single-thread work -- took 9.6-16.6 ms from second to second with CPU time equal to wall time, and the bench's plan
windows line up with the samples inside them.  And a real monitor run here: it samples until SIGTERM and the summary
reads it back.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from tests._scripts import benchmark

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "tests" / "data"


def _module() -> ModuleType:
    return benchmark("hostmon")


def test_an_idle_host_probe_is_steady_and_the_bench_windows_line_up() -> None:
    hm = _module()
    path = RESULTS / "h100x2_hostmon_beside_loader_skew_bench.jsonl"
    rows = hm.summarize(path, 1.0, RESULTS / "h100x2_hostmon_beside_loader_skew_bench_marks.txt")
    idle = [r for r in rows if r["label"] == "idle"]
    assert len(idle) >= 15 and all(r["busy_cores"] < 1 for r in idle)
    assert min(r["pil_ms"] for r in idle) < 10.0 and max(r["pil_ms"] for r in idle) > 16.0
    samples = [json.loads(x) for x in path.read_text().splitlines()[1:]]
    assert all(abs(s["probe"]["pil"][1] / s["probe"]["pil"][0] - 1) < 0.05 for s in samples[:15])  # not preempted
    bench = RESULTS / "h100x2_resnet50_loader_skew_bench_16_2_workers.json"
    plan = [w for w in hm.bench_windows(path, bench) if w["strategy"] == "plan"]
    assert [round(w["step_ms"]) for w in plan] == [134, 183, 179] and all(w["host_samples"] >= 3 for w in plan)
    assert all(w["busy_frac"] > 0.5 for w in plan)  # ~20 of 32 cores: the 16-worker loader at full tilt


@pytest.mark.subprocess
def test_monitor_samples_until_sigterm(tmp_path: Path) -> None:
    out = tmp_path / "host.jsonl"
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "hostmon.py"), "--out", str(out),
                             "--interval", "0.2"])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 4):
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=10) == 0
        finally:
            proc.kill()
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["facts"] and lines[0]["cpu_count"] >= 1 and "dev_shm" in lines[0]
    assert len(lines) >= 4 and all(len(s["cpu"]) == 8 and s["dt"] > 0 and "pil" in s["probe"] for s in lines[1:])
    rows = _module().summarize(out, 10.0, None)
    assert rows and rows[0]["pil_ms"] > 0
