"""docs/ADOPTING.md's changes, applied literally to three stock DDP scripts, train with the plan's uneven batches.

The three forms people write: ``DataLoader(batch_size=, sampler=)`` (A), ``DataLoader(batch_sampler=BatchSampler(..))``
(B), and a script that builds the model after the loader (C). Each diff in the doc names the stock script it
applies to; each planned script runs on 2 gloo ranks next to its stock original.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from planner.plan import Plan, Predicted, RankPlan
from tests._dist import run_distributed
from tests._scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "ADOPTING.md"
FORMS = {
    "A": "tests/runtime/stock_ddp_loader_script.py",
    "B": "tests/runtime/stock_ddp_script.py",
    "C": "tests/runtime/stock_ddp_late_model_script.py",
}
MAX_CHANGED_LINES = 8
"""The doc promises "six to eight lines"; a change that grows past that is no longer a small adoption."""


def documented_diffs() -> dict[str, list[str]]:
    """Each ```diff block of the doc that names its stock script (`--- a/PATH`), keyed by that path. Header-less
    blocks are the accumulation and FSDP2 sections' (tests/runtime/test_accumulation_adopting.py)."""
    out = {}
    for block in re.findall(r"```diff\n(.*?)```", DOC.read_text(), re.S):
        lines = block.splitlines()
        if not lines[0].startswith("--- a/"):
            continue
        assert lines[1].startswith("+++ b/"), lines[:2]
        out[lines[0][len("--- a/"):]] = lines[2:]
    return out


def apply_diff(source: str, diff: list[str]) -> str:
    """Apply the doc's diff by exact string replacement: '-' runs are replaced, '+' runs after context inserted."""
    hunks: list[tuple[str | None, list[str], list[str]]] = []
    context: str | None = None
    for line in diff:
        tag, text = line[:1], line[1:]
        if tag == " ":
            context = text
            hunks.append((context, [], []))
        elif tag == "-":
            if not hunks or hunks[-1][2]:  # a removal after additions starts a new hunk
                hunks.append((None, [], []))
            hunks[-1][1].append(text)
        elif tag == "+":
            if not hunks:
                hunks.append((None, [], []))
            hunks[-1][2].append(text)
    for anchor, removed, added in hunks:
        if removed:
            old = "\n".join(removed) + "\n"
            assert source.count(old) == 1, f"documented line(s) not found exactly once in the stock script: {old!r}"
            source = source.replace(old, "".join(a + "\n" for a in added))
        elif added:
            assert anchor is not None and source.count(anchor + "\n") == 1, anchor
            source = source.replace(anchor + "\n", anchor + "\n" + "".join(a + "\n" for a in added))
    return source


def changed_lines(diff: list[str]) -> int:
    return sum(1 for line in diff if line.startswith("+"))


def adopt_worker(rank: int, world: int, scripts: list[tuple[str, str]], plan_path: str) -> None:
    for i, (stock_path, planned_path) in enumerate(scripts):
        stock = load_script(stock_path, f"stock_script_{i}")
        out = stock.train(stock.get_args_parser().parse_args(["--batch-size", "8"]))  # type: ignore[attr-defined]
        assert out["batch_sizes"] == ([8] * 6 + [2]) * 2  # DistributedSampler: 50 samples per rank
        assert out["lr"] == pytest.approx(0.05)  # 0.05 at a global batch of 16

        planned = load_script(planned_path, f"planned_script_{i}")
        # --workers 3 is left in the planned script's flags: the loader must take the plan's 0 instead.
        args = planned.get_args_parser().parse_args(["--plan", plan_path, "--workers", "3"])  # type: ignore[attr-defined]
        out = planned.train(args)  # type: ignore[attr-defined]
        expected = [12] * 6 + [3] if rank == 0 else [4] * 6 + [1]  # last step: R = 4 split 3 : 1
        assert out["batch_sizes"] == expected * 2, (stock_path, out["batch_sizes"])
        assert out["lr"] == pytest.approx(0.05)  # the LR line now scales by sampler.global_batch = 16
        assert out["num_workers"] == 0  # the plan's workers, not --workers
        flat = torch.cat([p.flatten() for p in out["params"]])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        assert torch.equal(gathered[0], gathered[1])  # DDP kept the replicas identical


def _plan(tmp_path: Path) -> Path:
    ranks = tuple(
        RankPlan(rank=i, batch_size=b, share=b / 16, num_workers=0, predicted_step_time_s=0.01, bottleneck="compute")
        for i, b in enumerate((12, 4))
    )
    plan = Plan(world_size=2, global_batch=16, ranks=ranks,
                predicted=Predicted(step_time_s=0.01, samples_per_s=1600.0, equal_split_samples_per_s=1000.0,
                                    ideal_samples_per_s=1600.0))
    plan.save(tmp_path / "plan.json")
    return tmp_path / "plan.json"


def test_the_doc_has_one_small_diff_per_form() -> None:
    diffs = documented_diffs()
    assert sorted(diffs) == sorted(FORMS.values())
    for path, diff in diffs.items():
        assert changed_lines(diff) <= MAX_CHANGED_LINES, path
        planned = apply_diff((ROOT / path).read_text(), diff)
        body = planned.split("def train", 1)[1]
        assert "DistributedSampler(" not in body and "args.batch_size" not in body, path
        # The hook comes after the DDP-wrapped model exists: never before the line that makes it.
        assert body.index("register_weighted_hook(model") > body.index("DDP("), path


@pytest.mark.distributed
def test_documented_changes_move_every_stock_form_onto_a_plan(tmp_path: Path) -> None:
    scripts = []
    for form, path in FORMS.items():
        planned = tmp_path / f"planned_{form}.py"
        planned.write_text(apply_diff((ROOT / path).read_text(), documented_diffs()[path]))
        scripts.append((str(ROOT / path), str(planned)))
    run_distributed(adopt_worker, 2, scripts, str(_plan(tmp_path)), timeout_s=150)


def test_hook_on_an_unwrapped_module_says_to_pass_the_ddp_model() -> None:
    from runtime import HeteroBatchSampler, register_weighted_hook

    sampler = HeteroBatchSampler(100, [12, 4], 0)
    with pytest.raises(TypeError, match=r"needs the DDP-wrapped model, got a Sequential .*after `model = "
                                        r"DistributedDataParallel\(model, \.\.\.\)`"):
        register_weighted_hook(torch.nn.Sequential(torch.nn.Linear(2, 2)), sampler)  # type: ignore[arg-type]


# -- step 1: the plan commands, run as written ---------------------------------------------------------------------
PROFILE = ROOT / "tests" / "data" / "h200x2_resnet50_slowdown_3x_profile.json"  # resnet50, 2x H200, memory measured


def step_one_plan_commands() -> list[list[str]]:
    """Every `planner plan` line of the ```bash blocks in "1. Make the plan" (up to step 2)."""
    section = DOC.read_text().split("**1. Make the plan**", 1)[1].split("**2. Change the script.**", 1)[0]
    lines = [line.split("#", 1)[0] for block in re.findall(r"```bash\n(.*?)```", section, re.S)
             for line in block.splitlines()]
    return [shlex.split(line) for line in lines if line.strip().startswith("planner plan")]


def test_step_one_documents_a_plan_with_chosen_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The solver's plan and `--from-batches`' are both in step 1, and both commands run as written (on a measured
    2-rank profile standing in for profile.json); the chosen split reaches each rank's sampler unchanged."""
    from planner.cli import main
    from runtime import HeteroBatchSampler

    commands = step_one_plan_commands()
    chosen = [c for c in commands if "--from-batches" in c]
    assert len(commands) == 2 and len(chosen) == 1, commands
    monkeypatch.chdir(tmp_path)
    for argv in commands:
        argv = [str(PROFILE) if a == "profile.json" else a for a in argv]
        assert main(argv[1:]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    argv = chosen[0]
    batches = [int(b) for b in argv[argv.index("--from-batches") + 1].split(",")]
    plan = Plan.load(tmp_path / argv[argv.index("--out") + 1])
    assert list(plan.batch_sizes) == batches and plan.global_batch == sum(batches)
    assert plan.solver["method"] == "given" and "x equal split" in out  # with the profile's prediction for it
    for rank, b in enumerate(batches):
        sampler = HeteroBatchSampler.from_plan(plan, rank, 10 * sum(batches))
        sampler.set_epoch(0)
        assert {len(batch) for batch in sampler} == {b}
