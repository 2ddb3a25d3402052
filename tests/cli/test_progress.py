"""Progress lines: profile, train and bench say what they do at least every 10 s; --quiet silences them.

The timing guarantee is the reporter's (a heartbeat repeats the status after ``interval_s`` = 5 s without a line),
tested with a fake clock; the programs are tested by their captured lines: the phases are there, and the
stamps of consecutive lines are never more than 10 s apart (twice the interval). `planner bench`'s lines are
checked on tests/cli/test_bench.py's shared launch (test_bench_reports_every_phase).
"""

from __future__ import annotations

import io
import itertools
import re
import time
from pathlib import Path

import pytest
import torch

from planner.cli import main
from planner.cli.progress import DEFAULT_INTERVAL_S, Progress

STAMP = re.compile(r"^\[(\w+)\s+(\d+)s\] (.*)$")


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _lines(text: str, what: str) -> list[tuple[int, str]]:
    out = []
    for line in text.splitlines():
        m = STAMP.match(line)
        if m and m.group(1) == what:
            out.append((int(m.group(2)), m.group(3)))
    return out


def _max_gap_s(lines: list[tuple[int, str]]) -> int:
    stamps = [t for t, _ in lines]
    return max((b - a for a, b in itertools.pairwise(stamps)), default=0)


def test_reporter_events_updates_and_heartbeat() -> None:
    clock, buf = FakeClock(), io.StringIO()
    p = Progress("demo", interval_s=5.0, stream=buf, clock=clock)
    p("phase one")  # an event prints at once
    clock.t += 1
    p.update("phase one: step 1/9")  # an update within the interval only replaces the status
    assert buf.getvalue() == "[demo    0s] phase one\n"
    clock.t += 4
    p.update("phase one: step 2/9")  # 5 s after the last line: printed
    assert buf.getvalue().splitlines()[-1] == "[demo    5s] phase one: step 2/9"
    clock.t += 4.9
    assert not p.tick()  # the heartbeat stays quiet until the interval has passed...
    clock.t += 0.2
    assert p.tick()  # ...then repeats the status with how long it has lasted
    assert buf.getvalue().splitlines()[-1] == "[demo   10s] phase one: step 2/9 (still running, 5 s)"
    clock.t += 1
    p.update("phase one: step 3/9")  # not shown yet...
    clock.t += 5
    assert p.tick()  # ...so the heartbeat shows it as it is
    assert buf.getvalue().splitlines()[-1] == "[demo   16s] phase one: step 3/9"
    p.phase("strategy plan")
    p.update("epoch 0: step 1/3")
    assert buf.getvalue().splitlines()[-1] == "[demo   16s] strategy plan: starting"


def test_reporter_disabled_prints_nothing() -> None:
    buf = io.StringIO()
    with Progress("demo", enabled=False, stream=buf, interval_s=0.01) as p:
        p("x")
        p.update("y")
        assert not p.tick()
    assert buf.getvalue() == ""


def test_heartbeat_thread_repeats_a_long_phase() -> None:
    buf = io.StringIO()
    clock = FakeClock()
    with Progress("demo", interval_s=0.05, stream=buf, clock=clock) as p:
        p("waiting for a slow step")
        clock.t += 1.0
        # The thread wakes every interval/4 of real time; the test waits for the line, not for a speed: on a
        # loaded box a wake-up can take seconds, so the deadline is far above any (it ends at the first line).
        deadline = time.monotonic() + 60.0
        while "still running" not in buf.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
    assert "waiting for a slow step (still running, 1 s)" in buf.getvalue()


def test_profile_prints_each_phase_and_point(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["profile", "--model", "mlp", "--device", "cpu", "--quick", "--batch-sizes", "8,16,32", "--out",
               str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert rc == 0
    lines = _lines(err, "profile")
    texts = [t for _, t in lines]
    assert texts[0] == "rank 0 (cpu): compute sweep (budget 6 s)"
    for b in (8, 16, 32):
        assert any(t.startswith(f"rank 0 (cpu): compute sweep, batch {b}: ") and t.endswith(" steps)") for t in texts)
    assert "rank 0 (cpu): dataloader cost per sample" in texts
    assert _max_gap_s(lines) <= 2 * DEFAULT_INTERVAL_S
    rc = main(["profile", "--model", "mlp", "--device", "cpu", "--quick", "--batch-sizes", "8", "--no-loader",
               "--quiet", "--out", str(tmp_path / "q.json")])
    assert rc == 0 and _lines(capsys.readouterr().err, "profile") == []


def test_training_epochs_report_steps_per_second_and_eta() -> None:
    from planner import evaluate
    from planner.cli.distenv import DistEnv
    from planner.cli.train import TrainConfig, train
    from tests.planner._profiles import linear_profile

    plan = evaluate(linear_profile([0.001]), [16])
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
    cfg = TrainConfig(model="mlp", epochs=2, num_samples=96, data_on_device=True, quiet=True)
    buf = io.StringIO()
    train(cfg, env, plan, None, progress=Progress("train", interval_s=0.0, stream=buf))
    texts = [t for _, t in _lines(buf.getvalue(), "train")]
    assert texts[0] == "epoch 0: 6 steps of 16 samples"
    assert re.fullmatch(r"epoch 0: step 1/6, [\d.]+ steps/s, ETA \d+ s", texts[1]), texts[1]
    assert re.fullmatch(r"epoch 1: step 6/6, [\d.]+ steps/s, ETA 0 s", texts[-1]), texts[-1]
