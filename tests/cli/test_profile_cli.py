"""`planner profile` end to end on CPU: one process, several local devices, and two ranks under torchrun."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.cli import main
from planner.profile import Profile
from planner.solve import solve
from profiler.loader import usable_cores
from tests._ranks import run_planner


def test_profile_one_cpu_rank_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    rc = main(["profile", "--model", "mlp", "--dataset", "fake", "--device", "cpu", "--quick", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "rank" in printed and f"wrote {out}" in printed
    prof = Profile.load(out)
    (r,) = prof.ranks
    assert r.device == "cpu" and len(r.compute) >= 3
    assert all(p.step_time_s > 0 for p in r.compute)
    assert r.loader is not None and r.loader.sec_per_sample > 0
    assert prof.hosts[0].cpu_cores == usable_cores()
    assert prof.model is not None and prof.model.name == "mlp"
    assert prof.model.num_params is not None and prof.model.grad_bytes == 4 * prof.model.num_params
    assert prof.comm is None  # one rank: nothing to all-reduce
    assert solve(prof, global_batch=256).batch_sizes == (256,)
    assert main(["validate", str(out)]) == 0


def test_profile_several_local_devices_with_emulation(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    rc = main(["profile", "--model", "mlp", "--dataset", "fake", "--devices", "cpu,cpu", "--batch-sizes", "16,64",
               "--quick", "--no-loader", "--emulate-slowdown", "1=2", "--emulate-loader", "1=1", "--out", str(out)])
    assert rc == 0
    prof = Profile.load(out)
    assert [r.rank for r in prof.by_rank] == [0, 1]
    assert [p.batch_size for p in prof.rank(0).compute] == [16, 64]
    assert prof.rank(1).meta["emulate_slowdown"] == 2.0 and prof.rank(1).meta["emulate_loader_workers"] == 1
    assert "emulate_slowdown" not in prof.rank(0).meta
    assert prof.meta["emulate_slowdown"] == {"1": 2.0}


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--model", "nope"], "unknown model"),
        (["--dataset", "cifar10:/does/not/exist"], "does not exist"),
        (["--device", "cuda:7"], "cuda"),
        (["--batch-sizes", "8,x"], "--batch-sizes"),
        (["--emulate-slowdown", "1=0.5"], ">= 1"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--model", "mlp", "--quick", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


@pytest.mark.distributed
def test_torchrun_two_ranks_write_one_profile_with_allreduce(tmp_path: Path) -> None:
    out = tmp_path / "p2.json"
    rc, text = run_planner(2, ["profile", "--model", "mlp", "--dataset", "fake", "--device", "cpu", "--quick",
                                        "--budget-s", "3", "--emulate-slowdown", "1=2", "--out", str(out)])
    assert rc == 0, text[-3000:]
    prof = Profile.load(out)
    assert prof.world_size == 2 and len(prof.hosts) == 1
    assert prof.comm is not None and prof.comm.backend == "gloo" and (prof.comm.allreduce_s or 0) > 0
    assert prof.comm.exposed_s is not None and prof.comm.exposed_s >= 0  # measured DDP steps (profiler.ddp)
    # Measured in 3 rounds, the median kept; the rounds stay in the profile for the quality gate.
    rounds = prof.meta["ddp_overhead_rounds_s"]
    assert len(rounds) == 3 and prof.comm.exposed_s == pytest.approx(sorted(rounds)[1], abs=1e-6)
    assert all(len(r.meta["sweep_spread"]) == len(r.compute) for r in prof.ranks)
    assert prof.rank(1).meta["emulate_slowdown"] == 2.0
    assert all(len(r.compute) >= 3 and r.loader is not None for r in prof.ranks)
    assert json.loads(out.read_text())["meta"]["world_size"] == 2
