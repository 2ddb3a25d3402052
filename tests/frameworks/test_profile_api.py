"""profiler.api profiles any training step (dict batches, the user's loss and optimizer) like `planner profile`.

In-process on CPU: a dict-batch model's RankProfile (compute curve from the shared sweep, loader cost through the
user's collate function, the user's model untouched) plans; batch structures move to the device; a bad loss is
one clear error.  profiler.lightning profiles a LightningModule's training_step.  (On 2 gloo ranks
``profile_job`` gives every rank the same gathered Profile: tests/frameworks/test_accelerate.py, whose launch
profiles before it trains.)  And hosts are named by PLANNER_HOST_ID, else by host name and torchrun node.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest
import torch

import planner
from planner.errors import ValidationError
from profiler import inventory
from profiler.api import batches_from, local_profile, profile_step, to_device
from profiler.loader import LoaderOptions
from tests.frameworks._common import DictData, dict_loss, make_net, make_optimizer

FAST_LOADER = LoaderOptions(num_samples=32, chunk=8, budget_s=0.3, scaling_s=0.2, max_workers=1)


def test_a_dict_batch_step_is_profiled_and_planned_without_touching_the_model() -> None:
    model, data = make_net(), DictData(64)
    before = [p.detach().clone() for p in model.parameters()]
    seen: list[Any] = []

    def loss_fn(m: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        seen.append(type(batch))
        return dict_loss(m, batch)

    rp = profile_step(model, batches_from(data), loss_fn, "cpu", optimizer_fn=make_optimizer, data=data,
                      quick=True, batch_sizes=[4, 8, 16], loader=FAST_LOADER)
    assert seen and all(t is dict for t in seen)  # the loss saw the dataset's own dict batches
    assert [p.batch_size for p in rp.compute] == [4, 8, 16] and all(p.step_time_s > 0 for p in rp.compute)
    assert rp.loader is not None and rp.loader.sec_per_sample > 0 and rp.loader.scaling  # via the dict collate
    assert rp.memory is None and rp.meta["step"] == "user" and rp.meta["num_params"] == 16 * 9 + 17
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    profile = local_profile([rp, planner.RankProfile(**{**{f: getattr(rp, f) for f in rp.__slots__}, "rank": 1})])
    plan = planner.solve(profile, global_batch=32)
    assert plan.world_size == 2 and sum(plan.batch_sizes) == 32


def test_batches_of_any_structure_move_to_the_device() -> None:
    Pair = namedtuple("Pair", "a b")
    batch = {"x": torch.ones(2), "nested": [Pair(torch.zeros(1), "label"), (torch.ones(3),)], "n": 3}
    moved = to_device(batch, torch.device("meta"))
    assert moved["x"].device.type == "meta" and moved["n"] == 3
    assert isinstance(moved["nested"][0], Pair) and moved["nested"][0].a.device.type == "meta"
    assert moved["nested"][0].b == "label" and moved["nested"][1][0].device.type == "meta"
    # batches_from cycles a short dataset and collates like the DataLoader would
    assert batches_from(DictData(3))(5)["x"].shape == (5, 8)


def test_a_loss_that_is_not_a_scalar_is_one_clear_error() -> None:
    with pytest.raises(ValidationError, match="scalar tensor"):
        profile_step(make_net(), batches_from(DictData(8)), lambda m, b: m(b["x"]), "cpu", batch_sizes=[4],
                     quick=True)


def test_a_lightning_module_step_is_profiled_and_planned(tmp_path: Any) -> None:
    L = pytest.importorskip("lightning")
    from profiler.lightning import auto_plan

    class Module(L.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
            loss = dict_loss(self.net, batch)
            self.log("loss", loss)  # no Trainer while profiling: must not disturb it
            return {"loss": loss}

        def configure_optimizers(self) -> Any:
            return {"optimizer": torch.optim.Adam(self.parameters(), lr=1e-3)}

    module = Module()
    before = [p.detach().clone() for p in module.parameters()]
    plan, profile = auto_plan(module, DictData(64), global_batch=16, device="cpu", quick=True, batch_sizes=[4, 8],
                              loader=FAST_LOADER, plan_out=tmp_path / "plan.json")
    assert plan.batch_sizes == (16,) and planner.Plan.load(tmp_path / "plan.json").fingerprint == plan.fingerprint
    assert profile.model is not None and profile.model.name == "Module" and profile.ranks[0].meta["step"] == "user"
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))


def test_hosts_are_named_by_override_then_by_torchrun_node(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("PLANNER_HOST_ID", "GROUP_RANK", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    machine = inventory.machine_name()
    assert inventory.host_name() == machine  # one node: the host name, as before
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    monkeypatch.setenv("GROUP_RANK", "0")
    assert inventory.host_name() == machine
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_RANK", "1")
    assert inventory.host_name() == f"{machine}/node1"  # containers with one host name on two nodes differ
    monkeypatch.setenv("PLANNER_HOST_ID", "rack3-box7")
    assert inventory.host_name() == "rack3-box7" and inventory.host_profile().name == "rack3-box7"
