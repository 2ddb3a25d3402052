"""Accelerate's own loop (prepare, accumulate, backward) with planned_dataloader on 2 gloo ranks, one launch.

* exactness: a [7, 3] plan, float64, 3 optimizer steps == one process on the same 10 samples per step (1e-9),
  and with gradient_accumulation_steps=2 (windows of 20 and 10 samples, 2 optimizer steps);
* ``accelerator.prepare`` returns the planned loader unchanged (it would otherwise re-shard its batches);
* accelerate's plain averaging over the same [7, 3] batches is not exact, and the documented loop without
  ``* loader.loss_scale()`` is refused at its first backward on both ranks, with the line naming the factor;
* re-planning: rank 1 emulated 3x slower moves the split between epochs, visible in the run log;
* before training, profiler.api.profile_job gave both ranks the same gathered Profile of the user's dict-batch
  step, with the all-reduce and the measured DDP overhead.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from planner.errors import ValidationError
from planner.runlog import read_run_log
from tests.frameworks._common import DictData, load_result, max_diff, reference_params, run_scenarios, write_plan

pytest.importorskip("accelerate")
SCENARIOS = Path(__file__).with_name("_accelerate_scenarios.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_scenarios(SCENARIOS, tmp_path_factory.mktemp("accelerate"))


@pytest.mark.distributed
@pytest.mark.parametrize(("name", "windows"), [("exact", [10, 10, 10]), ("accumulate", [20, 10])])
def test_planned_uneven_batches_equal_one_process(runs: Path, name: str, windows: list[int]) -> None:
    res = load_result(runs, name)
    assert res["seen"] == [7, 7, 7] and res["steps"] == len(windows)
    assert res["prepare_kept_loader"]  # accelerator.prepare left the planned loader as it is
    assert max_diff(res["params"], reference_params(30, windows)) < 1e-9


@pytest.mark.distributed
def test_plain_averaging_of_uneven_batches_is_not_exact(runs: Path) -> None:
    assert max_diff(load_result(runs, "plain")["params"], reference_params(30, [10, 10, 10])) > 1e-3


@pytest.mark.distributed
def test_a_loop_without_the_loss_scale_is_refused_at_its_first_backward_on_every_rank(runs: Path) -> None:
    for rank in range(2):
        res = torch.load(runs / f"unscaled_{rank}.pt", weights_only=True)
        assert res["error"] is not None, f"rank {rank} trained an uneven plan with accelerate's plain average"
        assert res["error"].startswith("the plan gives the ranks [7, 3] samples a step, but nothing weights")
        assert res["error"].endswith("; multiply the loss by the planned loader's factor: "
                                     "accelerator.backward(loss * loader.loss_scale())"), res["error"]
        assert "\n" not in res["error"]
        assert not any(res["grads"])  # refused before any gradient was all-reduced


@pytest.mark.distributed
def test_a_plain_planned_loader_through_prepare_is_refused_at_its_first_batch(runs: Path) -> None:
    assert load_result(runs, "resharded")["error"] == (
        "the planned sampler's batches (rank 0: 7 samples a step) are dealt out again by a BatchSamplerShard (what "
        "accelerator.prepare makes of a DataLoader(batch_sampler=...)), so each process would train a share of its "
        "own batches; build the loader with runtime.adapters.accelerate.planned_dataloader, which prepare leaves as "
        "it is")


@pytest.mark.distributed
def test_a_slow_rank_is_replanned_between_epochs(runs: Path) -> None:
    log = read_run_log(runs / "run.jsonl")
    assert log.ended and [r.epoch for r in log.replans] == [0, 1]
    adopted = [r for r in log.replans if r.adopted]
    assert adopted and adopted[0].new_batch_sizes[0] > adopted[0].new_batch_sizes[1], log.replans[0].reason
    # The epoch after the adoption trains with the adopted batches. (Whether they stay is the measurement's call:
    # on a busy 2-core box these ~10 ms steps are overhead-bound, and a trial that measures slower is reverted.)
    assert log.epochs[0].batch_sizes == (8, 8) and log.epochs[adopted[0].epoch + 1].batch_sizes == adopted[0].new_batch_sizes
    seen = load_result(runs, "replan")["seen"]
    assert seen[:12] == [8] * 12 and seen[-1] == log.epochs[-1].batch_sizes[0]


@pytest.mark.distributed
def test_every_rank_got_the_same_gathered_profile(runs: Path) -> None:
    res = load_result(runs, "profile")
    assert res["fingerprints"][0] == res["fingerprints"][1] and res["ranks"] == [0, 1]
    assert res["allreduce_s"] is not None and res["exposed_s"] is not None


def test_batching_arguments_are_refused_and_a_missing_accelerate_is_one_line(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.adapters import accelerate as adapter

    plan = write_plan(tmp_path / "plan.json", [4])
    with pytest.raises(ValidationError, match="batch_size come from the plan"):
        adapter.planned_dataloader(object(), plan, DictData(8), batch_size=4)
    adapter._loader_class.cache_clear()
    monkeypatch.setitem(sys.modules, "accelerate.data_loader", None)  # import fails as if not installed
    try:
        with pytest.raises(ValidationError, match=r"pip install ddp-planner\[accelerate\]") as e:
            adapter.planned_dataloader(object(), plan, DictData(8))
        assert "\n" not in str(e.value)
    finally:
        adapter._loader_class.cache_clear()
