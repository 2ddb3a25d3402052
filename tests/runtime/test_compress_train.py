"""`planner train --grad-compress bf16`: a 2-rank gloo run with a [7, 5] plan trains through the compressed
weighting hook, records the compression in its run log's start record, and lands next to the uncompressed run.
The uncompressed run's plan records DDP settings (meta["ddp"]), which the trainer applies and says so; they group
and place gradients without changing them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from planner.plan import Plan
from planner.runlog import read_run_log
from tests import _ranks
from tests.reliability.test_crash_resume import _final, _train_args
from tests.reliability.test_no_hangs import write_plan


@pytest.mark.distributed
def test_train_with_bf16_compression_records_it_and_trains(tmp_path: Path) -> None:
    plan = write_plan(tmp_path / "plan.json", [7, 5])
    with_ddp = tmp_path / "plan_ddp.json"
    loaded = Plan.load(plan)
    settings = {"bucket_cap_mb": 1, "gradient_as_bucket_view": True, "static_graph": True}
    dataclasses.replace(loaded, meta={**loaded.meta, "ddp": settings}).save(with_ddp)
    finals = {}
    for compress in ("none", "bf16"):
        ckpt, log = tmp_path / compress, tmp_path / f"{compress}.jsonl"
        # torchrun's own behaviour is not the subject: the ranks come from the tests' fork server (tests/_ranks.py)
        rc, out, err, _ = _ranks.run(_train_args(with_ddp if compress == "none" else plan, ckpt,
                                                 tmp_path / f"trace-{compress}", "--grad-compress", compress,
                                                 "--log-file", str(log)), timeout_s=90)
        assert rc == 0, err[-3000:]
        applied = "DDP settings from the plan: bucket_cap_mb=1.0, gradient_as_bucket_view=True, static_graph=True"
        assert (applied in out) == (compress == "none"), out[-2000:]
        assert read_run_log(log).grad_compress == compress
        finals[compress] = _final(ckpt)["model"]
    exact, bf16 = finals["none"], finals["bf16"]
    moved = False
    for k in exact:
        assert torch.isfinite(bf16[k]).all()
        # a few epochs of SGD on gradients rounded to bf16 (8 significant bits): close, not equal
        torch.testing.assert_close(bf16[k], exact[k], rtol=0.05, atol=0.02)
        moved |= not torch.equal(bf16[k], exact[k])
    assert moved, "the bf16 run's parameters equal the uncompressed run's bit for bit: nothing was compressed"
