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
