"""benchmarks/replan_replay.py on a recorded launch: the replay follows the log until the splits part."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from replan_replay import replay  # noqa: E402


def test_the_replay_decides_each_epoch_and_stops_where_the_splits_part() -> None:
    lines = replay(str(ROOT / "docs" / "results" / "h100x2_train_auto_replan_s14d_skew_r1"))
    assert lines[0].startswith("epoch 0: predicted step") and "below the threshold" in lines[0]
    adopted = [x for x in lines if "ADOPTED" in x]
    assert len(adopted) == 1 and adopted[0].startswith("epoch 3: ADOPTED")
    assert lines[-1] == "epoch 4: the run measured [495, 17], the replay holds [413, 99]: stopped"


def test_the_epoch_that_refills_after_an_adoption_is_not_judged_as_the_trainer_does() -> None:
    """s14c's first launch adopted [427, 85] after epoch 0; `planner train` left epoch 1 (the refill) unjudged, and
    the replay does the same, so its later decisions are the run's: proposals of 7.4%, 4.8% and 6.3%, none adopted."""
    lines = replay(str(ROOT / "docs" / "results" / "h100x2_train_auto_replan_s14c_skew_r1"))
    assert lines[0].startswith("epoch 0: ADOPTED") and lines[1].startswith("epoch 1: not judged")
    assert [x.split("gain ")[1].split(";")[0] for x in lines[2:]] == ["7.4%", "4.8%", "6.3%"]
    assert not [x for x in lines[2:] if "ADOPTED" in x]
    every = replay(str(ROOT / "docs" / "results" / "h100x2_train_auto_replan_s14c_skew_r1"), streamed=False)
    assert every[1].startswith("epoch 1: predicted step")  # judged when the loader restarted each epoch
