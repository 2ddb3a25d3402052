"""`planner train` on variable-length text (--dataset fake_text:MIN-MAX) weights ranks by tokens, exactly.

Two gloo ranks train tiny_lm on a [7, 3] plan of padded sequences; the final parameters equal one process that
runs every step on the union of both ranks' sequences (from the trainer's own index trace) with the token-mean
loss over all of them -- the same SGD, float32, so equal up to float32 rounding. The hook weighting (samples only)
and micro-steps are refused for such data with one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from planner.cli import main
from profiler.workloads.specs import build_workload
from tests._ranks import run_planner
from tests.frameworks._common import write_plan

DATASET, N, LR = "fake_text:4-16", 20, 0.1


def reference(trace: Path) -> dict[str, torch.Tensor]:
    w = build_workload("tiny_lm", DATASET, num_samples=N)
    torch.manual_seed(0)  # the trainer's default --seed: the same initial weights
    model = w.model_fn()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    steps: dict[int, list[int]] = {}
    for rank in (0, 1):
        for line in Path(f"{trace}.{rank}").read_text().splitlines():
            rec = json.loads(line)
            steps.setdefault(rec["step"], []).extend(rec["indices"])
    for step in sorted(steps):
        ids, targets = zip(*(w.dataset[i] for i in steps[step]), strict=True)
        opt.zero_grad()
        w.loss_fn(model(torch.stack(ids)), torch.stack(targets)).backward()  # token mean over the whole step
        opt.step()
    return model.state_dict()


@pytest.mark.distributed
def test_trainer_weights_variable_length_text_by_tokens(tmp_path: Path) -> None:
    plan = write_plan(tmp_path / "plan.json", [7, 3])
    ckpt, trace = tmp_path / "ckpt", tmp_path / "trace"
    rc, out = run_planner(2, ["train", "--plan", str(plan), "--model", "tiny_lm", "--dataset", DATASET,
                                       "--num-samples", str(N), "--device", "cpu", "--epochs", "1", "--lr", str(LR),
                                       "--checkpoint", str(ckpt), "--trace-file", f"{trace}.{{rank}}",
                                       "--allow-workload-mismatch", "--quiet"])
    assert rc == 0, out[-3000:]
    got = torch.load(ckpt / "checkpoint.pt", map_location="cpu", weights_only=True)["model"]
    want = reference(trace)
    assert got.keys() == want.keys()
    # Measured: 1.5e-8 from this reference; 3e-3 from the same runs' sample-weighted reference.
    for k in got:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6)
    torch.manual_seed(0)
    init = build_workload("tiny_lm", DATASET, num_samples=N).model_fn().state_dict()
    assert max(float((got[k] - init[k]).abs().max()) for k in got) > 1e-3  # it trained: the check is not vacuous


def test_hook_weighting_is_refused_for_variable_length_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = write_plan(tmp_path / "plan.json", [10])  # one rank: the refusal comes before any collective
    rc = main(["train", "--plan", str(plan), "--model", "tiny_lm", "--dataset", DATASET, "--device", "cpu",
               "--weighting", "hook", "--allow-workload-mismatch"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "weighted by tokens through the loss scale" in err
