"""docs/ADOPTING.md's "Re-planning in your own loop": the documented change, applied literally to the stock DDP
script, gives tests/runtime/planned_replan_ddp_script.py; it trains on 2 gloo ranks with the plan, re-plans at the
epoch end through runtime.PlannedRun, writes a run log `planner report --log` reads, and keeps the replicas equal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

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


# -- exactness across a re-plan that changes the batches and the micro-step counts -----------------------------------
N_EXACT = 40  # global batch 12: 3 full steps and a partial one of 4 samples per epoch
PLAN_A = ([8, 4], [2, 1])  # rank 0 accumulates 2 micro-batches of 4
PLAN_B = ([3, 9], [1, 3])  # after the re-plan rank 1 accumulates 3 of 3
LR_EXACT = 0.1


def _exact_plans(tmp: Path) -> None:
    profile, _ = _profile_and_plan(tmp)
    base = planner.evaluate(planner.Profile.load(profile), PLAN_A[0], num_workers=[0, 0])
    base.with_batch_sizes(*PLAN_A).save(tmp / "plan_a.json")
    base.with_batch_sizes(*PLAN_B).save(tmp / "plan_b.json")


def exact_replan_worker(rank: int, world: int, tmp: str) -> None:
    """ADOPTING's own loop with accumulation (micro_steps, no_sync, the weighted hook) under PlannedRun; the
    Replanner's epoch-0 verdict is replaced by plan B, so the run adopts new batches and micro-step counts exactly as
    it adopts any re-plan. Returns nothing: asserts the parameters after every optimizer step equal one process
    taking one SGD step on the concatenation of every rank's samples of that step (float64)."""
    import contextlib
    import dataclasses

    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset

    from planner.plan import Plan
    from runtime import PlannedRun, micro_steps
    from runtime.collectives import all_gather_json
    from tests.runtime.test_weighting import make_data, make_model

    plan_b = Plan.load(f"{tmp}/plan_b.json")
    x, y = make_data("mlp", N_EXACT)
    data = TensorDataset(torch.arange(N_EXACT), x, y)
    ddp = DDP(make_model("mlp"), bucket_cap_mb=1e-6)  # one bucket per parameter: several buckets per sync
    run = PlannedRun(f"{tmp}/plan_a.json", profile=f"{tmp}/profile.json", replan=True, seed=7,
                     log_file=f"{tmp}/exact_run.jsonl")
    sampler = run.sampler_for(N_EXACT, "cpu")
    loader = DataLoader(data, batch_sampler=sampler)
    run.register_weighting(ddp)
    run.watch(ddp)
    assert run.replanner is not None
    decide = run.replanner.step

    def adopt_b(stats: object, epoch: int) -> object:  # the collective decision runs; its verdict is replaced
        d = decide(stats, epoch)  # type: ignore[arg-type]
        return dataclasses.replace(d, adopted=True, new_plan=plan_b, reason="plan B") if epoch == 0 else d

    run.replanner.step = adopt_b  # type: ignore[method-assign,assignment]
    opt = torch.optim.SGD(ddp.parameters(), lr=LR_EXACT)
    steps: list[dict[str, object]] = []
    after: list[list[torch.Tensor]] = []
    current: list[int] = []
    for epoch in range(2):
        for (idx, xb, yb), micro in micro_steps(run.epoch(epoch, loader, last=epoch == 1), sampler):
            with contextlib.nullcontext() if micro.is_last else ddp.no_sync():
                (F.mse_loss(ddp(xb), yb) * micro.accumulation_weight).backward()
            current += idx.tolist()
            if micro.is_last:
                opt.step()
                opt.zero_grad()
                steps.append({"epoch": epoch, "samples": current, "micro": micro.count})
                after.append([p.detach().clone() for p in ddp.module.parameters()])
                current = []
    everyone = all_gather_json(steps)
    # Rank 0 runs 2 micro-batches a full step under plan A and 1 under plan B; rank 1 runs 1, then 3.
    full = [[s["micro"] for s in r if s["epoch"] == e][:3] for r in everyone for e in (0, 1)]
    assert full == [[2] * 3, [1] * 3, [1] * 3, [3] * 3], full
    assert [len(s["samples"]) for s in everyone[1] if s["epoch"] == 1][:3] == [9] * 3
    # The reference: one process, one step on every rank's samples of that step.
    model = make_model("mlp")
    ref_opt = torch.optim.SGD(model.parameters(), lr=LR_EXACT)
    worst = 0.0
    for i, mine in enumerate(after):
        idx = [j for r in everyone for j in r[i]["samples"]]  # type: ignore[union-attr]
        loss = F.mse_loss(model(x[idx]), y[idx])
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
        worst = max(worst, *(((p - q).norm() / q.norm()).item() for p, q in zip(mine, model.parameters(), strict=True)))
    assert len(after) == 8 and worst <= 1e-12, (len(after), worst)
    for e in (0, 1):  # every sample of each epoch is seen (the partial step pads a few by wrap-around)
        seen = {j for r in everyone for s in r if s["epoch"] == e for j in s["samples"]}  # type: ignore[union-attr]
        assert seen == set(range(N_EXACT))


@pytest.mark.distributed
def test_own_loop_stays_exact_across_a_replan_of_batches_and_micro_steps(tmp_path: Path) -> None:
    _exact_plans(tmp_path)
    run_distributed(exact_replan_worker, 2, str(tmp_path), timeout_s=150)
    log = read_run_log(tmp_path / "exact_run.jsonl")
    assert [e.batch_sizes for e in log.epochs] == [tuple(PLAN_A[0]), tuple(PLAN_B[0])]
