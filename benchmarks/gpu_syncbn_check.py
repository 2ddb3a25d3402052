"""Exactness of the gradient weighting with real SyncBatchNorm over NCCL (CPU/gloo has no SyncBatchNorm).

    torchrun --standalone --nproc-per-node 2 benchmarks/gpu_syncbn_check.py

Two ranks with uneven batches [7, 3] train a small float64 model with BatchNorm converted to SyncBatchNorm for a
few SGD steps, weighted two ways: runtime.loss_scale (exact by construction) and the comm hook (documented as
inexact with SyncBatchNorm). Every rank also runs one process on the concatenated global batch with plain
BatchNorm; the script prints the largest relative parameter difference of each variant to that reference.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime import HeteroBatchSampler, loss_scale, register_weighted_hook


def main() -> int:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    sizes = [7, 3] if world == 2 else [5, 1, 2][:world]
    N, steps = 10 * sum(sizes), 6
    g = torch.Generator().manual_seed(0)
    X = torch.randn(N, 4, generator=g, dtype=torch.float64)
    Y = torch.randint(0, 3, (N,), generator=g)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).double()
    samplers = [HeteroBatchSampler(N, sizes, r, shuffle=True, seed=1) for r in range(world)]
    results = {}
    for variant in ("loss_scale", "hook"):
        ref = copy.deepcopy(base).to(dev)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        ddp = DDP(nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(base)).to(dev), device_ids=[rank])
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        sampler = HeteroBatchSampler(N, sizes, rank, shuffle=True, seed=1)
        if variant == "hook":
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                register_weighted_hook(ddp, sampler)
        batches = [list(s) for s in samplers]  # every rank's batches, for the single-process reference
        for step, idx in enumerate(sampler):
            if step >= steps:
                break
            x, y = X[idx].to(dev), Y[idx].to(dev)
            loss = F.cross_entropy(ddp(x), y)
            if variant == "loss_scale":
                loss = loss * loss_scale(sampler, step)
            loss.backward()
            opt.step()
            opt.zero_grad()
            allidx = [i for r in range(world) for i in batches[r][step]]
            F.cross_entropy(ref(X[allidx].to(dev)), Y[allidx].to(dev)).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        diff = max(((p - q).abs().max() / q.abs().max()).item()
                   for p, q in zip(ddp.module.parameters(), ref.parameters(), strict=True))
        results[variant] = diff
    if rank == 0:
        print(f"SyncBatchNorm over NCCL, batches {sizes}, {steps} SGD steps, float64, {torch.cuda.get_device_name(0)}")
        for k, v in results.items():
            print(f"  {k:10s} max relative parameter difference to one process on the global batch: {v:.3e}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
