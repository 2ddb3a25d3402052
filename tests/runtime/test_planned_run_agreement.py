"""PlannedRun's agreement check covers every setting that decides which samples a rank draws: a shuffle, drop_last
or min_batch that differs by rank is one error on every rank before any batch, not lost samples or a hang."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import planner
from planner.errors import ValidationError
from tests._dist import run_distributed
from tests.runtime._plans import linear_cpu_profile


def _plan(world_size: int = 2) -> planner.Plan:
    return planner.solve(linear_cpu_profile((0.001,) * world_size), global_batch=10)


def _build(rank: int, world: int, out: str, name: str, values: list[Any]) -> None:
    from runtime import PlannedRun

    kwargs: dict[str, Any] = {name: values[rank]} if name != "min_batch" else {}
    run = PlannedRun(_plan(), **kwargs)
    try:
        run.sampler_for(100, "cpu", **({"min_batch": values[rank]} if name == "min_batch" else {}))
    except ValidationError as e:
        Path(out, f"rank{rank}.txt").write_text(str(e))
        return
    Path(out, f"rank{rank}.txt").write_text("built")


@pytest.mark.distributed
@pytest.mark.parametrize(("name", "values"), [("shuffle", [True, False]), ("drop_last", [False, True]),
                                              ("min_batch", [1, 2])])
def test_a_setting_that_differs_by_rank_is_refused_on_every_rank(tmp_path: Path, name: str,
                                                                  values: list[Any]) -> None:
    run_distributed(_build, 2, str(tmp_path), name, values, timeout_s=120)
    said = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    assert said[0] == said[1] and name in said[0] and "launch every rank with the same" in said[0], said
    assert f"rank 0 has {values[0]}, rank 1 has {values[1]}" in said[0]


def test_a_shuffle_that_is_not_a_bool_is_refused() -> None:
    from runtime import PlannedRun

    with pytest.raises(ValidationError, match="shuffle"):
        PlannedRun(_plan(), shuffle="no")  # type: ignore[arg-type]


def test_a_run_log_that_names_the_plan_is_refused_before_it_is_written(tmp_path: Path) -> None:
    from runtime import PlannedRun

    plan_file = tmp_path / "plan.json"
    _plan(1).save(plan_file)
    before = plan_file.read_bytes()
    run = PlannedRun(plan_file, log_file=plan_file)
    with pytest.raises(ValidationError, match="is the plan input"):
        run.sampler_for(100, "cpu")
    assert plan_file.read_bytes() == before


def test_a_run_log_that_is_a_fifo_is_refused_instead_of_hanging(tmp_path: Path) -> None:
    import os

    from runtime import PlannedRun

    fifo = tmp_path / "run.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(ValidationError, match="FIFO"):
        PlannedRun(_plan(1), log_file=fifo).sampler_for(100, "cpu")


def _own_loop(rank: int, world: int, out: str, weighted: bool) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset

    from runtime import PlannedRun, register_weighted_hook

    plan = planner.solve(linear_cpu_profile((0.001, 0.003)), global_batch=12)
    assert len(set(plan.batch_sizes)) == 2  # uneven: DDP's plain average would be wrong
    data = TensorDataset(torch.randn(48, 4), torch.randn(48, 1))
    model = DDP(torch.nn.Linear(4, 1))
    run = PlannedRun(plan, seed=0)
    sampler = run.sampler_for(len(data), "cpu")
    if weighted:
        register_weighted_hook(model, sampler)
    loader = DataLoader(data, batch_sampler=sampler)
    try:
        for x, y in run.epoch(0, loader, last=True):
            F.mse_loss(model(x), y).backward()
    except ValidationError as e:
        Path(out, f"rank{rank}.txt").write_text(str(e))
        return
    Path(out, f"rank{rank}.txt").write_text("trained")


@pytest.mark.distributed
@pytest.mark.parametrize("weighted", [False, True])
def test_an_own_loop_that_forgets_the_weighting_is_refused_at_its_first_backward(tmp_path: Path,
                                                                                 weighted: bool) -> None:
    run_distributed(_own_loop, 2, str(tmp_path), weighted, timeout_s=120)
    said = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    if weighted:
        assert said == ["trained", "trained"]
    else:
        assert said[0] == said[1] and "register_weighted_hook" in said[0], said
