"""examples/elastic_own_loop.py, the own loop docs/FRAMEWORKS.md gives for elastic torchrun: each start plans for
the world it finds and continues from the epoch checkpoint.  Run as an elastic restart runs it: 2 gloo ranks for 2
epochs, then the same script on 1 rank (a node left) for the rest; the restart profiles and plans for 1 rank at the
same global batch and trains only the epochs the checkpoint has not done.  (The rendezvous itself, a join and a
leave under two torchrun agents, was run by hand: docs/FRAMEWORKS.md, "Nodes that come and go".)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from planner.runlog import read_run_log
from tests._dist import run_distributed
from tests._scripts import load_script
from tests.frameworks._common import REPO

GLOBAL_BATCH = 32


def start_worker(rank: int, world: int, tmp: str, epochs: int, log: str) -> None:
    module = load_script(str(REPO / "examples" / "elastic_own_loop.py"), "elastic_own_loop")
    args = module.get_args_parser().parse_args(  # type: ignore[attr-defined]
        ["--checkpoint", f"{tmp}/ckpt.pt", "--log-file", f"{tmp}/{log}", "--epochs", str(epochs),
         "--num-samples", "256", "--global-batch", str(GLOBAL_BATCH)])
    module.train(args)  # type: ignore[attr-defined]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_restart_on_fewer_ranks_plans_for_them_and_continues_after_the_checkpoint(tmp_path: Path) -> None:
    run_distributed(start_worker, 2, str(tmp_path), 2, "run2.jsonl", timeout_s=240, pg_timeout_s=60)
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["epoch"] == 2
    run_distributed(start_worker, 1, str(tmp_path), 3, "run1.jsonl", timeout_s=240, pg_timeout_s=60)
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["epoch"] == 3
    first, restart = read_run_log(tmp_path / "run2.jsonl"), read_run_log(tmp_path / "run1.jsonl")
    assert (first.world_size, [e.epoch for e in first.epochs]) == (2, [0, 1])
    assert (restart.world_size, [e.epoch for e in restart.epochs]) == (1, [2])  # only the epoch not done
    assert [sum(e.batch_sizes) for e in first.epochs + restart.epochs] == [GLOBAL_BATCH] * 3
    assert restart.epochs[0].batch_sizes == (GLOBAL_BATCH,)
