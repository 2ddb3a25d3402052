"""examples/: each planned script is its stock twin plus the <= 5-line diff docs/FRAMEWORKS.md shows; both train.

For each framework the documented diff is applied to the stock text (tests/runtime/test_adopting.apply_diff),
must give the planned example file exactly, and both versions train on 2 gloo ranks in one torchrun launch.
The Lightning pair trains from a plan solved on a profile that profiler.api measured for the example's own model
and dict batches (rank 1 emulated 3x slower), so profile -> plan -> Lightning is tested end to end.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import planner
from tests._scripts import load_script
from tests.frameworks._common import REPO, torchrun
from tests.runtime.test_adopting import apply_diff, changed_lines

DOC = REPO / "docs" / "FRAMEWORKS.md"
RUNNER = Path(__file__).with_name("_run_examples.py")


def documented_diff(kind: str) -> list[str]:
    blocks = re.findall(r"```diff\n(.*?)```", DOC.read_text(), re.S)
    found = [b.splitlines() for b in blocks if f"examples/{kind}_planned.py" in b]
    assert len(found) == 1, f"docs/FRAMEWORKS.md must hold one ```diff block for examples/{kind}_planned.py"
    return [line for line in found[0] if not line.startswith(("---", "+++"))]


@pytest.mark.parametrize("kind", ["lightning", "accelerate"])
def test_documented_diff_turns_the_stock_example_into_the_planned_one(kind: str) -> None:
    diff = documented_diff(kind)
    assert changed_lines(diff) <= 5
    stock = (REPO / "examples" / f"{kind}_stock.py").read_text()
    assert "runtime" not in stock and "planner" not in stock.split('"""', 2)[2]  # stock uses nothing of ours
    assert apply_diff(stock, diff) == (REPO / "examples" / f"{kind}_planned.py").read_text()


def _profiled_plan(tmp_path: Path) -> planner.Plan:
    """profiler.api on the Lightning example's own model and dict batches: two local 'ranks', rank 1 3x slower."""
    from profiler.api import batches_from, local_profile, profile_step
    from profiler.loader import LoaderOptions
    from profiler.workloads.emulate import Slowdown

    example = load_script(str(REPO / "examples" / "lightning_stock.py"), "lightning_example_for_profile")
    model = example.Regressor()  # type: ignore[attr-defined]
    data = example.Synthetic(64)  # type: ignore[attr-defined]
    ranks = []
    for rank, factor in enumerate((1.0, 3.0)):
        slow = Slowdown(factor)

        def loss_fn(m: torch.nn.Module, batch: dict[str, torch.Tensor], slow: Slowdown = slow) -> torch.Tensor:
            assert isinstance(batch, dict)  # the example's batches are dicts, not (x, y)
            slow.apply(m, F.mse_loss, batch["x"], batch["y"])
            return F.mse_loss(m(batch["x"]), batch["y"])

        ranks.append(profile_step(model, batches_from(data), loss_fn, "cpu", rank=rank, data=data, quick=True,
                                  batch_sizes=[8, 16, 32],
                                  loader=LoaderOptions(num_samples=32, chunk=8, budget_s=0.3, scaling_s=0)))
    profile = local_profile(ranks, model_name="Regressor")
    # The split is given, not solved: on a loaded 2-core host a --quick CPU profile can be noisy enough that the
    # solver keeps the equal split, and what this test follows is an uneven plan from this profile through the
    # example (the solver's answer to a 3x slower rank is tested on exact curves, tests/planner).
    plan = planner.evaluate(profile, [11, 5], num_workers=[0, 0])
    plan.save(tmp_path / "plan.json")
    return plan


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["lightning", "accelerate"])
def test_stock_and_planned_examples_train_on_two_ranks(kind: str, tmp_path: Path) -> None:
    pytest.importorskip("lightning" if kind == "lightning" else "accelerate")
    if kind == "lightning":
        plan = _profiled_plan(tmp_path)
        assert plan.batch_sizes == (11, 5)
    else:
        plan = planner.evaluate(planner.Profile.load(REPO / "planner" / "examples" / "minimal_profile.json"), [12, 4],
                                num_workers=[0, 0])
        plan.save(tmp_path / "plan.json")
    args = [kind, str(REPO / "examples" / f"{kind}_stock.py"), str(REPO / "examples" / f"{kind}_planned.py"),
            str(tmp_path / "plan.json"), str(tmp_path)]
    rc, _, err = torchrun(RUNNER, args, timeout_s=180)
    assert rc == 0, err[-4000:]
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    steps = -(-256 // plan.global_batch) * 2  # 2 epochs of 256 samples
    for rank, res in enumerate(results):
        assert res["stock"]["batch_sizes"] == [8] * 32  # 256 samples, 2 ranks x 8, 2 epochs
        assert res["planned"]["batch_sizes"] == [plan.batch_sizes[rank]] * steps
    for which in ("stock", "planned"):  # DDP kept the replicas identical
        for a, b in zip(results[0][which]["params"], results[1][which]["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
