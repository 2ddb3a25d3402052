"""The plan's DDP settings and opt-in gradient compression through ``runtime.PlannedRun`` and the adapters.

``ddp_kwargs(plan)`` is the one check of ``plan.meta["ddp"]`` (planner train, the own loop and the adapters use it);
``PlannedRun(compress=...)`` records the compression in the run log and ``run.register_weighting`` registers the
weighted hook with it. A 2-rank gloo own loop with bf16 compression and the plan's settings (bucket size, bucket
view, static graph) trains to the uncompressed run's parameters within bf16 rounding.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import planner
from planner.errors import ValidationError
from runtime import PlannedRun
from runtime.ddp_settings import ddp_kwargs, settings_missing
from tests._dist import run_distributed
from tests.planner._profiles import linear_profile

SETTINGS = {"bucket_cap_mb": 1, "gradient_as_bucket_view": True, "static_graph": True}


def _plan(batches: list[int], ddp: object = None) -> planner.Plan:
    plan = planner.evaluate(linear_profile([1e-3] * len(batches)), batches, num_workers=[0] * len(batches))
    return plan if ddp is None else dataclasses.replace(plan, meta={**plan.meta, "ddp": ddp})


def test_ddp_kwargs_checks_the_plan_settings() -> None:
    assert ddp_kwargs(_plan([4])) == {}
    assert ddp_kwargs(_plan([4], SETTINGS)) == {**SETTINGS, "bucket_cap_mb": 1.0}
    for bad, match in (({"find_unused_parameters": True}, "not a DDP setting"), ({"bucket_cap_mb": 2048}, r"\[1, 1024\]"),
                       ({"gradient_as_bucket_view": 1}, "true or false"), ([1], "object")):
        with pytest.raises(ValidationError, match=match) as err:
            ddp_kwargs(_plan([4], bad))
        assert "\n" not in str(err.value)
        with pytest.raises(ValidationError, match=match):  # refused on construction, before any collective
            PlannedRun(_plan([4], bad))


def test_planned_run_gives_ddp_kwargs_and_logs_the_compression(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="bf16"):
        PlannedRun(_plan([4]), compress="int8")
    run = PlannedRun(_plan([4], SETTINGS), compress="bf16", log_file=tmp_path / "run.jsonl")
    kw = run.ddp_kwargs()
    assert kw == {**SETTINGS, "bucket_cap_mb": 1.0}
    kw["find_unused_parameters"] = True  # a fresh dict: the caller's additions stay the caller's
    assert "find_unused_parameters" not in run.ddp_kwargs()
    with pytest.raises(ValidationError, match="sampler_for"):
        run.register_weighting(None)  # type: ignore[arg-type]
    run.sampler_for(8, "cpu")
    with pytest.warns(UserWarning, match="register_weighting"):  # compress asked, but no hook registered with it
        run.epoch_end(0, last=True)
    run.finish(1)
    start = json.loads((tmp_path / "run.jsonl").read_text().splitlines()[0])
    assert start["grad_compress"] == "bf16"
    plain = tmp_path / "plain.jsonl"
    run = PlannedRun(_plan([4]), log_file=plain)
    run.sampler_for(8, "cpu")
    run.finish(1)
    assert "grad_compress" not in json.loads(plain.read_text().splitlines()[0])  # uncompressed reads as before


def test_accelerate_handler_gets_the_plan_settings() -> None:
    pytest.importorskip("accelerate")
    from accelerate.utils import DistributedDataParallelKwargs

    from runtime.adapters.accelerate import apply_ddp_settings

    class Acc:
        ddp_handler: DistributedDataParallelKwargs | None = None
        _models: tuple[nn.Module, ...] = ()

    kw = ddp_kwargs(_plan([4], SETTINGS))
    acc = Acc()
    assert apply_ddp_settings(acc, kw)
    assert acc.ddp_handler is not None and acc.ddp_handler.to_kwargs() == kw
    acc = Acc()
    acc.ddp_handler = DistributedDataParallelKwargs(bucket_cap_mb=50)  # the user's own value stays
    assert apply_ddp_settings(acc, kw)
    assert acc.ddp_handler.to_kwargs() == {**kw, "bucket_cap_mb": 50}
    with pytest.warns(UserWarning, match="not applied"):
        assert not apply_ddp_settings(object(), kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert apply_ddp_settings(object(), {})  # nothing to apply: nothing to say


def test_lightning_strategy_gets_the_plan_settings() -> None:
    pytest.importorskip("lightning")
    from runtime.adapters.lightning import LightningPlan

    planned = LightningPlan(_plan([4], SETTINGS), shuffle=True, package="lightning.pytorch", bucket_cap_mb=8)
    assert planned.strategy._ddp_kwargs == {**SETTINGS, "bucket_cap_mb": 8}  # a keyword given here wins


N, STEPS_DATA = 40, 4


def _own_loop(rank: int, compress: str, plan: planner.Plan, log: Path) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(N, 4, generator=g, dtype=torch.float64), torch.randn(N, 2, generator=g, dtype=torch.float64)
    run = PlannedRun(plan, compress=compress, log_file=log, seed=1)
    sampler = run.sampler_for(N, "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2)).double()
    ddp = DDP(model, **run.ddp_kwargs())
    assert ddp.bucket_bytes_cap == 1024 * 1024 and ddp.gradient_as_bucket_view and ddp.static_graph
    assert settings_missing(ddp, run.ddp_kwargs()) == []  # what the Ray adapter checks a prepared model by
    if compress == "none":
        stock = DDP(nn.Linear(2, 2).double())
        assert settings_missing(stock, run.ddp_kwargs()) == [
            "bucket_cap_mb=1.0", "gradient_as_bucket_view=True", "static_graph=True"]
    run.register_weighting(ddp)
    run.watch(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for epoch in range(2):
        for idx in run.epoch(epoch, sampler, last=epoch == 1):
            opt.zero_grad()
            F.mse_loss(ddp(x[idx]), y[idx]).backward()
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


def own_loop_worker(rank: int, world: int, out: str) -> None:
    plan = _plan([7, 3], SETTINGS)
    exact = _own_loop(rank, "none", plan, Path(out) / "none.jsonl")
    bf16 = _own_loop(rank, "bf16", plan, Path(out) / "bf16.jsonl")
    diff = max(float((a - b).abs().max()) for a, b in zip(exact, bf16, strict=True))
    scale = max(float(a.abs().max()) for a in exact)
    assert 0 < diff < 2e-2 * scale, (diff, scale)  # compressed (not identical), within bf16's rounding
    if rank == 0:
        torch.save({"diff": diff}, Path(out) / "diff.pt")


@pytest.mark.distributed
def test_own_loop_bf16_with_plan_ddp_settings_matches_uncompressed(tmp_path: Path) -> None:
    run_distributed(own_loop_worker, 2, str(tmp_path), timeout_s=120)
    starts = {name: json.loads((tmp_path / f"{name}.jsonl").read_text().splitlines()[0]) for name in ("none", "bf16")}
    assert starts["bf16"]["grad_compress"] == "bf16" and "grad_compress" not in starts["none"]
    assert (tmp_path / "diff.pt").exists()


def test_hf_trainer_accelerator_gets_the_plan_settings(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from runtime.adapters.hf import planned_trainer

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 1)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": F.mse_loss(self.lin(x), labels)}

    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, ddp_bucket_cap_mb=50)
    trainer = planned_trainer(_plan([4], SETTINGS), model=Net(), args=args, count_tokens=lambda b: b["x"].shape[0])
    handler = trainer.accelerator.ddp_handler
    assert (handler.bucket_cap_mb, handler.gradient_as_bucket_view, handler.static_graph) == (50, True, True)
