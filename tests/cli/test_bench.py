"""`planner bench` on 2 gloo ranks: every strategy is run and timed alike, and "equal" is what users run today.

One small launch (mlp, global batch 16, 4 steps per epoch, 2 interleaved rounds, rank 1 emulated 2x slower) is
shared by the tests; they read what the ranks recorded about each strategy's run (planner/cli/bench_window.py), not
what the code intends.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from planner.cli import main
from planner.cli.progress import DEFAULT_INTERVAL_S

COMPARED = ("equal", "proportional", "plan")
"""Strategies run in the interleaved rounds; plan+replan runs once after them, over more epochs on purpose."""
ROUNDS, STEPS, B = 2, 4, 16


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The shared launch; its ranks' stderr (file descriptor 2, where rank 0's progress lines go) is kept as
    ``"stderr"`` beside what the JSON holds."""
    tmp = tmp_path_factory.mktemp("bench")
    out, err_path = tmp / "bench.json", tmp / "stderr.txt"
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(err_path, "wb") as err:
            os.dup2(err.fileno(), 2)  # the spawned ranks inherit it
            rc = main(["bench", "--device", "cpu", "--nproc", "2", "--model", "mlp", "--quick", "--global-batch",
                       str(B), "--steps", str(STEPS), "--rounds", str(ROUNDS), "--replan-epochs", "2",
                       "--emulate-slowdown", "1=2", "--timeout", "150", "--json", str(out)])
            sys.stderr.flush()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    stderr = err_path.read_text(errors="replace")
    assert rc == 0, stderr[-3000:]
    return {**json.loads(out.read_text()), "stderr": stderr}


@pytest.mark.subprocess
def test_bench_reports_every_phase(bench: dict[str, Any]) -> None:
    """Progress lines (tests/cli/test_progress.py): rank 0 says each phase of the profile and of every strategy's
    run, and consecutive lines are never more than twice the heartbeat's interval apart."""
    from tests.cli.test_progress import _lines, _max_gap_s

    lines = _lines(bench["stderr"], "bench")
    texts = [t for _, t in lines]
    assert "profile: rank 0 (cpu): compute sweep (budget 6 s)" in texts
    assert any(t.startswith("profile: DDP cost: 3 rounds") for t in texts)
    n = len(COMPARED) + 1
    for r in range(1, ROUNDS + 1):
        for k, name in enumerate(COMPARED, 1):
            assert any(t.startswith(f"round {r}/{ROUNDS}: strategy {name} ({k}/{n}, batches [")
                       and f"epoch 1: {STEPS} steps of {B} samples" in t for t in texts), texts
    assert any(t.startswith(f"strategy plan+replan ({n}/{n}): epoch 1: {STEPS} steps of {B} samples")
               for t in texts), texts
    assert any(t.startswith("ideal (each rank alone") for t in texts)
    assert _max_gap_s(lines) <= 2 * DEFAULT_INTERVAL_S


@pytest.mark.subprocess
def test_every_strategy_runs_the_same_steps_warmup_batch_and_emulation(bench: dict[str, Any]) -> None:
    setups = {name: bench[name]["setup"] for name in COMPARED}
    same = ("global_batch", "steps_per_epoch", "epochs", "amp", "data_on_device", "slowdown")
    for key in same:
        assert len({json.dumps(s[key]) for s in setups.values()}) == 1, (key, setups)
    assert setups["plan"]["global_batch"] == B and setups["plan"]["steps_per_epoch"] == STEPS
    assert setups["plan"]["slowdown"][1][0] == 2.0 and setups["plan"]["slowdown"][0][0] == 1.0  # rank 1 only
    windows = [w for name in COMPARED for w in bench[name]["rounds_window"]]
    assert len(windows) == ROUNDS * len(COMPARED)
    # the same warm-up (one epoch and the timed epoch's first step) and the same timed steps, every round
    assert {(w["warmup_epochs"], w["warmup_steps"], w["steps"]) for w in windows} == {(1, 1, STEPS - 1)}
    # each window's unix ends, in run order, span its seconds (what lines it up with benchmarks/hostmon.py)
    for w in windows:
        assert abs((w["unix"][1] - w["unix"][0]) - w["seconds"]) < 0.05, w
    # plan+replan: more epochs (re-planning needs them), the same global batch, steps and emulation
    replan = bench["plan+replan"]
    assert replan["setup"]["global_batch"] == B and replan["window"]["steps"] == STEPS - 1
    assert [r[0] for r in replan["setup"]["slowdown"]] == [1.0, 2.0]


@pytest.mark.subprocess
def test_equal_is_torch_distributed_sampler_with_plain_ddp(bench: dict[str, Any]) -> None:
    eq = bench["equal"]["setup"]
    assert eq["sampler"] == "DistributedSampler" and eq["batch_sampler"] == "BatchSampler"
    assert eq["model"] == "DistributedDataParallel" and eq["comm_hook"] is False and eq["loss_scale"] is False
    assert bench["equal"]["batch_sizes"] == [B // 2, B // 2]
    for name in ("proportional", "plan"):  # the others run the planner's sampler, under the same DDP
        assert bench[name]["setup"]["sampler"] == "HeteroBatchSampler"
        assert bench[name]["setup"]["model"] == "DistributedDataParallel"


@pytest.mark.subprocess
def test_the_timed_window_is_synchronized_at_both_ends_for_every_strategy(bench: dict[str, Any]) -> None:
    for name in (*COMPARED, "plan+replan"):
        windows = bench[name].get("rounds_window") or [bench[name]["window"]]
        for w in windows:
            assert w["start"] == w["end"] == ["device_sync", "barrier"], (name, w)
            assert w["seconds"] > 0
            assert w["samples_per_s"] == pytest.approx(w["steps"] * B / w["seconds"])
        s = bench[name]
        # the reported number is the window's (the median round's), and its step is the window's mean step
        assert s["samples_per_s"] == pytest.approx(s["window"]["samples_per_s"])
        assert s["step_time_s"] == pytest.approx(s["window"]["seconds"] / s["window"]["steps"])
        assert s["predicted_error"] == pytest.approx(s["step_time_s"] / s["predicted_step_time_s"] - 1.0)
    assert len(bench["plan"]["rounds_samples_per_s"]) == ROUNDS


@pytest.mark.subprocess
def test_the_json_records_the_profiles_measured_batches(bench: dict[str, Any]) -> None:
    measured = bench["meta"]["profile_batch_sizes"]
    assert len(measured) == 2 and all(len(m) >= 2 for m in measured)


@pytest.mark.subprocess
def test_the_json_records_the_emulation_mode(bench: dict[str, Any]) -> None:
    """Where the slowed rank's extra passes ran (profiler.workloads.emulate): summarize_bench.py groups launches by it."""
    from profiler.workloads.emulate import Slowdown

    assert bench["meta"]["emulate_mode"] == Slowdown().mode  # "interleave" unless PLANNER_EMULATE_MODE says otherwise


def test_steps_below_two_are_refused_before_any_rank_starts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--device", "cpu", "--nproc", "2", "--model", "mlp", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--steps 1" in err and "Traceback" not in err


@pytest.mark.subprocess
def test_a_rounds_result_feeds_the_summary(bench: dict[str, Any], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    from tests.cli.test_bench_summary import sb

    (tmp_path / "new.json").write_text(json.dumps(bench))
    assert sb.main(["--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    # one row of the compute-skew table: this launch, its rounds, its ratios, its record
    (row,) = [x for x in out.splitlines() if "`new.json`" in x]
    assert f"1 launch x {ROUNDS} rounds" in row and "emulated compute skew 1=2" in row
    assert f"mlp, global batch {B}" in row and row.count("x [") >= 2  # plan and proportional vs DistributedSampler


@pytest.mark.subprocess
def test_a_loader_fed_window_opens_once_the_prefetched_batches_are_spent(tmp_path: Path) -> None:
    """--data loader: one long epoch per strategy, its window opening after planner.cli.steps.loader_drain_steps of the
    most workers of any of its ranks whose predicted loader time is at least half its predicted step
    (planner.cli.bench.window_drain_steps; tests/cli/test_loader_drain.py shows what an earlier window measures)."""
    from planner.cli.steps import loader_drain_steps
    from runtime.timing import worker_cycle

    out = tmp_path / "bench.json"
    rc = main(["bench", "--device", "cpu", "--nproc", "2", "--model", "mlp", "--quick", "--global-batch", str(B),
               "--steps", str(STEPS), "--strategies", "equal,proportional,plan", "--data", "loader",
               "--emulate-loader", "1=1", "--timeout", "150", "--quiet", "--json", str(out),
               "--profile-out", str(tmp_path / "profile.json"), "--gpu-normalize", "on",
               "--step-log", str(tmp_path / "steps_{strategy}_{round}_{rank}.jsonl")])
    assert rc == 0
    res = json.loads(out.read_text())
    # uint8 images from the workers (auto turns this on where every rank is on CUDA), normalized by the device copy
    # in every strategy and in the standalone runs behind "ideal" (a GPU bench crashed there when they did not)
    assert res["meta"]["gpu_normalize"] is True and res["ideal"]["samples_per_s"] > 0
    # --step-log: each strategy's one epoch, per rank, as planner train writes it
    for name in COMPARED:
        for rank in (0, 1):
            (line,) = (tmp_path / f"steps_{name}_1_{rank}.jsonl").read_text().splitlines()
            rec = json.loads(line)
            assert rec["rank"] == rank and len(rec["compute_ms"]) == res[name]["setup"]["steps_per_epoch"]
    # The loader was measured once on the host (rank 0) and shared; the capped rank keeps its own cap.  The loader
    # check (planner.cli.loader_check, 1 s with --quick) then timed each rank's plan loader, and scaled its curve when it
    # moved by over 2%: the profile written is the one the predictions used.
    check = res["meta"]["loader_check"]
    assert check["seconds"] == 1.0 and len(check["measured_s_per_sample"]) == 2
    scale = check["scale"] if check["changed"] else [1.0, 1.0]
    ranks = json.loads((tmp_path / "profile.json").read_text())["ranks"]
    assert [r["meta"]["loader_measured_by_rank"] for r in ranks] == [0, 0]
    assert ranks[0]["loader"]["sec_per_sample"] / scale[0] == pytest.approx(
        ranks[1]["loader"]["sec_per_sample"] / scale[1])
    assert ranks[0]["loader"].get("max_workers") is None and ranks[1]["loader"]["max_workers"] == 1
    assert not Path(f"{out}.partial.json").exists()  # the finished bench replaced its partial file with --json
    for name in COMPARED:
        w, setup = res[name]["window"], res[name]["setup"]
        near = [r["num_workers"] for r in res[name]["ranks"]
                if r["num_workers"] > 0 and r["predicted_loader_s"] >= 0.5 * res[name]["predicted_step_time_s"]]
        drain = loader_drain_steps(max(near)) if near else 1
        cycle = worker_cycle(near, 4 * STEPS)  # whole cycles of those ranks' workers (planner.cli.bench.window_steps)
        steps = -(-STEPS // cycle) * cycle
        assert (w["warmup_epochs"], w["warmup_steps"], w["steps"]) == (0, drain, steps), (name, w)
        assert setup["epochs"] == 1 and setup["steps_per_epoch"] == drain + steps and not setup["data_on_device"]


def test_a_bench_in_progress_keeps_every_strategy_run_in_its_partial_file(tmp_path: Path) -> None:
    """planner.cli.bench.write_partial (called after every strategy run on rank 0): what a bench stopped by a time limit
    leaves -- the runs so far, the plans, the options -- marked incomplete."""
    from planner import equal_split, evaluate
    from planner.cli.bench import partial_path, write_partial
    from planner.cli.bench_options import BenchOptions
    from tests.planner._profiles import linear_profile

    prof = linear_profile([0.001, 0.003])
    runs = {"equal": (evaluate(prof, equal_split(64, 2), method="equal"), None)}
    rounds = {"equal": [{"samples_per_s": 123.0, "window": {"steps": 5}}]}
    path = partial_path(str(tmp_path / "bench.json"))
    write_partial(path, BenchOptions(strategies=("equal", "plan"), global_batch=64, device="cpu"), 4.5, runs, rounds)
    got = json.loads(Path(path).read_text())
    assert got["complete"] is False and got["rounds"] == rounds and got["profile_s"] == 4.5
    assert got["plans"]["equal"]["ranks"][0]["batch_size"] == 32
    assert got["options"]["strategies"] == ["equal", "plan"] and got["options"]["global_batch"] == 64


@pytest.mark.parametrize(("kw", "flag"), [
    ({"nproc": 2, "global_batch": 63}, "--global-batch 63 is not a multiple of 2 ranks"),
    ({"steps": 1}, "--steps 1: the timed window"),
    ({"strategies": ("equal", "fastest")}, "--strategies: unknown 'fastest'"),
    ({"nproc": 2, "emulate_loader": "3=1"}, "--emulate-loader: rank 3 does not exist"),
    ({"nproc": 2, "sweep_slowdown": ("1=2", "2=2")}, "--sweep-slowdown: rank 2 does not exist"),
    ({"data": "disk"}, "--data: unknown 'disk'"),
    ({"timeout_s": 0.0}, "--timeout: must be > 0"),
])
def test_bench_options_are_checked_on_construction(kw: dict[str, Any], flag: str) -> None:
    from planner.cli.bench_options import BenchOptions
    from planner.errors import ValidationError

    with pytest.raises(ValidationError) as e:
        BenchOptions(**kw)
    assert str(e.value).startswith(flag) and "\n" not in str(e.value)


def test_bench_options_resolve_the_device_defaults_once() -> None:
    import argparse

    from planner.cli.bench import add_arguments
    from planner.cli.bench_options import BenchOptions

    p = argparse.ArgumentParser()
    add_arguments(p)
    cpu = BenchOptions.from_args(p.parse_args([]), cuda=False)
    assert (cpu.model, cpu.global_batch, cpu.steps) == ("cifar_cnn", 64, 15)
    gpu = BenchOptions.from_args(p.parse_args(["--steps", "7", "--sweep-slowdown", "1=1;1=3"]), cuda=True)
    assert (gpu.model, gpu.global_batch, gpu.steps) == ("resnet50", 512, 7)
    assert [o.emulate_slowdown for o in gpu.runs()] == ["1=1", "1=3"]


@pytest.mark.subprocess
def test_no_run_of_the_plans_split_is_above_its_ideal(bench: dict[str, Any]) -> None:
    """The ideal is an upper bound: each rank's standalone step is never taken above its step in a run of the same
    split (planner.cli.bench.bounded_ideal), so the plan's "vs ideal" is at most 1."""
    ideal = bench["ideal"]
    assert bench["plan"]["vs_ideal"] <= 1 + 1e-9
    assert all(t <= m for t, m in zip(ideal["standalone_step_time_s"], ideal["measured_standalone_step_time_s"],
                                      strict=True))
    assert all(0 <= i < 2 for i in ideal["bounded_by_run"])
