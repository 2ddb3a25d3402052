"""profiler.parts: each part's seconds are kept and said; the background part's result and error reach the caller."""

from __future__ import annotations

import threading

import pytest

from profiler.parts import Background, Parts


def test_parts_add_up_and_say_each_one() -> None:
    now = [0.0]
    said: list[str] = []
    parts = Parts(said.append, clock=lambda: now[0])
    with parts.part("compute sweep"):
        now[0] += 12.34
    parts.add("loader", 3.0)
    with parts.part("compute sweep"):  # a part run twice counts both times
        now[0] += 1.0
    assert parts.seconds == {"compute sweep": 13.34, "loader": 3.0}
    assert said == ["compute sweep: 12.3 s", "loader: 3.0 s", "compute sweep: 1.0 s"]
    assert parts.summary() == "compute sweep 13.3 s, loader 3.0 s"


def test_background_runs_beside_the_caller_and_returns_its_result() -> None:
    gate = threading.Event()

    def work() -> int:
        gate.wait(10)
        return 42

    job = Background(work, name="t")
    assert not job.started
    job.start()
    job.start()  # once only
    assert job.started
    gate.set()  # the caller went on while the job waited
    assert job.result() == 42 and job.elapsed_s >= 0


def test_background_error_is_raised_in_the_caller() -> None:
    def boom() -> int:
        raise ValueError("loader broke")

    with pytest.raises(ValueError, match="loader broke"):
        Background(boom, name="t").result()  # result() starts a job never started
