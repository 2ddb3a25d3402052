"""An own loop on PlannedRun times its compute as `planner train` does: the span opens when DDP hands the batch to
the module, so a rank that starts its step ahead of a late peer does not count the wait in DDP's forward buffer
broadcast (a collective, with ``broadcast_buffers=True``) as its own compute.

Rank 1 sleeps 0.4 s before each forward (work in the loop before the model, as a slow transform); rank 0 waits for
it in the broadcast.  The difference asserted is 0.4 s a step against a model that takes about a millisecond."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import planner
from tests._dist import run_distributed
from tests.runtime._plans import linear_cpu_profile

LATE_S = 0.4


def _loop(rank: int, world: int, out: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset

    from runtime import PlannedRun, register_weighted_hook

    plan = planner.solve(linear_cpu_profile((0.001, 0.001)), global_batch=8)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)))
    run = PlannedRun(plan, seed=0, quiet=True)
    sampler = run.sampler_for(len(data), "cpu")
    register_weighted_hook(model, sampler)
    run.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in run.epoch(0, DataLoader(data, batch_sampler=sampler), last=True):
        if rank == 1:
            time.sleep(LATE_S)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert run.timer is not None
    stats = run.timer.epoch_summary(rank=rank, epoch=0, batch_size=sampler.batch_sizes[rank], num_workers=0)
    Path(out, f"rank{rank}.json").write_text(json.dumps(stats.to_dict()))


@pytest.mark.distributed
def test_an_own_loops_compute_leaves_out_the_wait_for_a_late_peer_in_ddps_forward(tmp_path: Path) -> None:
    run_distributed(_loop, 2, str(tmp_path), timeout_s=150)
    fast = json.loads((tmp_path / "rank0.json").read_text())
    assert fast["step_time_s"] > LATE_S  # the synchronous step waits for the late rank
    assert fast["compute_s"] < LATE_S / 2, fast  # but not in rank 0's own compute
