"""The HF Trainer through runtime.adapters.hf on 2 gloo ranks, float64, a [7, 3] plan of padded LM sequences.

One optimizer step (SGD, lr 1) equals one process's step on the token-mean loss over all ranks' sequences to
1e-9: GPT-2 (the adapter counts its shifted targets), with 2 micro-batches per rank, and a plain module returning
its mean loss with its own count_tokens; weighting ranks by their sample counts on the same data is wrong. A 3x slower rank is re-planned between epochs through the Trainer's callback,
visible in the run log.  A scratch Trainer's own step calibrates the profile's per-step overhead.  A Trainer whose
own ``training_step`` never calls ``compute_loss`` (so nothing weights its loss) is refused at its first backward on
both ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from planner.runlog import read_run_log
from tests.frameworks._common import load_result, max_diff, run_scenarios

pytest.importorskip("transformers")
SCENARIOS = Path(__file__).with_name("_hf_scenarios.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_scenarios(SCENARIOS, tmp_path_factory.mktemp("hf"))


def reference(n: int) -> list[torch.Tensor]:
    """One process, all n sequences in one batch: GPT-2's loss is the mean over every counted (shifted) token."""
    from tests.frameworks._hf_scenarios import Padded, make_gpt2

    model = make_gpt2()
    data = Padded(n)
    batch = {k: torch.stack([data[i][k] for i in range(n)]) for k in data[0]}
    model(**batch).loss.backward()
    with torch.no_grad():
        return [p - p.grad for p in model.parameters()]  # SGD, lr 1


@pytest.mark.distributed
@pytest.mark.parametrize(("name", "n"), [("gpt2", 10), ("gpt2_accum2", 20), ("loss_only_accum2", 20)])
def test_planned_trainer_gives_the_one_process_token_mean_step(runs: Path, name: str, n: int) -> None:
    got = load_result(runs, name)
    assert max_diff(got, reference(n)) <= 1e-9


@pytest.mark.distributed
def test_a_training_step_that_skips_the_weighted_compute_loss_is_refused_on_every_rank(runs: Path) -> None:
    import json

    for rank in range(2):
        error = json.loads((runs / f"own_step_{rank}.json").read_text())["error"]
        assert error is not None, f"rank {rank} trained an uneven plan without its weighting"
        assert error.startswith("the plan gives the ranks [7, 3] samples a step, but nothing weights"), error
        assert error.endswith("compute the loss with self.compute_loss(model, inputs) (or pass compute_loss_func=)")


@pytest.mark.distributed
def test_a_compute_loss_func_with_the_trainers_token_count_trains_the_one_process_step(runs: Path) -> None:
    """The Trainer's own weighting (its global count, average_tokens_across_devices) counts as weighted: the
    first backward is not refused, and the step is the one-process token mean of that loss."""
    from tests.frameworks._hf_scenarios import Padded, make_gpt2

    model, data = make_gpt2(), Padded(10)
    batch = {k: torch.stack([data[i][k] for i in range(10)]) for k in data[0]}
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"]
    total = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                              ignore_index=-100, reduction="sum")
    (total / (labels != -100).sum()).backward()
    with torch.no_grad():
        expected = [p - p.grad for p in model.parameters()]  # SGD, lr 1
    assert max_diff(load_result(runs, "hf_count"), expected) <= 1e-9


@pytest.mark.distributed
def test_sample_count_weighting_is_wrong_on_the_same_data(runs: Path) -> None:
    got = load_result(runs, "samples")
    assert max_diff(got, reference(10)) > 1e-4


@pytest.mark.distributed
def test_a_slow_rank_is_replanned_between_epochs(runs: Path) -> None:
    log = read_run_log(runs / "run.jsonl")
    assert log.ended and [r.epoch for r in log.replans] == [0, 1] and len(log.epochs) == 3
    adopted = [r for r in log.replans if r.adopted]
    assert adopted and adopted[0].new_batch_sizes[0] > adopted[0].new_batch_sizes[1], log.replans[0].reason
    assert log.epochs[0].batch_sizes == (8, 8)
    assert log.epochs[adopted[0].epoch + 1].batch_sizes == adopted[0].new_batch_sizes
    assert all(s.num_steps > 0 for s in log.epochs[0].ranks)  # the loader timed the Trainer's steps


@pytest.mark.distributed
def test_the_trainers_own_step_overhead_calibrates_the_profile(runs: Path) -> None:
    """measure_trainer_overhead: 2 + 4 steps of a scratch stock Trainer at [8, 8] (past its 4-step epoch), the same
    calibrated profile on both ranks, whose equal split predicts the measured step; max_steps is put back."""
    import json

    from planner import Profile, evaluate

    cal = [Profile.load(runs / f"calibrated_{r}.json") for r in (0, 1)]
    assert cal[0].to_dict() == cal[1].to_dict()
    rec = cal[0].meta["exposed_calibration"]
    assert rec["batch_sizes"] == [8, 8] and "HF Trainer (Trainer), 4 steps after 2" == rec["source"]
    assert rec["measured_step_s"] > 0
    predicted = evaluate(cal[0], [8, 8]).predicted.step_time_s
    if not rec["clamped_at_zero"]:
        assert predicted == pytest.approx(rec["measured_step_s"], rel=1e-9)
    else:  # the Trainer ran faster than the synthetic profile's compute: no overhead, said in the record
        assert cal[0].comm is not None and cal[0].comm.exposed_s == 0.0
    for r in (0, 1):
        state = json.loads((runs / f"calibrated_{r}.state.json").read_text())
        assert state == {"global_step": 6, "max_steps": -1}


def test_missing_plan_is_one_clear_error(tmp_path: Path) -> None:
    from planner.errors import ValidationError
    from runtime.adapters.hf import planned_trainer

    with pytest.raises((ValidationError, FileNotFoundError)):
        planned_trainer(tmp_path / "missing.json")
