"""`planner train` runs a plan's micro-batches exactly: accumulating k = [1, 3] trains to the same float64
parameters as one micro-step per rank on the same samples, with the loss scale and with the hook, over
3 epochs with padded partial steps (the negative controls, plain averaging, are in tests/runtime/test_accumulation_ddp.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import planner
from tests import _ranks
from tests.reliability.test_crash_resume import _final, _train_args
from tests.reliability.test_no_hangs import two_rank_profile


def _plan(path: Path, batches: list[int], steps: list[int]) -> Path:
    planner.evaluate(two_rank_profile(), batches, num_workers=[0, 0], accumulation_steps=steps).save(path)
    return path


def _train(tmp_path: Path, name: str, plan: Path, *extra: str) -> dict:
    ckpt = tmp_path / name
    rc, _, err, _ = _ranks.run(_train_args(plan, ckpt, tmp_path / f"trace-{name}", *extra), timeout_s=120)
    assert rc == 0, err[-3000:]
    return _final(ckpt)["model"]


@pytest.mark.distributed
def test_micro_steps_train_to_the_parameters_of_one_step(tmp_path: Path) -> None:
    one = _plan(tmp_path / "one.json", [7, 5], [1, 1])
    micro = _plan(tmp_path / "micro.json", [7, 5], [1, 3])
    ref = _train(tmp_path, "one", one)
    for weighting in ("loss-scale", "hook"):
        got = _train(tmp_path, f"micro-{weighting}", micro, "--weighting", weighting)
        for k in ref:
            assert got[k].dtype == torch.float64
            torch.testing.assert_close(got[k], ref[k], rtol=1e-10, atol=1e-12)
        # rank 1 really ran 3 micro-batches (2, 2, 1 samples) per full step
        rows = [json.loads(line) for line in Path(f"{tmp_path}/trace-micro-{weighting}.1").read_text().splitlines()]
        first = [r for r in rows if r["epoch"] == 0 and r["step"] == 0]
        assert [r.get("micro") for r in first] == [0, 1, 2] and [len(r["indices"]) for r in first] == [2, 2, 1]
