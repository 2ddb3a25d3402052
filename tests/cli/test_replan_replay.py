"""benchmarks/replan_replay.py on a recorded launch: the replay follows the log until the splits part."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import pytest  # noqa: E402
from replan_replay import replay  # noqa: E402

from runtime.replan import model  # noqa: E402


@pytest.fixture
def as_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Replanner these launches ran with: a waiting rank's span taken at face value (runtime.replan.model,
    "Waiting ranks", came later and moves their re-plans by a few samples, so the replay would part from the run
    before the epochs these tests are about)."""
    monkeypatch.setattr(model, "WAITED_MARGIN", 1.0)


def test_the_replay_decides_each_epoch_and_stops_where_the_splits_part() -> None:
    # Rank 1 measured 1.2-1.6x its flat profile at 17 samples; the model reads that excess as a cost per sample
    # (runtime/replan/model.py, the uniform correction), so samples moved to it are priced at it: the move to rank 1
    # is smaller and comes at epoch 4, where the run (which kept [495, 17]) measured every epoch the replay holds.
    lines = replay(str(ROOT / "tests" / "data" / "h100x2_resnet50_compute_skew_495_17"))
    assert lines[0].startswith("epoch 0: not judged (the loaders filled")  # 150-step epochs, a 174-step fill
    assert lines[1].startswith("epoch 1: predicted step") and "below the threshold" in lines[1]
    adopted = [x for x in lines if "ADOPTED" in x]
    assert len(adopted) == 1 and adopted[0].startswith("epoch 4: ADOPTED") and "[495, 17] -> [456, 56]" in adopted[0]
    assert lines[-1] == adopted[0] and len(lines) == 5


@pytest.mark.usefixtures("as_recorded")
def test_the_epoch_that_refills_after_an_adoption_is_not_judged_as_the_trainer_does() -> None:
    """A 10-epoch stall-emulated compute-skew launch (2x H100): epoch 0 was all fill (not judged), epoch 1 proposed 7.5% and epoch 2 confirmed
    it, epoch 3 refilled the new split's loaders and `planner train` left it unjudged; the replay does the same, so
    its later decisions are the run's: no more change in the 6 epochs left."""
    prefix = str(ROOT / "tests" / "data" / "h100x2_resnet50_compute_skew_stall_376_136_10_epochs")
    lines = replay(prefix)
    assert lines[0].startswith("epoch 0: not judged (the loaders filled")
    assert lines[1].startswith("epoch 1: predicted step") and "adopted only if the next epoch confirms" in lines[1]
    assert lines[2].startswith("epoch 2: ADOPTED") and "[376, 136] -> [388, 124]" in lines[2]
    assert lines[3] == "epoch 3: not judged (this epoch refilled the loaders after the re-plan)"
    assert len(lines) == 9 and not [x for x in lines[4:] if "ADOPTED" in x or "stopped" in x]
    every = replay(prefix, streamed=False)
    assert every[0].startswith("epoch 0: predicted step")  # judged when the loader restarted each epoch


def test_a_device_change_is_adopted_in_one_re_plan() -> None:
    """Three mid-run slowdown launches (2x H100, rank 1 3x slower from epoch 1): the run adopted [364-369, 143-148] after epoch 1,
    which ran 117-123 ms a step on a predicted 103-105 (the smoothed factor 80% of the way to the measured 3x), and
    needed a second re-plan toward [385-387, 125-127].  The model now takes a device change whole
    (runtime.replan.model.DEVICE_CHANGE): the first re-plan goes to [377-384, 128-135] (the replay stops there: the
    run measured its own split next)."""
    for r, ran in ((1, "[364, 148]"), (2, "[366, 146]"), (3, "[369, 143]")):
        lines = replay(str(ROOT / "tests" / "data" / f"h100x2_resnet50_midrun_slowdown_launch{r}"))
        assert lines[0].startswith("epoch 0: predicted step") and "below the threshold" in lines[0]  # a steady window
        assert lines[1].startswith("epoch 1: ADOPTED"), lines
        new = [int(x) for x in lines[1].split("-> [")[1].split("]")[0].split(", ")]
        assert 377 <= new[0] <= 384 and sum(new) == 512, lines[1]
        assert lines[2].startswith(f"epoch 2: the run measured {ran}")


def test_the_device_change_rule_on_a_gpu_adopted_what_the_replay_predicts() -> None:
    """A GPU launch that ran with the device-change rule (2x H100, rank 1 3x slower from epoch 1).  The run
    adopted [380, 132] after its first slow epoch, inside the range the three replays above gave, and ran it at
    rank 1's predicted span (106.3 ms measured against 105.5 ms); the replay of its log makes every decision the
    run made, so the recorded launch and today's Replanner agree."""
    lines = replay(str(ROOT / "tests" / "data" / "h100x2_resnet50_midrun_slowdown_device_change_rule"))
    assert lines[0].startswith("epoch 0: predicted step") and "below the threshold" in lines[0]
    assert lines[1].startswith("epoch 1: ADOPTED") and "[256, 256] -> [380, 132]" in lines[1], lines
    assert lines[2] == "epoch 2: not judged (this epoch refilled the loaders after the re-plan)"
    assert lines[3].startswith("epoch 3: predicted step") and "adopted only if the next epoch confirms" in lines[3]
    assert len(lines) == 4


@pytest.mark.usefixtures("as_recorded")
def test_a_first_epoch_that_was_all_fill_is_not_judged() -> None:
    """Three launches that adopted a split on their first epoch while its loaders' fill took all of it (80- and
    120-step epochs against 174-step fills): the 10-epoch launch's [404, 108] -> [362, 150] then ran 119.7 ms a step for nine
    epochs where the start split ran 101 ms in the two launches beside it; a 6-epoch launch went to [500, 12] on a predicted
    71.6% and needed two more re-plans to come back.  The trainer now leaves such an epoch to the next one."""
    for launch, adopted in (("h100x2_resnet50_compute_skew_stall_404_108_10_epochs", "[404, 108] -> [362, 150]"),
                            ("h100x2_resnet50_compute_skew_stall_393_119", "[393, 119] -> [500, 12]"),
                            ("h200x2_resnet50_compute_skew_stall_462_50", "[462, 50] -> [361, 151]")):
        prefix = str(ROOT / "tests" / "data" / launch)
        lines = replay(prefix)
        assert lines[0].startswith("epoch 0: not judged (the loaders filled their pipelines through all of this "
                                   "first epoch"), (launch, lines)
        assert lines[1].startswith("epoch 1: the run measured"), (launch, lines)  # the run moved on epoch 0's times
        then = replay(prefix, streamed=False)  # judged as the run judged it
        assert then[0].startswith("epoch 0: ADOPTED") and adopted in then[0], (launch, then)


def test_with_the_waiting_rank_rule_the_recorded_re_plans_move_by_a_few_samples() -> None:
    """Today's Replanner on the same two launches: where the fast rank waited (busy 10-19% under the slow one's),
    its span no longer raises its curve, and the re-plans land within 6 samples of the runs' own."""
    lines = replay(str(ROOT / "tests" / "data" / "h100x2_resnet50_compute_skew_stall_376_136_10_epochs"))
    assert lines[2].startswith("epoch 2: ADOPTED") and "[376, 136] -> [394, 118]" in lines[2], lines
    assert lines[3] == "epoch 3: the run measured [388, 124], the replay holds [394, 118]: stopped"
    then = replay(str(ROOT / "tests" / "data" / "h100x2_resnet50_compute_skew_stall_404_108_10_epochs"), streamed=False)
    assert then[0].startswith("epoch 0: ADOPTED") and "[404, 108] -> [360, 152]" in then[0], then


def test_a_logged_run_replays_to_identical_decisions(tmp_path: Path) -> None:
    """A simulated run (rank 1 4x slower from epoch 2, heavy-tailed steps) logged as the runtime objects log it:
    the start record carries ``Replanner.describe()``, each decision its inputs; replayed from them, every decision
    is the same (adopted, revert, reason, batch sizes), and a log without the inputs says it cannot replay."""
    import numpy as np
    from replan_replay import replay_exact

    import planner
    from planner.runlog import RunLogWriter, StartRecord
    from runtime.replan import Replanner
    from tests.runtime._replan_sim import Noise, knee, multiplied, profile_of, simulate

    base = knee(0.0, 0.001, 0.02)
    profile = profile_of([base, base], (1, 2, 4, 8, 16, 32, 64, 128, 256))
    plan = planner.solve(profile, global_batch=200, min_batch=1)
    rp = Replanner(profile, plan)
    run = simulate(rp, lambda e: [base, multiplied(base, 4.0) if e >= 2 else base], 8, np.random.default_rng(3),
                   Noise.busy_box())
    assert any(d.adopted for d in run.decisions)
    log = tmp_path / "run.jsonl"
    with RunLogWriter(log) as w:
        w.write(StartRecord(time=0.0, world_size=2, global_batch=200, plan=plan,
                            replanner=Replanner(profile, plan).describe()))
        for d in run.decisions:
            w.write(d.to_record())
    lines, mismatches = replay_exact(str(log))
    assert mismatches == 0 and len(lines) == 8 and all(x.startswith(f"epoch {i}: same: ") for i, x in enumerate(lines))
    # A log written before the inputs were kept: nothing to replay from.
    old = tmp_path / "old.jsonl"
    with RunLogWriter(old) as w:
        w.write(StartRecord(time=0.0, world_size=2, global_batch=200, plan=plan))
    assert replay_exact(str(old))[0] == ["the log has no re-planner configuration (start record) to replay from"]
