"""One local Ray cluster and one ``TorchTrainer.fit`` on 2 CPU workers (gloo) for everything test_ray.py checks.

    python tests/frameworks/_ray_driver.py OUT [RAY_TEMP_DIR]

Starts Ray with 2 CPUs, no dashboard and no usage report (nothing leaves the machine), writes the plans it needs
to OUT, and runs one training function on both workers that, in order:

  0. makes the mistake of a loop that weights nothing: ``planned_dataloader`` without ``model=`` and without the
     loss scale, and keeps the first backward's refusal (first: nothing has weighted a gradient in the worker yet);
  1. runs examples/ray_stock.py's and examples/ray_planned.py's ``train`` (the planned one on a
     [12, 4] plan), and passes a plain ``batch_sampler`` loader through ``prepare_data_loader``;
  2. trains the float64 twin: a [7, 3] plan through ``planned_dataloader(..., model=ddp)`` and Ray's own
     ``prepare_model`` / ``prepare_data_loader``, with a run log;
  3. trains it again with the loss scale instead of the hook, and the control: the same planned batches under
     DDP's plain average (no ``model=``, no loss scale: no weighting);
  4. hands ``planned_dataloader`` a plan for 1 worker with ``profile_fn`` (profiler.api.profile_job on the
     twin's step): the 2-worker group is profiled and re-planned, then trains an epoch on the new plan; and
     auto mode as documented (no plan, ``profile_fn``, ``global_batch``, ``replan=True``).

Each worker saves what it saw to OUT/rank{R}.pt.  ``ray.shutdown()`` runs in a ``finally``; the test kills this
session (the driver, Ray's daemons and workers) after its deadline.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

REPO = Path(__file__).resolve().parents[2]  # on PYTHONPATH (the test sets it): Ray's workers import from it
TWIN_PLAN = [7, 3]
EXAMPLE_PLAN = [12, 4]


class Indexed(Dataset[dict[str, torch.Tensor]]):
    """float64 samples {"i": index, "x": 4 features, "y": 1 target}, the same on every worker."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.randn(4, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
        return {"i": torch.tensor(i), "x": x, "y": (x.sum() * 0.5 + x[0] ** 2).reshape(1)}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def twin(plan: Any, *, weighted: bool, scaled: bool = False, log_file: str | None = None,
         **kw: Any) -> dict[str, Any]:
    """One epoch of SGD on the planned loader; ``weighted``: the DDP model goes to planned_dataloader (the hook);
    ``scaled``: the loss is multiplied by ``RayPlan.loss_scale(step)`` instead."""
    import ray.train.torch

    from runtime.adapters.ray import planned_dataloader, planned_epoch

    model = ray.train.torch.prepare_model(make_model())
    data = Indexed(30)
    loader = planned_dataloader(plan, data, model=model if weighted else None, shuffle=True, log_file=log_file,
                                **kw)
    planned = loader.sampler.planned  # type: ignore[union-attr]
    loader = ray.train.torch.prepare_data_loader(loader)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    seen: list[list[int]] = []
    for step, batch in enumerate(planned_epoch(loader, 0, last=True)):
        loss = F.mse_loss(model(batch["x"]), batch["y"]) * (planned.loss_scale(step) if scaled else 1.0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seen.append(batch["i"].tolist())
    module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return {"seen": seen, "params": [p.detach().clone() for p in module.parameters()],
            "plan": list(planned.plan.batch_sizes), "replanned_for_world": planned.replanned_for_world,
            "loader_type": type(loader).__name__, "sampler_type": type(loader.sampler).__name__}


def unweighted_step(plan: Any) -> str | None:
    """The first step of a planned loop that passes no ``model=`` and scales no loss: the ValidationError's line
    (None: it trained)."""
    import ray.train.torch

    from planner.errors import ValidationError
    from runtime.adapters.ray import planned_dataloader, planned_epoch

    model = ray.train.torch.prepare_model(make_model())
    loader = ray.train.torch.prepare_data_loader(planned_dataloader(plan, Indexed(30), shuffle=True))
    try:
        for batch in planned_epoch(loader, 0, last=True):
            F.mse_loss(model(batch["x"]), batch["y"]).backward()
            break
    except ValidationError as e:
        return str(e)
    return None


def loop(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch

    from profiler.api import batches_from, profile_job
    from tests._scripts import load_script

    rank = ray.train.get_context().get_world_rank()
    out: dict[str, Any] = {"world": ray.train.get_context().get_world_size(), "t_start": time.time()}
    out["unweighted"] = unweighted_step(config["twin_plan"])
    stock = load_script(str(REPO / "examples" / "ray_stock.py"), "ray_stock_example")
    planned = load_script(str(REPO / "examples" / "ray_planned.py"), "ray_planned_example")
    args = ["--epochs", "1", "--num-samples", "64"]
    out["stock"] = stock.train(vars(stock.get_args_parser().parse_args([*args, "--batch-size", "8"])))
    out["planned"] = planned.train(
        vars(planned.get_args_parser().parse_args([*args, "--plan", config["example_plan"]])))
    out["t_examples"] = time.time()
    # Why the planned loader carries a DistributedSampler view: a plain batch_sampler loader comes back from
    # prepare_data_loader re-sampled with batch_size=None, each sample alone handed to the batch collate function.
    from runtime.sampler import HeteroBatchSampler

    bare = torch.utils.data.DataLoader(Indexed(30), batch_sampler=HeteroBatchSampler(30, TWIN_PLAN, rank))
    prepared = ray.train.torch.prepare_data_loader(bare)
    out["unplanned_batch_size"] = prepared.batch_size
    try:
        next(iter(prepared))
        out["unplanned_error"] = None
    except Exception as e:  # KeyError: default_collate took one dict sample for a batch
        out["unplanned_error"] = type(e).__name__
    out["twin"] = twin(config["twin_plan"], weighted=True, log_file=config["log_file"])
    out["scaled"] = twin(config["twin_plan"], weighted=False, scaled=True)
    out["control"] = twin(config["twin_plan"], weighted=False)

    def profile_fn() -> Any:
        data = Indexed(30)
        return profile_job(make_model, batches_from(data), lambda m, b: F.mse_loss(m(b["x"]), b["y"]), "cpu",
                           quick=True, batch_sizes=[2, 4, 8])

    t0 = time.perf_counter()
    out["auto"] = twin(config["one_worker_plan"], weighted=True, profile_fn=profile_fn)
    out["auto"]["seconds"] = time.perf_counter() - t0
    out["auto_none"] = twin(None, weighted=True, profile_fn=profile_fn, global_batch=10, replan=True)
    out["t_end"] = time.time()
    torch.save(out, Path(config["out"]) / f"rank{rank}.pt")


def write_plans(out: Path) -> dict[str, str]:
    import planner

    profile = planner.Profile.load(REPO / "planner" / "examples" / "minimal_profile.json")
    paths = {}
    for name, sizes in (("twin_plan", TWIN_PLAN), ("example_plan", EXAMPLE_PLAN)):
        paths[name] = str(out / f"{name}.json")
        planner.evaluate(profile, sizes, num_workers=[0, 0]).save(paths[name])
    one = profile.to_dict()
    one["ranks"] = one["ranks"][:1]
    paths["one_worker_plan"] = str(out / "one_worker_plan.json")
    planner.evaluate(planner.Profile.from_dict(one), [10], num_workers=[0]).save(paths["one_worker_plan"])
    return paths


def main(out_dir: str, temp: str | None = None) -> int:
    import ray
    import ray.train
    import ray.train.torch

    out = Path(out_dir)
    config = {**write_plans(out), "out": str(out), "log_file": str(out / "run.jsonl")}
    started = time.perf_counter()
    stamps = {"t0": time.time()}
    temp = temp or tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a length limit
    try:
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 1024**2, _temp_dir=temp,
                 log_to_driver=True, configure_logging=False)
        stamps["t_init"] = time.time()
        trainer = ray.train.torch.TorchTrainer(
            loop, train_loop_config=config,
            torch_config=ray.train.torch.TorchConfig(backend="gloo", timeout_s=120),
            scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False),
            run_config=ray.train.RunConfig(storage_path=str(out / "ray_results"), name="ray_test",
                                           failure_config=ray.train.FailureConfig(max_failures=0)))
        trainer.fit()
        stamps["t_fit"] = time.time()
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    stamps["t_shutdown"] = time.time()
    (out / "driver.json").write_text(json.dumps({"seconds": time.perf_counter() - started, **stamps}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report: nothing leaves the machine
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")  # one actor less to start
    os.environ.setdefault("RAY_TRAIN_METRICS_ENABLED", "0")  # no metrics callbacks
    code = main(*sys.argv[1:3])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # Ray is shut down and the results saved: no interpreter teardown (~2 s of CPU after torch)
