"""`planner train` weights uneven batches exactly either way: the default loss scale equals the comm hook.

The hook is checked against one process on the concatenated batches (test_weighting.py, 1e-9 in float64); here two
2-rank gloo runs of the trainer with a [7, 5] plan, float64, differ only in ``--weighting``, and their final
parameters and momentum agree to rounding -- so the trainer's loss-scale wiring (step index, scale, timing hook) is
exact too, over 3 epochs with padded partial steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import _ranks
from tests.reliability.test_crash_resume import _final, _train_args
from tests.reliability.test_no_hangs import write_plan


@pytest.mark.distributed
def test_loss_scale_and_hook_train_to_the_same_parameters(tmp_path: Path) -> None:
    plan = write_plan(tmp_path / "plan.json", [7, 5])
    finals = {}
    for weighting in ("loss-scale", "hook"):
        ckpt = tmp_path / weighting
        rc, _, err, _ = _ranks.run(_train_args(plan, ckpt, tmp_path / f"trace-{weighting}", "--weighting",
                                                  weighting), timeout_s=90)
        assert rc == 0, err[-3000:]
        finals[weighting] = _final(ckpt)
    a, b = finals["loss-scale"]["model"], finals["hook"]["model"]
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == torch.float64
        torch.testing.assert_close(a[k], b[k], rtol=1e-10, atol=1e-12)
    # the momentum buffers too (non-zero: the runs trained)
    ma = [s["momentum_buffer"] for s in finals["loss-scale"]["optimizer"]["state"].values()]
    mb = [s["momentum_buffer"] for s in finals["hook"]["optimizer"]["state"].values()]
    assert len(ma) == len(mb) == len(a) and all(m.abs().sum() > 0 for m in ma)
    for x, y in zip(ma, mb, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)
