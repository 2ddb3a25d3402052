"""A plan knows what it was made for: the model, the profile, each rank's device and host.

A solved plan records them (``Plan.made_for``); the runtime object and the adapters compare them with the run at
start: another model or another profile is refused (``allow_workload_mismatch=True`` warns instead), another
device, host or core count is one warning line, and a plan that records nothing gets one note.  In-process, one
gloo launch for the rank-0-only warning.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

import planner
from planner.errors import ValidationError
from planner.plan import Plan
from runtime.run import PlannedRun
from runtime.sampler import HeteroBatchSampler
from runtime.workload import WorkloadWarning, device_name, host_name, model_fingerprint, usable_cores
from tests._dist import run_distributed


class Small(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(3, width)
        self.bn = nn.BatchNorm1d(width)


class Wrapped(nn.Module):
    """A wrapper keeping the model under ``module`` (as DDP and the profiler's step wrapper do)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.module = model


def _profile(model: nn.Module | None = None, *, device_name_: str | None = None, host: str | None = None,
             cores: int | None = None, ranks: int = 1, per_sample: float = 0.01) -> planner.Profile:
    """Ranks with linear step times; by default on this machine, as the profiler names it."""
    h = host or host_name()
    d: dict[str, Any] = {
        "version": 1, "kind": "profile", "hosts": [{"name": h, "cpu_cores": cores or usable_cores()}],
        "ranks": [{"rank": r, "host": h, "device": "cpu", "device_name": device_name_ or device_name("cpu"),
                   "compute": [{"batch_size": b, "step_time_s": per_sample * (r + 1) * b} for b in (2, 8, 16)]}
                  for r in range(ranks)]}
    if model is not None:
        d["model"] = {"name": "small", "num_params": sum(p.numel() for p in model.parameters()),
                      "structure": model_fingerprint(model)}
    return planner.Profile.from_dict(d)


def _workload_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, WorkloadWarning)]


def _start(run: PlannedRun, model: nn.Module | None = None) -> list[str]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run.sampler_for(32, "cpu")
        if model is not None:
            run.watch(model)
    return _workload_warnings(record)


def test_a_solved_plan_records_its_model_profile_and_ranks() -> None:
    model = Small()
    profile = _profile(model, device_name_="NVIDIA H200", host="gpu-node", cores=16, ranks=2)
    plan = planner.solve(profile, global_batch=16)
    made = plan.made_for
    assert made["profile_fingerprint"] == profile.fingerprint()
    assert made["model"] == {"name": "small", "num_params": 4 * 3 + 4 + 8, "structure": model_fingerprint(model)}
    assert made["ranks"] == [{"rank": r, "device": "cpu", "device_name": "NVIDIA H200", "host": "gpu-node",
                              "cpu_cores": 16} for r in range(2)]
    again = Plan.from_dict(plan.to_dict())
    assert again.made_for == made
    # Not part of the fingerprint: an older plan of the same split hashes the same.
    assert replace(plan, made_for={}).fingerprint == plan.fingerprint


def test_an_older_plan_loads_and_gets_one_note_that_it_cannot_be_checked() -> None:
    d = planner.solve(_profile(Small()), global_batch=8).to_dict()
    del d["made_for"]
    plan = Plan.from_dict(d)
    assert plan.made_for == {}
    said = _start(PlannedRun(plan), Small(width=9))  # another model: nothing recorded to refuse it with
    assert len(said) == 1 and "cannot be checked" in said[0]


def test_an_older_plan_is_checked_against_the_profile_given() -> None:
    model = Small()
    profile = _profile(model)
    d = planner.solve(profile, global_batch=8).to_dict()
    del d["made_for"]
    run = PlannedRun(Plan.from_dict(d), profile=profile)
    with pytest.raises(ValidationError, match="another model"):
        _start(run, Small(width=9))


def test_a_malformed_made_for_is_refused_at_load() -> None:
    d = planner.solve(_profile(Small(), ranks=2), global_batch=8).to_dict()
    bad = {**d, "made_for": {**d["made_for"], "ranks": d["made_for"]["ranks"][:1]}}
    with pytest.raises(ValidationError, match=r"made_for\.ranks"):
        Plan.from_dict(bad)
    bad = {**d, "made_for": {**d["made_for"], "model": {"num_params": "many"}}}
    with pytest.raises(ValidationError, match=r"made_for\.model\.num_params"):
        Plan.from_dict(bad)


def test_a_plan_made_for_another_model_is_refused_at_start() -> None:
    plan = planner.solve(_profile(Small()), global_batch=8)
    with pytest.raises(ValidationError, match=r"another model .*allow_workload_mismatch=True") as e:
        _start(PlannedRun(plan), Small(width=5))
    assert "\n" not in str(e.value)
    # The same structure passes, under a wrapper too and with other weights.
    assert _start(PlannedRun(plan), Wrapped(Small())) == []
    compiled = nn.Module()
    compiled._orig_mod = Small()  # where torch.compile keeps the model (torch._dynamo.OptimizedModule)
    assert model_fingerprint(compiled) == model_fingerprint(Small())
    # The escape hatch: one warning instead, and the run goes on.
    said = _start(PlannedRun(plan, allow_workload_mismatch=True), Small(width=5))
    assert len(said) == 1 and "another model" in said[0]


def test_a_plan_recording_only_a_parameter_count_refuses_another_count() -> None:
    d = planner.solve(_profile(Small()), global_batch=8).to_dict()
    del d["made_for"]["model"]["structure"]
    with pytest.raises(ValidationError, match="a model of 24 parameters, this run trains one of 36"):
        _start(PlannedRun(Plan.from_dict(d)), Small(width=6))


def test_register_weighting_checks_the_model_too() -> None:
    plan = planner.solve(_profile(Small()), global_batch=8)
    run = PlannedRun(plan)
    run.sampler_for(32, "cpu")
    with pytest.raises(ValidationError, match="another model"):
        run.register_weighting(Small(width=5))  # type: ignore[arg-type]  # refused before any DDP is needed


def test_a_plan_not_solved_from_the_given_profile_is_refused() -> None:
    made_from = _profile(Small(), per_sample=0.01)
    other = _profile(Small(), per_sample=0.02)
    plan = planner.solve(made_from, global_batch=8)
    with pytest.raises(ValidationError, match=f"another profile \\(fingerprint {plan.made_for['profile_fingerprint']}"
                                              f"\\) than the one given \\({other.fingerprint()}\\)"):
        PlannedRun(plan, profile=other)
    assert _start(PlannedRun(plan, profile=made_from), Small()) == []
    with pytest.warns(WorkloadWarning, match="another profile"):
        PlannedRun(plan, profile=other, allow_workload_mismatch=True)


def test_a_plan_for_another_world_size_is_refused() -> None:
    plan = planner.solve(_profile(Small(), ranks=2), global_batch=8)
    with pytest.raises(ValidationError, match=r"for 2 rank\(s\) but 1 were launched"):
        PlannedRun(plan).sampler_for(32, "cpu")


def test_another_machine_is_one_warning_and_the_run_goes_on() -> None:
    plan = planner.solve(_profile(Small(), device_name_="NVIDIA H200", host="gpu-node", cores=usable_cores() + 14),
                         global_batch=8)
    run = PlannedRun(plan)
    said = _start(run, Small())
    assert len(said) == 1
    line = said[0]
    assert f"rank 0 runs on {device_name('cpu')} (plan: NVIDIA H200)" in line
    assert f"host {host_name()} (plan: gpu-node)" in line and "re-profile" in line
    assert run.sampler is not None  # trained on, with the warning


def test_other_core_counts_are_warned() -> None:
    plan = planner.solve(_profile(Small(), cores=usable_cores() + 14), global_batch=8)
    said = _start(PlannedRun(plan), Small())
    assert said == [f"the plan's speed model was measured on other hardware: host {host_name()} has "
                    f"{usable_cores()} usable cores (plan: {usable_cores() + 14}); its split may not balance this "
                    "run -- re-profile on this machine and re-plan"]


def test_the_profiler_records_the_structure_a_run_compares() -> None:
    from profiler.api import profile_job

    model = Small()

    def loss_fn(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        inner = m.module if isinstance(m, nn.parallel.DistributedDataParallel) else m
        return inner.bn(inner.fc(batch)).square().mean()  # type: ignore[operator]

    profile = profile_job(model, lambda b: torch.randn(b, 3), loss_fn, "cpu", batch_sizes=[2, 4], min_batch=2,
                          quick=True)
    assert profile.model is not None and profile.model.structure == model_fingerprint(model)
    plan = planner.solve(profile, global_batch=4, min_batch=2)
    assert _start(PlannedRun(plan, profile=profile), model) == []  # the profiled machine and model: silent
    with pytest.raises(ValidationError, match="another model"):
        _start(PlannedRun(plan, profile=profile), Small(width=5))


def test_lightning_plan_refuses_a_plan_from_another_profile() -> None:
    pytest.importorskip("lightning")
    from runtime.adapters.lightning import LightningPlan

    plan = planner.solve(_profile(Small(), per_sample=0.01), global_batch=8)
    with pytest.raises(ValidationError, match="another profile"):
        LightningPlan(plan, profile=_profile(Small(), per_sample=0.02), package="lightning.pytorch")
    with pytest.warns(WorkloadWarning, match="another profile"):
        LightningPlan(plan, profile=_profile(Small(), per_sample=0.02), package="lightning.pytorch",
                      allow_workload_mismatch=True)


def test_lightning_loader_refuses_another_model() -> None:
    pytest.importorskip("lightning")
    from runtime.adapters.lightning import LightningPlan

    plan = planner.solve(_profile(Small()), global_batch=8)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 3)), shuffle=True)
    with pytest.raises(ValidationError, match="another model"):
        LightningPlan(plan, package="lightning.pytorch").planned_loader(loader, torch.device("cpu"), Small(width=5))


def test_hf_trainer_refuses_another_model(tmp_path: Any) -> None:
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from runtime.adapters.hf import planned_trainer

    plan = planner.solve(_profile(Small()), global_batch=8)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no",
                             disable_tqdm=True)
    trainer = planned_trainer(plan, model=Small(width=5), args=args,
                              train_dataset=torch.utils.data.TensorDataset(torch.randn(32, 3)))
    with pytest.raises(ValidationError, match="another model"):
        trainer.get_train_dataloader()


def test_accelerate_loader_refuses_another_model() -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from runtime.adapters.accelerate import planned_dataloader

    plan = planner.solve(_profile(Small()), global_batch=8)
    data = torch.utils.data.TensorDataset(torch.randn(32, 3))
    with pytest.raises(ValidationError, match="another model"):
        planned_dataloader(Accelerator(cpu=True), plan, data, model=Small(width=5), shuffle=True)
    with pytest.warns(WorkloadWarning, match="another model"):
        planned_dataloader(Accelerator(cpu=True), plan, data, model=Small(width=5), shuffle=True,
                           allow_workload_mismatch=True)


def _two_cpu_ranks(rank: int, world_size: int, plan: Plan) -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run = PlannedRun(plan)
        run.sampler_for(64, "cpu")
        run.watch(nn.parallel.DistributedDataParallel(Small()))  # the model the plan was made for, inside DDP
    said = _workload_warnings(record)
    if rank == 0:
        assert len(said) == 1, said
        assert "rank 0 runs on" in said[0] and "rank 1 runs on" in said[0] and "(plan: NVIDIA H200)" in said[0]
    else:
        assert said == []


@pytest.mark.distributed
def test_a_profile_of_two_gpus_on_two_cpu_ranks_is_warned_once_on_rank_0() -> None:
    """The profile of another machine (2 CUDA GPUs, 16 cores) used on 2 CPU ranks: one line, rank 0 only."""
    plan = planner.solve(_profile(Small(), device_name_="NVIDIA H200", cores=16, ranks=2), global_batch=16)
    run_distributed(_two_cpu_ranks, 2, plan, timeout_s=60)


def test_a_replanned_plan_keeps_what_the_run_was_made_for() -> None:
    """A re-plan is solved from the profile corrected by measured steps; the plan in force (what a checkpoint
    saves) still names the run's profile, so a resume against that profile is not refused."""
    from runtime.replan.decision import ReplanDecision

    profile = _profile(Small(), ranks=2)
    plan = planner.solve(profile, global_batch=16)
    corrected = profile.with_compute_times(lambda rank, b, t: t * (3.0 if rank == 1 else 1.0))
    new = planner.solve(corrected, global_batch=16)
    assert new.made_for["profile_fingerprint"] != plan.made_for["profile_fingerprint"]
    run = PlannedRun(plan, profile=profile)
    run.sampler = run.batch_sampler = HeteroBatchSampler.from_plan(plan, 0, 64)  # as sampler_for builds it
    run._apply(ReplanDecision(epoch=0, adopted=True, reason="faster", old_plan=plan, new_plan=new,
                              predicted_gain=0.2, measured_compute_s=(0.1, 0.3), predicted_compute_s=(0.1, 0.1)))
    assert run.plan.batch_sizes == new.batch_sizes and run.plan.made_for == plan.made_for
    PlannedRun(run.plan, profile=profile)  # the resume: not refused


def test_planner_train_refuses_a_from_batches_plan_of_another_profile(tmp_path: Any,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`planner plan --from-batches` records no solver fingerprint; its made_for still names the profile."""
    import json
    from pathlib import Path

    from planner.cli import main

    noisy = Path(__file__).resolve().parents[1] / "data" / "noisy_cpu_profile.json"
    plan = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(noisy), "--global-batch", "64", "--from-batches", "40,24",
                 "--out", str(plan)]) == 0
    other = tmp_path / "other.json"
    prof = json.loads(noisy.read_text())
    prof["ranks"][1]["compute"][0]["step_time_s"] *= 2
    other.write_text(json.dumps(prof))
    capsys.readouterr()
    rc = main(["train", "--plan", str(plan), "--profile", str(other), "--device", "cpu", "--model", "cifar_cnn"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "the plan was solved from another profile" in err, err
