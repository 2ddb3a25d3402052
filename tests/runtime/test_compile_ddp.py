"""Exact under torch.compile: a compiled DDP model over uneven batches equals one process (float64, 2 gloo ranks).

The model is ``DDP(torch.compile(model))`` (DDP's own bucketing, the planner's weighted comm hook or DDP's mean
all-reduce with ``loss_scale``), the batch dimension marked dynamic (``torch._dynamo.maybe_mark_dynamic``) before
each call, and a re-plan at the epoch boundary changes both ranks' batch sizes.  Compiled graphs are counted with
dynamo's own counter (``counters["stats"]["unique_graphs"]``): at most one per rank per batch size it has not run.
The backend is ``aot_eager`` (dynamo's capture, the DDP optimizer's graph split at bucket boundaries and AOT
autograd's forward/backward graphs, without inductor's code generation): exactness is a property of what is
captured and how DDP reduces it, and inductor's first compile costs a minute of this machine.
"""

from __future__ import annotations

import pytest
import torch._dynamo
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from runtime.sampler import HeteroBatchSampler
from runtime.weighting import loss_scale, register_weighted_hook
from tests._dist import run_distributed
from tests.runtime.test_weighting import LR, make_data, make_model, reference

N = 34
PLANS = [[7, 3], [4, 6]]  # the second epoch is a re-plan; 34 samples leave each epoch a partial last step


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def train_compiled(rank: int, mode: str, optimize_ddp: bool) -> tuple[float, list[tuple[int, int]]]:
    """Two epochs through DDP(torch.compile(model)); the worst relative parameter error vs one process and, per
    epoch, (graphs compiled, batch sizes this rank had not run before)."""
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = optimize_ddp
    model = make_model("mlp")
    # The model compiled, then wrapped: torch.compile(DDP(model)) captured no graph of this model on torch 2.14
    # (DDP's forward breaks the graph at its skipped _inside_ddp_forward context and the model ran eagerly).
    # DDP's default buckets: the DDP optimizer refuses a first bucket larger than the others (bucket_cap_mb below
    # DDP's fixed 1 MiB first bucket: "First bucket should be smaller/equal to other buckets").
    ddp = DDP(torch.compile(model, backend="aot_eager"))
    x, y = make_data("mlp", N)
    sampler = HeteroBatchSampler(N, PLANS[0], rank, seed=3)
    loader = DataLoader(TensorDataset(x, y), batch_sampler=sampler)
    if mode == "hook":
        register_weighted_hook(ddp, sampler)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    sizes: set[int] = set()
    per_epoch = []
    for epoch, plan in enumerate(PLANS):
        sampler.set_batch_sizes(plan)
        sampler.set_epoch(epoch)
        before, known = compiled_graphs(), len(sizes)
        for step, (xb, yb) in enumerate(loader):
            torch._dynamo.maybe_mark_dynamic(xb, 0)
            sizes.add(len(xb))
            loss = F.mse_loss(ddp(xb), yb)
            if mode == "loss_scale":
                loss = loss * loss_scale(sampler, step)
            loss.backward()
            opt.step()
            opt.zero_grad()
        per_epoch.append((compiled_graphs() - before, len(sizes) - known))
    ref = reference("mlp", N, PLANS, 1)
    err = max(((p - q).norm() / q.norm()).item() for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    return err, per_epoch


def compiled_worker(rank: int, world: int, cases: list[tuple[str, bool]]) -> None:
    for mode, optimize_ddp in cases:
        err, per_epoch = train_compiled(rank, mode, optimize_ddp)
        label = f"rank {rank}: {mode}, optimize_ddp={optimize_ddp}, (graphs, new sizes) per epoch {per_epoch}"
        assert err <= 1e-12, f"{label}: parameters differ from the single-process reference by {err:.2e}"
        assert per_epoch[0][0] >= 1, f"{label}: nothing was compiled"
        # The re-plan's epoch: at most one graph per batch size this rank had not run (here none: the batch
        # dimension is dynamic from the first compile and no size is 1, which dynamo specializes).
        assert all(graphs <= new for graphs, new in per_epoch), label


@pytest.mark.distributed
def test_compiled_ddp_equals_one_process_across_a_replan() -> None:
    run_distributed(compiled_worker, 2, [("hook", True), ("loss_scale", True), ("hook", False)], timeout_s=240,
                    pg_timeout_s=120)
