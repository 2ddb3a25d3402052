"""docs/ADOPTING.md's re-planning change for form A (``DataLoader(batch_size=, sampler=)``): applied literally to
tests/runtime/stock_ddp_loader_script.py it gives tests/runtime/planned_replan_ddp_loader_script.py, with no more
added lines than form B's re-planning change; the result trains on 2 gloo ranks with the plan's batches, re-plans
at each epoch end, writes the run log and keeps the replicas equal."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from planner.runlog import read_run_log
from tests._dist import run_distributed
from tests._scripts import load_script
from tests.runtime.test_accumulation_adopting import DOC, code_of, documented_diff
from tests.runtime.test_adopting import apply_diff, changed_lines
from tests.runtime.test_own_loop_replan import SECTION, _profile_and_plan

HERE = Path(__file__).resolve().parent
SUBSECTION = "Re-planning in form A: `DataLoader(batch_size=, sampler=)`"


def form_a_diff() -> list[str]:
    match = re.search(rf"^### {re.escape(SUBSECTION)}\n.*?```diff\n(.*?)```", DOC.read_text(), re.S | re.M)
    assert match, f"docs/ADOPTING.md must hold a '### {SUBSECTION}' section with a ```diff block"
    return match.group(1).splitlines()


def test_the_documented_form_a_change_gives_the_twin_in_as_many_lines_as_form_b() -> None:
    diff = form_a_diff()
    assert changed_lines(diff) <= changed_lines(documented_diff(SECTION))
    planned = apply_diff((HERE / "stock_ddp_loader_script.py").read_text(), diff)
    assert code_of(planned) == code_of((HERE / "planned_replan_ddp_loader_script.py").read_text())


def form_a_worker(rank: int, world: int, tmp: str) -> None:
    module = load_script(str(HERE / "planned_replan_ddp_loader_script.py"), "planned_replan_ddp_loader")
    args = module.get_args_parser().parse_args(  # type: ignore[attr-defined]
        ["--plan", f"{tmp}/plan.json", "--profile", f"{tmp}/profile.json", "--log-file", f"{tmp}/run.jsonl",
         "--epochs", "2"])
    out = module.train(args)  # type: ignore[attr-defined]
    flat = torch.cat([p.flatten() for p in out["params"]])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert torch.equal(gathered[0], gathered[1])  # exact weighting and the same split on every rank
    # The plan's [12, 4] of the global batch 16 (100 samples: 6 full steps and a last one of 4 samples an epoch).
    assert out["batch_sizes"][:6] == [(12, 4)[rank]] * 6, out["batch_sizes"]


@pytest.mark.distributed
def test_form_a_own_loop_trains_the_plan_replans_and_logs(tmp_path: Path) -> None:
    _profile_and_plan(tmp_path)
    run_distributed(form_a_worker, 2, str(tmp_path), timeout_s=150)
    log = read_run_log(tmp_path / "run.jsonl")
    assert [e.epoch for e in log.epochs] == [0, 1] and log.ended
    assert [d.epoch for d in log.replans] == [0]  # a decision at every epoch end but the last
    assert all(sum(e.batch_sizes) == 16 for e in log.epochs)
