"""runtime.diagnose: each cause named from constructed StepStats and device states, no alarm on noise or on a
box-wide slowdown, the least-wait rule, the normalized scores on an uneven planned split; PlannedRun prints the one
line on rank 0 of a 2-rank gloo loop slowed inside the step, and the diagnosis adds no clock read per step."""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import planner
from planner.devstate import CpuProcess, DeviceState, GpuProcess
from planner.runlog import EpochRecord, parse_record, read_run_log
from planner.stats import Diagnosis, StepStats
from runtime import PlannedRun
from runtime.diagnose import diagnose, line, normalized_scores
from tests._dist import run_distributed
from tests.runtime._plans import linear_cpu_profile


def st(rank: int, compute: float, *, wait: float = 0.0, step: float | None = None, sigma: float = 0.002,
       n: int = 20, interference: float = 0.0, peer_late: int = 0, batch: int = 16) -> StepStats:
    return StepStats(rank=rank, epoch=3, num_steps=n, batch_size=batch, num_workers=1, data_wait_s=wait,
                     compute_s=compute, step_time_s=step if step is not None else compute + wait + 0.002,
                     compute_s_std=sigma, interference_s=interference, num_peer_late=peer_late)


def host(core: int, other: float = 0.02, **kw: Any) -> DeviceState:
    return DeviceState(cpu_affinity=(core,), cpu_other_cores=other, mem_available_bytes=kw.pop("free", 20 << 30),
                       mem_total_bytes=24 << 30, **kw)


PRED = (0.05, 0.05)


def _one(found: tuple[Diagnosis, ...]) -> Diagnosis:
    assert len(found) == 1, found
    return found[0]


def test_a_compute_slowdown_nothing_explains_is_inside_the_step() -> None:
    d = _one(diagnose([st(0, 0.050, step=0.102), st(1, 0.100)], PRED, [host(0), host(1)]))
    assert (d.rank, d.cause) == (1, "inside-step") and d.error == pytest.approx(1.0)
    assert "not visible to NVML/psutil" in d.evidence


def test_other_processes_on_the_ranks_core_are_a_cpu_cotenant() -> None:
    hog = host(1, other=0.95, cpu_other_processes=(CpuProcess(pid=4242, cpu_cores=0.95, name="python"),))
    d = _one(diagnose([st(0, 0.050, step=0.102), st(1, 0.100)], PRED, [host(0), hog]))
    assert d.cause == "cpu-cotenant" and "pid 4242" in d.evidence


def test_the_same_load_on_both_ranks_cores_explains_nothing() -> None:
    # Another job roaming over the box loads both cores alike: context, not the cause of one rank's slowness.
    d = _one(diagnose([st(0, 0.050, step=0.102), st(1, 0.100)], PRED, [host(0, other=0.6), host(1, other=0.6)]))
    assert d.cause == "inside-step"


def test_a_starved_loader_is_named_when_no_state_explains_it() -> None:
    d = _one(diagnose([st(0, 0.050, step=0.102), st(1, 0.030, wait=0.070)], PRED, [host(0), host(1)]))
    assert d.cause == "loader" and "data wait 70.0 ms" in d.evidence


def test_host_memory_nearly_full_is_memory_pressure() -> None:
    d = _one(diagnose([st(0, 0.050, step=0.102), st(1, 0.100)], PRED, [host(0), host(1, free=1 << 29)]))
    assert d.cause == "memory" and "nearly full" in d.evidence


def test_another_process_on_the_gpu_is_a_gpu_cotenant_and_throttling_is_clocks() -> None:
    gpu = dict(other_processes=(), throttle_reasons=(), sm_clock_mhz=1980, sm_clock_max_mhz=1980)
    shared = {**gpu, "other_processes": (GpuProcess(pid=7, used_bytes=8 << 30, name="train"),)}
    hot = {**gpu, "throttle_reasons": ("hw_slowdown",), "sm_clock_mhz": 1200}
    stats = [st(0, 0.050, step=0.102), st(1, 0.100)]
    assert _one(diagnose(stats, PRED, [host(0, **gpu), host(1, **shared)])).cause == "gpu-cotenant"
    assert _one(diagnose(stats, PRED, [host(0, **gpu), host(1, **hot)])).cause == "clocks"


def test_a_rank_without_peers_is_compared_with_its_own_state_on_plan() -> None:
    on_plan, now = host(0, other=0.02), host(0, other=0.9)
    assert _one(diagnose([st(0, 0.100)], (0.05,), [now], [on_plan])).cause == "cpu-cotenant"
    assert _one(diagnose([st(0, 0.100)], (0.05,), [on_plan], [on_plan])).cause == "inside-step"


@pytest.mark.parametrize("seed", range(5))
def test_no_alarm_on_noise(seed: int) -> None:
    # Per-step noise of 10% of the step over 20 steps: a mean 4% off (within 3 standard errors, and under 5%).
    g = torch.Generator().manual_seed(seed)
    errs = (torch.rand(2, generator=g) * 0.08 - 0.04).tolist()
    stats = [st(r, 0.05 * (1 + e), sigma=0.005) for r, e in enumerate(errs)]
    assert diagnose(stats, PRED, [host(0), host(1)]) == ()


def test_an_excess_within_three_standard_errors_is_noise() -> None:
    # 12% over, but the steps spread 40% of the step over only 5 steps: 3 standard errors are 54%.
    assert diagnose([st(0, 0.05), st(1, 0.056, sigma=0.02, n=5)], PRED) == ()
    assert _one(diagnose([st(0, 0.05), st(1, 0.056, sigma=0.002, n=20)], PRED)).rank == 1


def test_a_box_wide_slowdown_names_no_rank() -> None:
    # Both ranks 40% over their predictions: the machine, not one rank.
    assert diagnose([st(0, 0.07), st(1, 0.071)], PRED, [host(0), host(1)]) == ()


def test_least_wait_rule_names_the_rank_that_waited_least() -> None:
    # A backward-phase straggler: rank 1 reaches the all-reduce last (its step is all its own time); rank 0's span
    # stretched too but it waited 60 ms a step for rank 1 -- its victim.
    culprit = st(1, 0.100, step=0.102)
    victim = st(0, 0.060, step=0.160)
    found = {d.rank: d for d in diagnose([victim, culprit, st(2, 0.05, step=0.16)], (0.05,) * 3)}
    assert found[1].cause == "inside-step"
    assert found[0].cause == "late-peer" and "rank 1 reached the all-reduce last" in found[0].evidence


def test_time_lost_to_late_peers_is_a_late_peer() -> None:
    d = _one(diagnose([st(0, 0.050), st(1, 0.060, interference=0.03, peer_late=8)], PRED))
    assert d.cause == "late-peer"


def _record(batches: tuple[int, ...], predicted: tuple[float, ...], busy: tuple[float, ...]) -> EpochRecord:
    ranks = tuple(st(r, b, batch=n) for r, (n, b) in enumerate(zip(batches, busy, strict=True)))
    return EpochRecord(epoch=3, plan_fingerprint="f", samples_per_s=None, step_time_s=max(busy), loss=None,
                       batch_sizes=batches, predicted_step_time_s=predicted, ranks=ranks)


def test_normalized_scores_flag_no_rank_on_an_uneven_planned_split() -> None:
    # A 3x faster rank given 3x the samples: equal step times, each as predicted -- every score ~1.0, although the
    # raw per-sample speeds differ 3x.
    plan = planner.evaluate(linear_cpu_profile([0.001, 0.003]), [48, 16], num_workers=[0, 0])
    pred = tuple(r.timer_busy_s for r in plan.ranks)
    rec = _record((48, 16), pred, (pred[0] * 1.02, pred[1] * 0.99))
    scores = normalized_scores(rec)
    assert all(s is not None and 0.95 < s < 1.05 for s in scores), scores
    assert diagnose(rec.ranks, rec.predicted_step_time_s) == ()
    slowed = normalized_scores(_record((48, 16), pred, (pred[0], pred[1] * 2)))
    assert slowed[1] == pytest.approx(0.5, rel=1e-3)


def test_the_run_log_keeps_the_diagnosis_and_older_records_load() -> None:
    found = diagnose([st(0, 0.050, step=0.102), st(1, 0.100)], PRED)
    rec = _record((16, 16), PRED, (0.05, 0.1))
    d = {**rec.to_dict(), "diagnosis": [x.to_dict() for x in found]}
    back = parse_record(json.loads(json.dumps(d)))
    assert isinstance(back, EpochRecord) and back.diagnosis == found
    old = rec.to_dict()
    assert "diagnosis" not in old and parse_record(old).diagnosis == ()  # type: ignore[union-attr]
    assert line(3, found).startswith("epoch 3: slow rank 1 100.0 ms a step vs 50.0 ms predicted (+100%): inside-step")


# -- live: PlannedRun ------------------------------------------------------------------------------------------------
class SleepNet(nn.Module):
    """Compute that is a sleep (``base_s`` a step, ``times`` x on the slowed rank): the same on a loaded box."""

    def __init__(self, base_s: float, times: float) -> None:
        super().__init__()
        self.fc, self.sleep_s = nn.Linear(4, 2), base_s * times

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.sleep_s)
        return self.fc(x)


BASE_S = 0.01


def _equal_plan(tmp: Path) -> Path:
    # Predicted 12 ms a step at batch 8 (a sleep of 10 ms and a tiny linear layer measure ~10.5).
    plan = planner.evaluate(linear_cpu_profile([0.0015, 0.0015], sizes=(2, 8, 16)), [8, 8], num_workers=[0, 0])
    plan.save(tmp / "plan.json")
    return tmp / "plan.json"


def slowed_worker(rank: int, world: int, tmp: str) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(160, 4), torch.randint(0, 2, (160,)))
    model = DDP(SleepNet(BASE_S, 5.0 if rank == 1 else 1.0))
    run = PlannedRun(f"{tmp}/plan.json", log_file=f"{tmp}/run.jsonl")
    loader = DataLoader(data, batch_sampler=run.sampler_for(len(data), "cpu"))
    run.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for epoch in range(3):
            for x, y in run.epoch(epoch, loader, last=epoch == 2):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
    Path(f"{tmp}/rank{rank}.out").write_text(out.getvalue())
    dist.barrier()


@pytest.mark.distributed
@pytest.mark.filterwarnings("ignore::runtime.workload.WorkloadWarning")
def test_an_own_loop_prints_one_line_on_rank0_for_a_rank_slowed_inside_the_step(tmp_path: Path) -> None:
    _equal_plan(tmp_path)
    run_distributed(slowed_worker, 2, str(tmp_path), timeout_s=120)
    lines = [x for x in (tmp_path / "rank0.out").read_text().splitlines() if "slow" in x]
    # Every epoch prints one line naming rank 1 (no loader fills a pipeline here: each epoch is judged).
    assert [x.split(":")[0] for x in lines] == ["epoch 0", "epoch 1", "epoch 2"], lines
    assert all("slow rank 1 " in x and "inside-step" in x and "rank 0" not in x for x in lines), lines
    assert "slow" not in (tmp_path / "rank1.out").read_text()
    log = read_run_log(tmp_path / "run.jsonl")
    assert [[(d.rank, d.cause) for d in e.diagnosis] for e in log.epochs] == [[(1, "inside-step")]] * 3
    assert all(e.diagnosis[0].error > 3.0 for e in log.epochs)  # 5x the sleep: ~50 ms against 12 predicted


def _single_run(tmp: Path, steps: int, quiet: bool) -> tuple[PlannedRun, list[int]]:
    """A 1-rank PlannedRun over ``steps`` steps an epoch for 3 epochs; the timer's clock reads per epoch."""
    plan = planner.evaluate(linear_cpu_profile([0.0015]), [8], num_workers=[0])
    data = TensorDataset(torch.randn(8 * steps, 4), torch.randint(0, 2, (8 * steps,)))
    model = SleepNet(0.0, 1.0)
    run = PlannedRun(plan, quiet=quiet)
    loader = DataLoader(data, batch_sampler=run.sampler_for(len(data), "cpu"))
    assert run.timer is not None
    reads = [0]
    inner = run.timer._clock

    def clock() -> float:
        reads[0] += 1
        return inner()

    run.timer._clock = clock
    per_epoch = []
    for epoch in range(3):
        before = reads[0]
        for x, y in run.epoch(epoch, loader, last=epoch == 2):
            nn.functional.cross_entropy(model(x), y).backward()
        per_epoch.append(reads[0] - before)
    return run, per_epoch


@pytest.mark.filterwarnings("ignore::runtime.workload.WorkloadWarning")
def test_the_diagnosis_runs_once_an_epoch_and_reads_no_clock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.run as run_module

    _, with_diagnosis = _single_run(tmp_path, 12, quiet=True)
    calls: list[int] = []
    real = run_module.diagnose

    def counted(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(run_module, "diagnose", lambda *a, **k: ())
    _, without = _single_run(tmp_path, 12, quiet=True)
    assert with_diagnosis == without  # the same clock reads, step for step
    monkeypatch.setattr(run_module, "diagnose", counted)
    _single_run(tmp_path, 12, quiet=True)
    n_short = len(calls)
    _single_run(tmp_path, 40, quiet=True)
    # One call an epoch, whatever its steps.
    assert n_short == 3 and len(calls) == 6


def test_a_rank_whose_error_drifts_from_epoch_to_epoch_needs_more_to_be_slow() -> None:
    # 25% over: slow for a rank whose error held within 1% over its epochs on plan; noise for one whose error
    # swung +-15% from epoch to epoch (other jobs loading its core by the epoch); 2x is slow either way.
    stats = [st(0, 0.05), st(1, 0.0625)]
    steady, swinging = {1: [0.01, -0.01, 0.0]}, {1: [0.15, -0.15, 0.1, -0.1]}
    assert _one(diagnose(stats, PRED, on_plan_errors=steady)).rank == 1
    assert diagnose(stats, PRED, on_plan_errors=swinging) == ()
    assert _one(diagnose([st(0, 0.05), st(1, 0.1)], PRED, on_plan_errors=swinging)).rank == 1
