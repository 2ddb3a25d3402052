"""End to end through torchrun: misconfigured ranks fail with one clear error, a dead rank never hangs the rest.

runtime.safety.check_agreement is tested at the function level in tests/runtime/test_safety.py; here the whole
``planner train`` path runs, with the per-rank difference a real mistake would make (tests/reliability/_launch.py
gives each rank its own argv). Launch and teardown take ~8 s per job on 2 cores, so each deadline allows for it.
Of the ranks launched differently, the seed case goes through torchrun (its agent, its failure summary); the plan
and dataset cases and the dying rank run on the tests' fork-server launcher (tests/_ranks.py: the same environment
torchrun gives its ranks, each rank's exit code read directly, no interpreter start).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import planner
from planner.profile import Profile
from tests import _ranks
from tests.reliability import _torchrun

FIX = "tests.reliability._fixtures"
LAUNCH = "tests/reliability/_launch.py"
# Startup (two processes importing torch on 2 cores) + 15 s for the error itself.
DEADLINE_S = 60.0


def two_rank_profile() -> Profile:
    return Profile.from_dict({
        "version": 1, "kind": "profile", "hosts": [{"name": "n", "cpu_cores": 2}],
        "ranks": [{"rank": i, "host": "n", "device": "cpu",
                   "compute": [{"batch_size": 4, "step_time_s": 0.004 * (i + 1)},
                               {"batch_size": 32, "step_time_s": 0.03 * (i + 1)}]} for i in range(2)]})


def write_plan(path: Path, batches: list[int]) -> Path:
    # num_workers 0: the loader runs in the training process (no worker processes to start or to leak)
    planner.evaluate(two_rank_profile(), batches, num_workers=[0, 0]).save(path)
    return path


def _exit_codes(err: str) -> dict[int, int]:
    """rank -> exit code from torchrun's failure summary (SIGTERM by torchrun shows as -15)."""
    pairs = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", err)
    return {int(r): int(c) for r, c in pairs}


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("seed", "ranks disagree on seed: rank 0 has 0, rank 1 has 1; pass the same --seed to every rank"),
        ("plan", "ranks disagree on plan fingerprint: rank 0 has "),
        ("dataset", "ranks disagree on dataset length: rank 0 has 100, rank 1 has 101; every rank must see"),
    ],
)
def test_ranks_launched_differently_fail_with_the_same_error(case: str, expected: str, tmp_path: Path) -> None:
    write_plan(tmp_path / "plan0.json", [7, 5])
    write_plan(tmp_path / "plan1.json", [6, 6] if case == "plan" else [7, 5])
    args = [LAUNCH, "train", "--device", "cpu", "--epochs", "1", "--model", f"{FIX}:model",
            "--plan", str(tmp_path / ("plan{rank}.json" if case == "plan" else "plan0.json")),
            "--dataset", f"{FIX}:dataset_len_by_rank" if case == "dataset" else f"{FIX}:dataset",
            "--seed", "{rank}" if case == "seed" else "0"]
    if case != "seed":
        codes, _, err, wall = _ranks.run_each(args, timeout_s=DEADLINE_S)
        assert err.count(f"error: {expected}") == 2 and err.count("error: ") == 2, err[-3000:]
        assert "Traceback" not in err, err[-3000:]  # no rank printed one
        assert codes == [2, 2], (codes, err[-2000:])  # both ranks, by themselves, with the user-error code
        assert wall < DEADLINE_S
        return
    # --monitor-interval 1: torchrun looks at its children once a second, so the rank that raises second is not
    # SIGTERMed by the agent before it has printed its own error (the check is that *every* rank reports it).
    rc, _, err, wall = _torchrun.run(args, timeout_s=DEADLINE_S, monitor_interval_s=1)
    assert rc != 0
    # Both ranks share stderr and their writes may interleave mid-line, so count messages, not lines.
    assert err.count(f"error: {expected}") == 2 and err.count("error: ") == 2, err[-3000:]
    # No rank printed a traceback (torch prefixes those with [rankN]:); the one left is torchrun's own summary.
    assert "[rank" not in err and err.count("Traceback") <= 1, err[-3000:]
    assert _exit_codes(err) == {0: 2, 1: 2}, err[-2000:]
    assert wall < DEADLINE_S


@pytest.mark.distributed
def test_rank_dying_mid_step_never_hangs_the_others(tmp_path: Path) -> None:
    plan = write_plan(tmp_path / "plan.json", [7, 5])
    # Rank 1 calls os._exit(1) in the forward of its 3rd step while rank 0 is (or soon will be) in that step's
    # gradient all-reduce. gloo sees the closed connection and rank 0 raises on its own: the launcher gives it
    # tests._ranks.FAIL_GRACE_S after rank 1's exit before it would kill it (-9), so its own exit code 1 shows.
    codes, _, err, wall = _ranks.run_each(
        ["train", "--plan", str(plan), "--device", "cpu", "--epochs", "2",
         "--model", f"{FIX}:dying_model", "--dataset", f"{FIX}:dataset"], timeout_s=DEADLINE_S)
    assert codes == [1, 1], (codes, err[-3000:])
    assert "Connection reset by peer" in err or "Connection closed by peer" in err, err[-3000:]
    assert wall < DEADLINE_S
