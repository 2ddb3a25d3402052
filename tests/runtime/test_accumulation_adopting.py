"""docs/ADOPTING.md's accumulation changes, applied literally to stock DDP-no_sync and FSDP2 scripts, train on a plan
with per-rank micro-batches (2 gloo ranks)."""

from __future__ import annotations

import argparse
import math
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from planner.errors import ValidationError
from planner.plan import Plan, Predicted, RankPlan
from tests._dist import run_distributed
from tests._scripts import load_script
from tests.runtime.test_adopting import DOC, apply_diff, changed_lines

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# (doc section, stock script, planned twin, batch sizes, accumulation steps, plan mode)
FORMS = {
    "ddp": ("Gradient accumulation (DDP with no_sync)", "stock_accum_ddp_script.py", "planned_accum_ddp_script.py",
            [12, 4], [3, 1], "ddp"),
    "fsdp": ("FSDP2", "stock_fsdp_script.py", "planned_fsdp_script.py", [12, 4], [2, 2], "fsdp"),
}
# 100 samples, B = 16: 6 full steps, then R = 4 -> r = (3, 1), one micro-batch each (3 fits ceil(12/3) = 4 and 6)
EXPECTED = {
    "ddp": ([4, 4, 4] * 6 + [3], [4] * 6 + [1]),
    "fsdp": ([6, 6] * 6 + [3], [2, 2] * 6 + [1]),
}


def documented_diff(section: str) -> list[str]:
    match = re.search(rf"^## {re.escape(section)}\n.*?```diff\n(.*?)```", DOC.read_text(), re.S | re.M)
    assert match, f"docs/ADOPTING.md must hold a '## {section}' section with a ```diff block"
    return match.group(1).splitlines()


def code_of(source: str) -> str:
    """The script after its module docstring (the twins' docstrings say which is which)."""
    return source.split('"""', 2)[2]


def accumulating_plan(sizes: list[int], steps: list[int], mode: str) -> Any:
    """A Plan with per-rank accumulation."""
    big_b = sum(sizes)
    ranks = tuple(RankPlan(rank=i, batch_size=b, share=b / big_b, num_workers=0, predicted_step_time_s=0.01,  # type: ignore[call-arg]
                           bottleneck="memory", accumulation_steps=k) for i, (b, k) in enumerate(zip(sizes, steps)))
    return Plan(world_size=len(sizes), global_batch=big_b, ranks=ranks, mode=mode,  # type: ignore[call-arg]
                predicted=Predicted(step_time_s=0.01, samples_per_s=1600.0, equal_split_samples_per_s=1000.0,
                                    ideal_samples_per_s=1600.0))


def planned_args(module: Any, plan: Any, tmp: str) -> argparse.Namespace:
    if isinstance(plan, Plan):  # the whole route: a plan file on the command line
        path = f"{tmp}/plan-{plan.mode}.json"
        plan.save(path)
        return module.get_args_parser().parse_args(["--plan", path])  # type: ignore[no-any-return]
    args = module.get_args_parser().parse_args(["--plan", "stand-in"])
    args.plan = plan  # from_plan takes a Plan object as well as a path
    return args  # type: ignore[no-any-return]


def same_on_every_rank(params: list[torch.Tensor], world: int) -> None:
    flat = torch.cat([p.flatten() for p in params])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(g, gathered[0]) for g in gathered)
    assert torch.isfinite(flat).all()


def adopt_worker(rank: int, world: int, tmp: str) -> None:
    for form, (_, stock_name, planned_name, sizes, steps, mode) in FORMS.items():
        stock = load_script(str(HERE / stock_name), f"stock_{form}")
        out = stock.train(stock.get_args_parser().parse_args([]))  # type: ignore[attr-defined]
        assert out["batch_sizes"] == ([4] * 12 + [2]) * 2  # DistributedSampler: 50 samples per rank and epoch
        assert out["optimizer_steps"] == 14  # 6 windows of 2 micro-batches + the last one, per epoch
        same_on_every_rank(out["params"], world)

        planned = load_script(str(HERE / planned_name), f"planned_{form}")
        args = planned_args(planned, accumulating_plan(sizes, steps, mode), tmp)
        out = planned.train(args)  # type: ignore[attr-defined]
        assert out["batch_sizes"] == EXPECTED[form][rank] * 2, (form, out["batch_sizes"])
        assert out["optimizer_steps"] == 14  # 7 steps per epoch on every rank, whatever its k_i
        same_on_every_rank(out["params"], world)
        if form == "fsdp":
            # A ddp-mode plan with unequal k in the FSDP2 recipe hung in an all-gather; now every rank refuses it.
            unequal = planned_args(planned, accumulating_plan(sizes, [3, 1], "ddp"), tmp)
            with pytest.raises(ValidationError, match=r"this is an FSDP2 loop but the plan \(mode 'ddp'\) gives the "
                                                      r"ranks \[3, 1\] micro-steps"):
                planned.train(unequal)  # type: ignore[attr-defined]


@pytest.mark.parametrize("form", sorted(FORMS))
def test_documented_change_gives_the_planned_twin(form: str) -> None:
    section, stock_name, planned_name, *_ = FORMS[form]
    diff = documented_diff(section)
    assert changed_lines(diff) <= 8
    planned = apply_diff((HERE / stock_name).read_text(), diff)
    assert code_of(planned) == code_of((HERE / planned_name).read_text())
    assert "DistributedSampler(" not in planned.split("def train", 1)[1]
    assert "accumulation_steps" not in planned.split("def train", 1)[1]  # the plan says, per rank


@pytest.mark.distributed
def test_stock_and_planned_accumulation_scripts_run(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 (fully_shard) needs torch >= 2.6")
    run_distributed(adopt_worker, 2, str(tmp_path), timeout_s=150)


# -- planning accumulation on CPU: the documented commands, run --------------------------------------------------
PLANNING = "**Making an accumulation plan.**"


def documented_commands() -> list[list[str]]:
    """The ```bash block of the accumulation section's planning paragraph, one argv per line."""
    text = DOC.read_text()
    assert PLANNING in text, f"docs/ADOPTING.md must say how to make an accumulation plan ({PLANNING})"
    block = re.search(r"```bash\n(.*?)```", text.split(PLANNING, 1)[1], re.S)
    assert block, "the planning paragraph must hold a ```bash block"
    return [shlex.split(line) for line in block.group(1).splitlines() if line.strip()]


def planned_accumulation_worker(rank: int, world: int, script: str, argv: list[str], micro_cap: int,
                                sizes: list[int]) -> None:
    module = load_script(script, "documented_accum_script")
    out = module.train(module.get_args_parser().parse_args(argv))  # type: ignore[attr-defined]
    assert max(out["batch_sizes"]) <= micro_cap, out["batch_sizes"]  # no forward above the stated cap
    k = math.ceil(sizes[rank] / micro_cap)
    assert sum(out["batch_sizes"][:k]) == sizes[rank]  # the first (full) step: b_i samples in k micro-batches
    assert out["optimizer_steps"] == 2 * math.ceil(100 / sum(sizes))  # 2 epochs of 100 samples, every rank
    same_on_every_rank(out["params"], world)


@pytest.mark.distributed
def test_documented_cpu_route_plans_and_runs_accumulation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """profile on CPU -> plan with --max-micro-batch -> the planned accumulation script on 2 ranks, as written."""
    from planner.cli import main

    commands = documented_commands()
    assert [c[0] for c in commands] == ["planner", "planner", "torchrun"]
    monkeypatch.chdir(tmp_path)
    for argv in commands[:2]:
        assert main(argv[1:]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    plan_argv = commands[1]
    micro_cap = int(plan_argv[plan_argv.index("--max-micro-batch") + 1])
    plan = Plan.load(tmp_path / plan_argv[plan_argv.index("--out") + 1])
    assert plan.global_batch == int(plan_argv[plan_argv.index("--global-batch") + 1])
    assert plan.accumulates and "micro-batches" in out  # the table shows steps x micro-batch
    for r in plan.ranks:  # every rank past the cap accumulates; none holds more than the cap per forward
        assert r.accumulation_steps == math.ceil(r.batch_size / micro_cap), plan.ranks
        assert (r.micro_batch_size or r.batch_size) <= micro_cap

    launch = commands[2]
    script = next(a for a in launch if a.endswith(".py"))
    argv = launch[launch.index(script) + 1:]
    argv[argv.index("--plan") + 1] = str(tmp_path / argv[argv.index("--plan") + 1])
    run_distributed(planned_accumulation_worker, 2, str(ROOT / script), argv, micro_cap, list(plan.batch_sizes),
                    timeout_s=150)


def test_the_doc_has_one_accumulation_recipe() -> None:
    """The micro_steps form above is the one no_sync recipe; the other mentions of accumulation point to it
    (a second recipe, with its own weights per window, disagreed with it)."""
    text = DOC.read_text()
    assert "accumulation_weight(sampler" not in text and "accumulation_steps=K" not in text
    assert text.count('"Gradient accumulation (DDP with no_sync)"') >= 1  # the pointer to the section
