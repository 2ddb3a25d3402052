"""planner.cli.steps.loader_drain_steps: where a loader-fed timed window may open.

A DataLoader whose loop paused (an epoch boundary, a barrier) has batches ready in every worker's prefetch queue;
the steps that take them run faster than the loader can deliver.  Measured on 2x H200 (`planner bench --data loader
--emulate-loader 1=2`): a 15-step window opened right after the epoch boundary, the 2-worker rank never waited
for data and the plan measured 21% faster than its loader allows.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from planner.cli.steps import LOADER_PREFETCH, loader_drain_steps


class _SlowBatches:
    """Each item is a whole batch costing its worker ``cost`` seconds of sleep (no CPU)."""

    def __init__(self, n: int, cost: float) -> None:
        self.n, self.cost = n, cost

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        time.sleep(self.cost)
        return i


def test_the_rule() -> None:
    assert loader_drain_steps(0) == 1  # the loop loads itself: nothing is built ahead
    assert loader_drain_steps(2) == 2 * (LOADER_PREFETCH + 1) and loader_drain_steps(8, prefetch=2) == 24


def test_steps_after_the_drain_run_at_the_loaders_pace_and_the_first_ones_do_not() -> None:
    # Batches slow enough (a batch every 50 ms) that a busy host's scheduling jitter, a few ms, stays far inside
    # the bounds: the claim is the contrast between the two phases, an order of magnitude, not a speed.
    workers, cost = 2, 0.1
    period = cost / workers
    drain = loader_drain_steps(workers)
    loader = DataLoader(_SlowBatches(drain + 40, cost), batch_size=None, num_workers=workers,
                        prefetch_factor=LOADER_PREFETCH)
    it = iter(loader)
    time.sleep(1.0)  # the loop pauses (an epoch boundary): the workers fill their queues
    gaps, t = [], time.perf_counter()
    for _ in it:
        now = time.perf_counter()
        gaps.append(now - t)
        t = now
    early, steady = gaps[:workers * LOADER_PREFETCH], gaps[drain:]
    assert statistics.mean(early) < 0.25 * period  # taken from the queues: a window here measures the buffer
    assert 0.7 * period < statistics.mean(steady) < 2.0 * period  # after the drain: the loader's own pace


def test_a_split_drains_for_the_ranks_near_their_loaders_pace_only() -> None:
    """planner.cli.bench.window_drain_steps: a recorded 2x H100 loader-skew split -- equal [256, 256] with 15 and 2
    workers, the 2-worker rank's loader at 558 of a 718 ms step, the 15-worker one's at 91 ms -- drains for the
    2-worker rank alone; a split without a loader-paced rank opens after the first step."""
    from types import SimpleNamespace as NS

    from planner.cli.bench import window_drain_steps

    def plan(step: float, ranks: list[tuple[int, float]]) -> NS:
        return NS(predicted=NS(step_time_s=step),
                  ranks=[NS(num_workers=w, predicted_loader_s=lo) for w, lo in ranks])

    assert window_drain_steps(plan(0.718, [(15, 0.091), (2, 0.558)])) == loader_drain_steps(2)
    assert window_drain_steps(plan(0.162, [(16, 0.155), (2, 0.124)])) == loader_drain_steps(16)
    assert window_drain_steps(plan(0.100, [(8, 0.01), (8, 0.02)])) == 1
    assert window_drain_steps(plan(0.100, [(0, 0.09), (0, 0.09)])) == 1  # the loop loads itself


def test_an_epoch_without_a_steady_middle_is_said_out_loud() -> None:
    """planner.cli.steps.short_epoch_warning: 16 workers need 80 fill + 64 drain + 2 x 16 = 176 steps; epochs of 50
    steps of 512, of 30 and of 100 steps have none, and 200-step
    epochs at 28 workers (140 + 112 + 56 = 308) neither; `benchmarks/gpu_suite.sh train`'s 240-step epochs do."""
    from planner.cli.steps import short_epoch_warning

    line = short_epoch_warning(50, [16, 2])
    assert line is not None and line.startswith("warning: an epoch of 50 steps has no steady middle")
    assert "rank 0's loader (16 workers: 80 steps filling their prefetch of 4 at the start, 64 draining" in line
    assert "= 176 steps" in line and "at least 176 steps" in line
    assert short_epoch_warning(30, [2, 16]) is not None and "rank 1's" in short_epoch_warning(30, [2, 16])  # type: ignore[operator]
    assert short_epoch_warning(100, [16, 2]) is not None and short_epoch_warning(176, [16, 2]) is None
    assert short_epoch_warning(200, [28, 2]) is not None and short_epoch_warning(320, [28, 2]) is None
    assert short_epoch_warning(3, [1, 1]) is None and short_epoch_warning(3, [0, 0]) is None  # no bursts to fill


def test_a_streamed_run_says_which_epochs_are_its_loaders_drain() -> None:
    """planner.cli.steps.stream_drain_note and short_epoch_warning(streamed=True): a loader that runs across epochs needs
    one worker cycle per epoch, and the run's last workers x prefetch steps run on batches built before (4 epochs
    of 50 steps at 28 workers: 112 steps, epochs 2-3)."""
    from planner.cli.steps import short_epoch_warning, stream_drain_note

    assert short_epoch_warning(50, [28, 2], streamed=True) is None
    line = short_epoch_warning(20, [28, 2], streamed=True)
    assert line is not None and "shorter than one cycle of rank 0's 28 loader workers" in line
    note = stream_drain_note(50, 4, [28, 2])
    assert note is not None and "last 112 steps" in note and "the last 2 epoch(s) of 50 steps" in note
    assert stream_drain_note(320, 3, [28, 2]) is None  # the drain is part of the last epoch only
    assert stream_drain_note(50, 1, [28, 2]) is None and stream_drain_note(10, 4, [0, 0]) is None


@pytest.mark.slow
def test_planner_train_streams_its_loader_and_logs_the_drain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One CPU rank, 2 workers x 4 prefetched (drain 8 steps), 3 epochs of 4 steps: the loader runs on across the
    epochs, the last two epochs are wholly its drain and the run log marks them; --restart-loader-each-epoch
    drains every epoch as `for batch in loader` does."""
    from planner.cli import main
    from planner.runlog import read_run_log
    from tests.reliability.test_divergence import one_rank_plan

    plan = one_rank_plan(tmp_path / "plan.json", 16, num_workers=2)
    common = ["train", "--plan", str(plan), "--device", "cpu", "--model", "mlp", "--num-samples", "64", "--epochs",
              "3", "--quiet"]
    assert main([*common, "--log-file", str(tmp_path / "s.jsonl")]) == 0
    assert "the last 2 epoch(s) of 4 steps show the GPUs' pace" in capsys.readouterr().err
    drains = [e.ranks[0].drain_steps for e in read_run_log(tmp_path / "s.jsonl").epochs]
    assert drains == [0, 4, 4]
    assert main([*common, "--log-file", str(tmp_path / "r.jsonl"), "--restart-loader-each-epoch"]) == 0
    assert "epoch(s) of 4 steps show the GPUs' pace" not in capsys.readouterr().err
    assert [e.ranks[0].drain_steps for e in read_run_log(tmp_path / "r.jsonl").epochs] == [4, 4, 4]


@pytest.mark.slow
def test_planner_train_and_profile_run_with_gpu_normalize(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--gpu-normalize end to end on one CPU rank: uint8 batches from 2 workers, normalized by the device copy."""
    from planner.cli import main
    from planner.profile import Profile
    from planner.runlog import read_run_log
    from tests.reliability.test_divergence import one_rank_plan

    plan = one_rank_plan(tmp_path / "plan.json", 16, num_workers=2)
    assert main(["train", "--plan", str(plan), "--device", "cpu", "--model", "mlp", "--num-samples", "64",
                 "--epochs", "2", "--quiet", "--gpu-normalize", "--log-file", str(tmp_path / "run.jsonl")]) == 0
    assert all(e.loss is not None and e.loss == e.loss for e in read_run_log(tmp_path / "run.jsonl").epochs)
    assert main(["profile", "--device", "cpu", "--model", "mlp", "--quick", "--gpu-normalize", "--quiet",
                 "--out", str(tmp_path / "p.json")]) == 0
    assert Profile.load(tmp_path / "p.json").meta["gpu_normalize"] is True  # the loader measured as it will run
    capsys.readouterr()
    assert main(["train", "--plan", str(plan), "--device", "cpu", "--model", "mlp", "--num-samples", "64",
                 "--epochs", "1", "--quiet", "--gpu-normalize", "off", "--profile", str(tmp_path / "p.json"),
                 "--allow-workload-mismatch"]) == 0
    assert ("warning: the profile timed the loader handing over uint8 images (--gpu-normalize on), this run hands "
            "over float images (--gpu-normalize off)") in capsys.readouterr().err
    assert main(["train", "--plan", str(plan), "--device", "cpu", "--model", "mlp", "--num-samples", "64",
                 "--epochs", "1", "--quiet", "--gpu-normalize", "--profile", str(tmp_path / "p.json"),
                 "--allow-workload-mismatch"]) == 0
    assert "warning: the profile timed the loader" not in capsys.readouterr().err  # the same images: no word
    assert main(["train", "--plan", str(plan), "--device", "cpu", "--model", "mlp", "--dataset",
                 "tests.profiler.test_specs:nothing", "--gpu-normalize"]) == 2
    assert "--gpu-normalize applies to the built-in image datasets" in capsys.readouterr().err
