"""Ray Train: the planned loader, exact weighting and auto re-planning on a local Ray cluster of 2 CPU workers.

One launch (tests/frameworks/_ray_driver.py: ``ray.init(num_cpus=2, include_dashboard=False)``, one
``TorchTrainer.fit`` on 2 gloo workers, ``ray.shutdown()`` in a ``finally``) in its own process group, killed
past a deadline; every assert below reads what its workers saved:

  * examples/ray_planned.py is examples/ray_stock.py plus the documented diff, and both train;
  * a planned loader without ``model=`` and without the loss scale is refused at its first backward on both
    workers (Ray's training thread runs the check), with the line naming both fixes;
  * float64: a [7, 3] plan through Ray's own ``prepare_model`` / ``prepare_data_loader`` equals one process on the
    same 10 samples per step; the same batches under DDP's plain average do not (the test can fail);
  * a plan for 1 worker handed to a 2-worker group with ``profile_fn`` is re-profiled and re-planned for 2.

Without Ray (fake ``ray.train``): a missing Ray and a plan for another worker count are one-line errors.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from planner.errors import ValidationError
from tests.frameworks._common import REPO, max_diff
from tests.frameworks.test_examples import documented_diff
from tests.runtime.test_adopting import apply_diff, changed_lines

DRIVER = Path(__file__).with_name("_ray_driver.py")
DEADLINE_S = 300


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (the driver's, started with start_new_session: Ray's gcs, raylet
    and agents share its process group, its workers each have their own group in the same session)."""
    import psutil

    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                os.kill(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the driver once (module scope: one Ray start for every test here); its process group is killed after."""
    pytest.importorskip("ray.train.torch")  # `make test` installs it (the `all` extra)
    out = tmp_path_factory.mktemp("ray")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "RAY_USAGE_STATS_ENABLED": "0"}
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's session files; short (socket paths are limited)
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(DRIVER), str(out), temp], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        log, _ = proc.communicate()
        pytest.fail(f"the Ray run passed its {DEADLINE_S} s deadline:\n{log[-4000:]}")
    finally:
        kill_session(proc.pid)  # whatever of the run is left: the driver's session, Ray's daemons and workers
        shutil.rmtree(temp, ignore_errors=True)
    assert proc.returncode == 0, log[-6000:]
    ranks = {r: torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)}
    return {"out": out, "ranks": ranks, "seconds": time.perf_counter() - started,
            "driver": json.loads((out / "driver.json").read_text())}


def test_documented_diff_turns_the_stock_example_into_the_planned_one() -> None:
    diff = documented_diff("ray")
    assert changed_lines(diff) <= 5
    stock = (REPO / "examples" / "ray_stock.py").read_text()
    assert "runtime" not in stock and "planner" not in stock.split('"""', 2)[2]  # stock uses nothing of ours
    assert apply_diff(stock, diff) == (REPO / "examples" / "ray_planned.py").read_text()


@pytest.mark.slow
@pytest.mark.subprocess  # the Ray run: interpreters, tens of seconds
def test_stock_and_planned_examples_train_on_two_workers(ray_run: dict[str, Any]) -> None:
    steps = 64 // 16  # 1 epoch of 64 samples, global batch 16
    for rank, res in ray_run["ranks"].items():
        assert res["world"] == 2
        assert res["stock"]["batch_sizes"] == [8] * steps  # DistributedSampler: 32 samples a worker an epoch
        assert res["planned"]["batch_sizes"] == [(12, 4)[rank]] * steps  # the plan survived prepare_data_loader
    for which in ("stock", "planned"):  # DDP kept the replicas identical
        a, b = ray_run["ranks"][0][which]["params"], ray_run["ranks"][1][which]["params"]
        assert max_diff(a, b) == 0


def one_process(seen: list[list[list[int]]]) -> list[torch.Tensor]:
    """SGD in one process, step s on every worker's samples of step s together (mean loss over all of them)."""
    from tests.frameworks._ray_driver import Indexed, make_model

    data, model = Indexed(30), make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for step in zip(*seen, strict=True):
        batch = [data[i] for part in step for i in part]
        x, y = torch.stack([b["x"] for b in batch]), torch.stack([b["y"] for b in batch])
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.subprocess  # the Ray run: interpreters, tens of seconds
def test_planned_twin_equals_one_process_and_plain_averaging_does_not(ray_run: dict[str, Any]) -> None:
    from runtime.sampler import epoch_permutation

    # A plain batch_sampler loader does not survive: Ray re-samples it with batch_size=None and the batch collate
    # function gets one dict sample at a time.
    assert ray_run["ranks"][0]["unplanned_batch_size"] is None
    assert ray_run["ranks"][0]["unplanned_error"] == "KeyError"
    twin = [ray_run["ranks"][r]["twin"] for r in range(2)]
    assert twin[0]["loader_type"] == "_WrappedDataLoader"  # Ray wrapped it (device placement) ...
    assert twin[0]["sampler_type"] == "PlannedIndices"  # ... and kept the planned sampler
    assert [len(s) for s in twin[0]["seen"]] == [7, 7, 7] and [len(s) for s in twin[1]["seen"]] == [3, 3, 3]
    perm = epoch_permutation(30, 0).tolist()  # every sample once, global step s = P[10s:10s+10]
    for s in range(3):
        assert sorted(twin[0]["seen"][s] + twin[1]["seen"][s]) == sorted(perm[10 * s:10 * s + 10])
    reference = one_process([t["seen"] for t in twin])
    assert max_diff(twin[0]["params"], reference) < 1e-12
    assert max_diff(twin[1]["params"], reference) < 1e-12
    assert max_diff(ray_run["ranks"][0]["scaled"]["params"], reference) < 1e-12  # loss_scale instead of the hook
    control = [ray_run["ranks"][r]["control"] for r in range(2)]
    assert control[0]["seen"] == twin[0]["seen"]  # the same batches ...
    assert max_diff(control[0]["params"], reference) > 1e-4  # ... under DDP's plain average: not the true gradient


@pytest.mark.slow
@pytest.mark.subprocess  # the Ray run: interpreters, tens of seconds
def test_a_loop_that_weights_nothing_is_refused_at_its_first_backward_on_every_worker(ray_run: dict[str, Any]) -> None:
    for rank, res in ray_run["ranks"].items():
        error = res["unweighted"]
        assert error is not None, f"worker {rank} trained an uneven plan with DDP's plain average"
        assert error.startswith("the plan gives the ranks [7, 3] samples a step, but nothing weights"), error
        assert error.endswith("; pass model= (the model ray.train.torch.prepare_model returned) to planned_dataloader, "
                              "or multiply the loss by loader.sampler.planned.loss_scale(step)"), error


@pytest.mark.slow
@pytest.mark.subprocess  # the Ray run: interpreters, tens of seconds
def test_run_log_comes_from_the_planned_run(ray_run: dict[str, Any]) -> None:
    records = [json.loads(line) for line in (ray_run["out"] / "run.jsonl").read_text().splitlines()]
    kinds = [r["event"] for r in records]
    assert kinds == ["start", "epoch", "end"], kinds  # world rank 0 alone writes it
    epoch = records[1]
    assert epoch["batch_sizes"] == [7, 3]


@pytest.mark.slow
@pytest.mark.subprocess  # the Ray run: interpreters, tens of seconds
def test_a_plan_for_another_worker_count_is_re_profiled_and_re_planned(ray_run: dict[str, Any]) -> None:
    auto = [ray_run["ranks"][r]["auto"] for r in range(2)]
    for rank, res in enumerate(auto):
        assert res["replanned_for_world"] == 2  # the plan was for 1 worker
        assert len(res["plan"]) == 2 and sum(res["plan"]) == 10  # re-planned for 2 at the plan's global batch
        assert {len(s) for s in res["seen"][:-1]} == {res["plan"][rank]}
    assert auto[0]["plan"] == auto[1]["plan"]
    assert max_diff(auto[0]["params"], one_process([a["seen"] for a in auto])) < 1e-12
    fresh = [ray_run["ranks"][r]["auto_none"] for r in range(2)]  # auto mode: no plan at all
    assert fresh[0]["replanned_for_world"] is None and fresh[0]["plan"] == fresh[1]["plan"]
    assert len(fresh[0]["plan"]) == 2 and sum(fresh[0]["plan"]) == 10
    assert max_diff(fresh[1]["params"], one_process([a["seen"] for a in fresh])) < 1e-12



# -- without Ray: the one-line errors ------------------------------------------------------------------------------

def fake_ray_train(world_size: int) -> Any:
    """What RayPlan reads of ``ray.train`` in a worker: the world size and the device."""
    context = types.SimpleNamespace(get_world_size=lambda: world_size)
    return types.SimpleNamespace(get_context=lambda: context,
                                 torch=types.SimpleNamespace(get_device=lambda: torch.device("cpu")))


def test_a_missing_ray_is_one_line_naming_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.adapters import ray as adapter

    for name in ("ray", "ray.train", "ray.train.torch"):  # import ray.train -> ImportError, imported before or not
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ValidationError, match=r"^Ray Train is not installed: pip install 'ddp-planner\[ray\]'$"):
        adapter.RayPlan(None, shuffle=True)


def test_a_plan_for_another_worker_count_without_profile_fn_names_both_fixes(monkeypatch: pytest.MonkeyPatch,
                                                                              tmp_path: Path) -> None:
    import planner
    from runtime.adapters import ray as adapter

    monkeypatch.setattr(adapter, "_ray_train", lambda: fake_ray_train(3))
    profile = planner.Profile.load(REPO / "planner" / "examples" / "minimal_profile.json")
    plan = planner.evaluate(profile, [7, 3], num_workers=[0, 0])
    with pytest.raises(ValidationError, match=r"the plan is for 2 worker\(s\) but Ray started 3; pass profile_fn="):
        adapter.RayPlan(plan, shuffle=True)
    with pytest.raises(ValidationError, match="pass shuffle=True or shuffle=False"):
        adapter.RayPlan(plan)
    with pytest.raises(ValidationError, match="needs a plan, or profile_fn="):
        adapter.RayPlan(None, shuffle=True)


def test_a_ray_loop_that_never_advances_the_epoch_is_refused_with_rays_own_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """``for batch in loader`` every epoch, without planned_epoch or loader.sampler.set_epoch: the second whole pass
    of epoch 0 is refused at its first batch, naming Ray's two ways of advancing the epoch."""
    import planner
    from runtime.adapters import ray as adapter

    monkeypatch.setattr(adapter, "_ray_train", lambda: fake_ray_train(1))
    one = planner.Profile.load(REPO / "planner" / "examples" / "minimal_profile.json").to_dict()
    one["ranks"] = one["ranks"][:1]
    plan = planner.evaluate(planner.Profile.from_dict(one), [4], num_workers=[0])
    loader = adapter.planned_dataloader(plan, list(range(10)), shuffle=True)
    assert sum(len(batch) for batch in loader) == 10  # epoch 0
    with pytest.raises(ValidationError) as info:
        next(iter(loader))
    assert str(info.value).endswith("; iterate `for batch in planned_epoch(loader, epoch)`, or call "
                                    "loader.sampler.set_epoch(epoch) before each epoch's `for batch in loader`")
    loader.sampler.set_epoch(1)  # the stock line: epoch 1 trains
    assert sum(len(batch) for batch in loader) == 10


def test_the_planned_loader_looks_distributed_to_ray_and_its_view_moves_nothing() -> None:
    """prepare_data_loader keeps a loader whose ``sampler`` is a DistributedSampler; the view lists this rank's
    planned indices without starting a pass of the planned sampler (the weighting hook counts passes)."""
    from torch.utils.data import DistributedSampler

    from runtime.adapters.ray import PlannedDataLoader
    from runtime.sampler import HeteroBatchSampler

    sampler = HeteroBatchSampler(30, [7, 3], 1, seed=0)
    loader = PlannedDataLoader(list(range(30)), sampler, planned=None)  # type: ignore[arg-type]
    view = loader.sampler
    assert isinstance(view, DistributedSampler) and loader.batch_size is None
    loader.sampler.set_epoch(2)
    generation = sampler.generation
    indices = list(view)
    assert len(view) == len(indices) == 9 and sampler.generation == generation
    assert [i for batch in loader for i in batch.tolist()] == indices  # the loader draws the same, from the batch sampler
