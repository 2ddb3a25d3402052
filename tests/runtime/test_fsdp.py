"""Micro-batches under FSDP2 (``fully_shard``, CPU gloo) with the loss scale equal one process (float64).

FSDP2 reduce-scatters the gradients and divides by the data-parallel world size W, so multiplying each
micro-batch's mean loss by n_ij * W / n (``MicroStep.loss_scale``) gives sum_ij (n_ij / n) g_ij exactly. Every
rank runs the same number of micro-batches in every step (each forward all-gathers the parameters), which the
sampler guarantees when every k_i is equal; ``set_requires_gradient_sync(False)`` skips the reduce-scatter on all
but the last micro-batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from runtime.accumulate import micro_steps
from runtime.sampler import HeteroBatchSampler
from tests._dist import run_distributed
from tests.runtime.test_accumulation_ddp import (
    LR,
    SEED,
    loss_factor,
    make_data,
    make_model,
    reference_params,
    samplers_for,
    worst_error,
)

# K = 2 on both ranks, micro-batches 5 and 2 (b = [10, 4], B = 14). N = 36 leaves R = 8 -> r = (6, 3): rank 0
# needs 2 micro-batches of at most 5, so rank 1 runs 2 as well ([2, 1]); 3 optimizer steps.
SIZES, STEPS, N = [10, 4], [2, 2], 36


def fsdp_worker(rank: int, world: int, modes: list[str]) -> None:
    from torch.distributed.fsdp import fully_shard

    for mode in modes:
        torch.manual_seed(123 + rank)  # nothing below may depend on it
        model = make_model("mlp")
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        x, y = make_data("mlp", N)
        sampler = HeteroBatchSampler(N, SIZES, rank, seed=SEED, accumulation_steps=STEPS)
        loader = DataLoader(TensorDataset(x, y), batch_sampler=sampler)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        factor = loss_factor(mode)
        after: list[list[torch.Tensor]] = []
        counts: list[int] = []
        for (xb, yb), micro in micro_steps(loader, sampler):
            model.set_requires_gradient_sync(micro.is_last)  # type: ignore[operator]
            (F.mse_loss(model(xb), yb) * factor(micro)).backward()
            if micro.is_last:
                opt.step()
                opt.zero_grad()
                after.append([p.full_tensor().detach().clone() for p in model.parameters()])  # type: ignore[attr-defined]
                counts.append(micro.count)
        everyone = [torch.zeros(3, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(everyone, torch.tensor(counts))
        assert [e.tolist() for e in everyone] == [[2, 2, 2]] * world  # equal micro-step counts, every step
        err = worst_error(after, reference_params("mlp", N, SIZES, STEPS))
        if mode == "plain":
            assert err > 1e-3, f"rank {rank}: averaging micro-batch means should be visibly wrong, error {err:.2e}"
        else:
            assert err <= 1e-9, f"rank {rank}: FSDP2 parameters differ from one process by {err:.2e}"


def test_fsdp_case_layout() -> None:
    s = samplers_for(N, SIZES, STEPS)[0]
    assert [s.micro_sizes_at(i) for i in range(s.num_steps)] == [((5, 5), (2, 2))] * 2 + [((3, 3), (2, 1))]


@pytest.mark.distributed
def test_fsdp2_micro_batches_with_loss_scale_equal_single_process() -> None:
    pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 (fully_shard) needs torch >= 2.6")
    run_distributed(fsdp_worker, 2, ["loss_scale", "plain"], timeout_s=150)
