"""examples/ddp_stock.py and examples/ddp_planned.py: the planned twin is the stock script with docs/ADOPTING.md's
"Re-planning in your own loop" change applied (the documented diff, spelled for this script: its data set class,
its --batch-size default and its device), and both train on 2 gloo ranks with a tiny model, the planned one
writing a run log with an epoch record and a re-plan decision at every epoch end but the last."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import planner
from planner.runlog import read_run_log
from tests._ranks import run
from tests.runtime.test_accumulation_adopting import code_of, documented_diff
from tests.runtime.test_adopting import apply_diff

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
SPELLING = {"DistributedSampler, TensorDataset": "Dataset, DistributedSampler", '"cpu")': "device)"}
"""The documented diff's lines as this script spells them (the same change: only names differ)."""


def planned_from_stock() -> str:
    diff = documented_diff("Re-planning in your own loop")
    for old, new in SPELLING.items():
        diff = [line.replace(old, new) for line in diff]
    return apply_diff((EXAMPLES / "ddp_stock.py").read_text(), diff)


def test_planned_example_is_the_documented_change() -> None:
    assert code_of(planned_from_stock()) == code_of((EXAMPLES / "ddp_planned.py").read_text())


TINY = ["--arch", "mlp", "--image-size", "8", "--num-classes", "10", "--num-samples", "96", "--workers", "0",
        "--device", "cpu", "--epochs", "3"]


@pytest.mark.distributed
def test_both_examples_train_on_two_ranks(tmp_path: Path) -> None:
    ranks = tuple(planner.RankProfile(
        rank=i, host="h", device="cpu", compute=(planner.ComputePoint(batch_size=4, step_time_s=0.004 * f),
                                                 planner.ComputePoint(batch_size=16, step_time_s=0.016 * f)))
        for i, f in enumerate((1.0, 3.0)))
    profile = planner.Profile(hosts=(planner.HostProfile(name="h", cpu_cores=2),), ranks=ranks)
    planner.evaluate(profile, [12, 4], num_workers=[0, 0]).save(tmp_path / "plan.json")
    profile.save(tmp_path / "profile.json")
    rc, out, err, _ = run([str(EXAMPLES / "ddp_stock.py"), *TINY, "--batch-size", "8",
                           "--epoch-log", str(tmp_path / "stock.jsonl")], timeout_s=60)
    assert rc == 0, err[-3000:]
    stock = [json.loads(line) for line in (tmp_path / "stock.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in stock] == [0, 1, 2] and all(r["samples"] == 96 and r["steps"] == 6 for r in stock)
    assert out.count("samples/s") == 3
    rc, out, err, _ = run([str(EXAMPLES / "ddp_planned.py"), *TINY, "--plan", str(tmp_path / "plan.json"),
                           "--profile", str(tmp_path / "profile.json"), "--log-file", str(tmp_path / "run.jsonl"),
                           "--epoch-log", str(tmp_path / "planned.jsonl")], timeout_s=60)
    assert rc == 0, err[-3000:]
    planned = [json.loads(line) for line in (tmp_path / "planned.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in planned] == [0, 1, 2] and all(r["samples"] == 96 for r in planned)
    log = read_run_log(tmp_path / "run.jsonl")
    assert [e.epoch for e in log.epochs] == [0, 1, 2] and log.ended
    assert [d.epoch for d in log.replans] == [0, 1]
    assert all(sum(e.batch_sizes) == 16 for e in log.epochs)
