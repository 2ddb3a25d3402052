"""benchmarks/comm_breakdown.py on CPU/gloo with a tiny model: the record's shape and the timeline's order, a
co-tenant started and stopped by the script, and its --overhead mode (the runtime's per-step cost) running."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from tests.reliability import _torchrun

SCRIPT = str(_torchrun.REPO / "benchmarks" / "comm_breakdown.py")


def _cotenants_left(duty: str) -> list[int]:
    left = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "cotenant.py" in cmd and f"--duty {duty}" in cmd:
            left.append(p.pid)
    return left


@pytest.mark.subprocess
def test_comm_breakdown_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "cb.jsonl"
    rc, stdout, err, _ = _torchrun.run(
        [SCRIPT, "--device", "cpu", "--model", "mlp", "--variants", "equal,plan+bf16:static", "--split", "20,12",
         "--steps", "3", "--rounds", "2", "--warmup", "2", "--cotenant", "cpu:1", "--cotenant-duty", "0.21",
         "--json", str(out)], timeout_s=120)
    assert rc == 0, err[-3000:]
    lines = out.read_text().splitlines()
    assert len(lines) == 1  # one compact record per launch
    rec = json.loads(lines[0])
    assert rec["record"] == "comm_breakdown" and rec["world_size"] == 2 and rec["backend"] == "gloo"
    assert rec["cotenant"] == {"processes": {"cpu": 1}, "duty": 0.21}
    assert not _cotenants_left("0.21")  # the script stopped what it started
    equal, plan = rec["variants"]["equal"], rec["variants"]["plan+bf16:static"]
    assert equal["batch_sizes"] == [16, 16] and plan["batch_sizes"] == [20, 12]
    assert plan["compress"] == "bf16" and plan["ddp"]["static_graph"] is True and rec["global_batch"] == 32
    for v in (equal, plan):
        assert len(v["rounds_samples_per_s"]) == 2 and v["samples_per_s"] > 0
        assert len(v["ranks"]) == 2
        for m in v["ranks"]:
            assert m["buckets"] and m["exposed_ms"] >= 0 and m["comm_busy_ms"] >= 0
            for b in m["buckets"]:
                assert b["ready_ms"] <= b["start_ms"] <= b["end_ms"]
    # bf16 on the wire: half of fp32's bytes
    assert plan["ranks"][0]["buckets"][0]["mb"] == pytest.approx(equal["ranks"][0]["buckets"][0]["mb"] / 2, rel=0.01)
    assert "exposed comm" in stdout


@pytest.mark.subprocess
@pytest.mark.slow
def test_comm_breakdown_overhead_mode_runs_on_cpu() -> None:
    rc, stdout, err, _ = _torchrun.run(
        [SCRIPT, "--overhead", "--device", "cpu", "--model", "mlp", "--image-size", "28", "--batch", "8",
         "--steps", "2", "--rounds", "1"], timeout_s=120)
    assert rc == 0, err[-3000:]
    assert "of plain DDP throughput" in stdout and "loss_scale+gradtimer" in stdout
