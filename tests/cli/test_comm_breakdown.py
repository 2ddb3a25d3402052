"""benchmarks/comm_breakdown.py on CPU/gloo with a tiny model: the record's shape and the timeline's order, a
co-tenant started and stopped by the script, and its --overhead mode (the runtime's per-step cost) running."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
import pytest

from tests import _ranks
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
    # torchrun's own behaviour is not the subject: the ranks come from the tests' fork server (tests/_ranks.py)
    rc, stdout, err, _ = _ranks.run(
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
    rc, stdout, err, _ = _ranks.run(
        [SCRIPT, "--overhead", "--device", "cpu", "--model", "mlp", "--image-size", "28", "--batch", "8",
         "--steps", "2", "--rounds", "1"], timeout_s=120)
    assert rc == 0, err[-3000:]
    assert "of plain DDP throughput" in stdout and "loss_scale+gradtimer" in stdout


def _module():  # type: ignore[no-untyped-def]
    import importlib.util

    spec = importlib.util.spec_from_file_location("comm_breakdown", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_choose_keeps_a_setting_only_past_the_spread(tmp_path: Path) -> None:
    """--choose's decision and the plan it writes, on made-up rounds (samples/s of a 256 global batch)."""
    from planner.cli.train_config import ddp_settings_from
    from planner.plan import Plan
    from tests.reliability.test_no_hangs import write_plan

    cb = _module()

    def variants(plan_c: list[float], equal_c: list[float]) -> list:  # type: ignore[type-arg]
        out = []
        for split, opts, rounds in (("plan", "", [5000, 5100, 5050]), ("equal", "", [4000, 4050, 4020]),
                                    ("plan", "cap100", plan_c), ("equal", "cap100", equal_c)):
            v = cb.Variant(name=split + (":" + opts if opts else ""), split=split, compress="none", ddp_kw={},
                           opts=opts)
            v.rounds_samples_per_s = rounds
            out.append(v)
        return out

    won = cb.choose(variants([5800, 5850, 5900], [4010, 4030, 4040]), ["cap100"], 256)
    assert won["winner"] == "cap100" and won["settings"] == {"bucket_cap_mb": 100.0}
    # inside the spread (5200 +- 10%): kept
    assert cb.choose(variants([4900, 5200, 5500], [4010, 4030, 4040]), ["cap100"], 256)["winner"] is None
    # faster at the plan's split but it costs the equal split 20%: kept
    assert cb.choose(variants([5800, 5850, 5900], [3300, 3350, 3320]), ["cap100"], 256)["winner"] is None
    one = [v for v in variants([9000], [9000])]
    for v in one:
        v.rounds_samples_per_s = v.rounds_samples_per_s[:1]
    assert cb.choose(one, ["cap100"], 256)["winner"] is None  # one round: no spread to beat

    src, dst = write_plan(tmp_path / "plan.json", [7, 5]), tmp_path / "plan_ddp.json"
    cb.write_plan(str(src), str(dst), {"ddp_choice": won, "devices": ["cpu", "cpu"], "nccl_env": {}})
    plan = Plan.load(dst)
    assert ddp_settings_from(plan.meta) == {"bucket_cap_mb": 100.0}
    assert plan.fingerprint == Plan.load(src).fingerprint  # meta is not part of it
