"""docs/ADOPTING.md's "Re-planning in your own loop": the documented change, applied literally to the stock DDP
script, gives tests/runtime/planned_replan_ddp_script.py; it trains on 2 gloo ranks with the plan, re-plans at the
epoch end through runtime.PlannedRun, writes a run log `planner report --log` reads, and keeps the replicas equal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import planner
from planner.runlog import read_run_log
from tests._dist import run_distributed
from tests._scripts import load_script
from tests.runtime.test_accumulation_adopting import code_of, documented_diff
from tests.runtime.test_adopting import MAX_CHANGED_LINES, apply_diff, changed_lines

HERE = Path(__file__).resolve().parent
SECTION = "Re-planning in your own loop"
EXTRA_LINES = 3
"""What re-planning may cost beyond the plain adoption (form B): the profile and log flags, and watch()."""


def test_the_documented_change_gives_the_twin() -> None:
    diff = documented_diff(SECTION)
    assert changed_lines(diff) <= MAX_CHANGED_LINES + EXTRA_LINES
    planned = apply_diff((HERE / "stock_ddp_script.py").read_text(), diff)
    assert code_of(planned) == code_of((HERE / "planned_replan_ddp_script.py").read_text())


def _profile_and_plan(tmp: Path) -> tuple[Path, Path]:
    """Two CPU ranks, rank 1 profiled 3x slower: the plan gives it a quarter of the global batch of 16."""
    ranks = tuple(planner.RankProfile(
        rank=i, host="h", device="cpu", compute=(planner.ComputePoint(batch_size=4, step_time_s=0.004 * f),
                                                 planner.ComputePoint(batch_size=16, step_time_s=0.016 * f)))
        for i, f in enumerate((1.0, 3.0)))
    profile = planner.Profile(hosts=(planner.HostProfile(name="h", cpu_cores=2),), ranks=ranks)
    plan = planner.evaluate(profile, [12, 4], num_workers=[0, 0])
    profile.save(tmp / "profile.json")
    plan.save(tmp / "plan.json")
    return tmp / "profile.json", tmp / "plan.json"


def replan_worker(rank: int, world: int, tmp: str) -> None:
    module = load_script(str(HERE / "planned_replan_ddp_script.py"), "planned_replan_ddp")
    args = module.get_args_parser().parse_args(  # type: ignore[attr-defined]
        ["--plan", f"{tmp}/plan.json", "--profile", f"{tmp}/profile.json", "--log-file", f"{tmp}/run.jsonl",
         "--epochs", "3"])
    out = module.train(args)  # type: ignore[attr-defined]
    assert out["lr"] == pytest.approx(0.05)
    flat = torch.cat([p.flatten() for p in out["params"]])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert torch.equal(gathered[0], gathered[1])  # exact weighting and the same split on every rank
    sizes = torch.tensor(out["batch_sizes"])
    everyone = [torch.empty_like(sizes) for _ in range(world)]
    dist.all_gather(everyone, sizes)
    steps = torch.stack(everyone).sum(0).tolist()
    # Every full step is the global batch; each epoch's last step holds its R = 4 samples, each rank's part
    # rounded up (HeteroBatchSampler.partial_sizes, padded as DistributedSampler pads): 4 or 5 over 2 ranks.
    assert len(steps) == 3 * 7 and all(steps[e * 7:e * 7 + 6] == [16] * 6 for e in range(3)), steps
    assert all(4 <= steps[e * 7 + 6] <= 5 for e in range(3)), steps


@pytest.mark.distributed
def test_own_loop_replans_and_logs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _profile_and_plan(tmp_path)
    run_distributed(replan_worker, 2, str(tmp_path), timeout_s=150)
    log = read_run_log(tmp_path / "run.jsonl")
    assert [e.epoch for e in log.epochs] == [0, 1, 2] and log.ended
    assert [d.epoch for d in log.replans] == [0, 1]  # a decision at every epoch end but the last
    for e in log.epochs:
        assert sum(e.batch_sizes) == 16 and len(e.ranks) == 2 and all(st.num_steps > 0 for st in e.ranks)
    from planner.cli import main

    assert main(["report", "--profile", str(tmp_path / "profile.json"), "--plan", str(tmp_path / "plan.json"),
                 "--log", str(tmp_path / "run.jsonl"), "--out", str(tmp_path / "report.html")]) == 0
    assert "Run log" in capsys.readouterr().out
