"""Exactness of per-rank micro-batches over NCCL: DDP with no_sync (k_i differing per rank), FSDP2, SyncBatchNorm.

    torchrun --standalone --nproc-per-node 2 benchmarks/gpu_accumulation_check.py

(On CPU, to check the script itself: ``--device cpu``; gloo then, and the SyncBatchNorm case is skipped because
SyncBatchNorm needs CUDA.) Every case trains one epoch of 3 optimizer steps in float64 -- the partial last step
included -- with HeteroBatchSampler(accumulation_steps=...) and runtime.accumulate.micro_steps, and compares the
parameters after every optimizer step with one process on the same device that steps on the concatenation of all
ranks' samples of that step. Cases:

  ddp_hook, ddp_loss_scale     plain DDP over NCCL, batches [5, 9] in k = [1, 3] micro-batches (no_sync)
  ddp_bn_hook                  the same with BatchNorm (DDP broadcasts buffers in the first forward of a step)
  fsdp2_loss_scale             fully_shard, batches [10, 4] in K = 2 micro-batches (NCCL reduce-scatter / W)
  syncbn_loss_scale            SyncBatchNorm (every forward all-reduces statistics: equal K = 2 on both ranks)
  *_plain                      negative controls: the mean of micro-batch means, then the framework's mean

Pass criterion: every exact case within 1e-9 relative, every control above 1e-3. Rank 0 prints one line per case and
writes the raw JSON to $OUT/gpu_accumulation_check.json (or --json PATH).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime import HeteroBatchSampler, MicroStep, micro_steps, register_weighted_hook

LR = 0.1
# name: (model kind, batch sizes, accumulation steps, N, wrapper, weighting)
CASES: dict[str, tuple[str, list[int], list[int], int, str, str]] = {
    "ddp_hook": ("mlp", [5, 9], [1, 3], 34, "ddp", "hook"),
    "ddp_loss_scale": ("mlp", [5, 9], [1, 3], 34, "ddp", "loss_scale"),
    "ddp_bn_hook": ("bn", [5, 9], [1, 3], 34, "ddp", "hook"),
    "ddp_plain": ("mlp", [5, 9], [1, 3], 34, "ddp", "plain"),
    "fsdp2_loss_scale": ("mlp", [10, 4], [2, 2], 36, "fsdp2", "loss_scale"),
    "fsdp2_plain": ("mlp", [10, 4], [2, 2], 36, "fsdp2", "plain"),
    "syncbn_loss_scale": ("bn", [10, 4], [2, 2], 36, "syncbn", "loss_scale"),
    "syncbn_plain": ("bn", [10, 4], [2, 2], 36, "syncbn", "plain"),
}


def make_model(kind: str, dev: torch.device) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    else:
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))
    return model.double().to(dev)


def data(n: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return (torch.randn(n, 4, generator=g, dtype=torch.float64).to(dev),
            torch.randn(n, 2, generator=g, dtype=torch.float64).to(dev))


def layout(n: int, sizes: list[int], steps: list[int]) -> list[list[list[list[int]]]]:
    """rank -> optimizer step -> micro-batches of indices, from every rank's sampler."""
    out = []
    for r in range(len(sizes)):
        s = HeteroBatchSampler(n, sizes, r, seed=3, accumulation_steps=steps)
        by_step: list[list[list[int]]] = [[] for _ in range(s.num_steps)]
        for batch, micro in micro_steps(s, s):
            by_step[micro.step].append(batch)
        out.append(by_step)
    return out


def reference(kind: str, sizes: list[int], steps: list[int], n: int, joint_stats: bool,
              dev: torch.device) -> list[list[torch.Tensor]]:
    """Parameters after each step of one process. BatchNorm statistics: per rank's micro-batch (DDP), or joint
    over all ranks' j-th micro-batches (SyncBatchNorm)."""
    model = make_model(kind, dev)
    x, y = data(n, dev)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    per_rank = layout(n, sizes, steps)
    out = []
    for step in range(len(per_rank[0])):
        chunks = [b for rank in per_rank for b in rank[step]]
        total = sum(len(c) for c in chunks)
        if joint_stats:  # micro-step j of every rank is one SyncBatchNorm forward
            groups = [[i for rank in per_rank for i in rank[step][j]] for j in range(len(per_rank[0][step]))]
        else:
            groups = chunks
        opt.zero_grad()
        for idx in groups:  # sum of per-sample losses / n: the step's global mean loss
            (F.mse_loss(model(x[idx]), y[idx], reduction="sum") / (2 * total)).backward()
        opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def factor(weighting: str) -> Callable[[MicroStep], float]:
    if weighting == "hook":
        return lambda m: m.accumulation_weight
    if weighting == "loss_scale":
        return lambda m: m.loss_scale
    return lambda m: 1.0 / m.count


def run_case(name: str, rank: int, dev: torch.device) -> float:
    kind, sizes, steps, n, wrapper, weighting = CASES[name]
    model = make_model(kind, dev)
    sampler = HeteroBatchSampler(n, sizes, rank, seed=3, accumulation_steps=steps)
    x, y = data(n, dev)
    ids = [dev.index] if dev.type == "cuda" else None
    wrapped: Any
    if wrapper == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        wrapped = fully_shard(model)
        params: Callable[[], list[torch.Tensor]] = lambda: [p.full_tensor() for p in model.parameters()]  # noqa: E731
    else:
        if wrapper == "syncbn":
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        wrapped = DDP(model, device_ids=ids, bucket_cap_mb=1e-6)
        params = lambda: list(model.parameters())  # noqa: E731
        if weighting == "hook":
            register_weighted_hook(wrapped, sampler)
    opt = torch.optim.SGD(wrapped.parameters(), lr=LR)
    weight = factor(weighting)
    after = []
    for idx, micro in micro_steps(sampler, sampler):
        if wrapper == "fsdp2":
            wrapped.set_requires_gradient_sync(micro.is_last)
            ctx: Any = contextlib.nullcontext()
        else:
            ctx = contextlib.nullcontext() if micro.is_last else wrapped.no_sync()
        with ctx:
            (F.mse_loss(wrapped(x[idx]), y[idx]) * weight(micro)).backward()
        if micro.is_last:
            opt.step()
            opt.zero_grad()
            after.append([p.detach().clone() for p in params()])
    ref = reference(kind, sizes, steps, n, wrapper == "syncbn", dev)
    assert len(after) == len(ref) == 3
    return max(((p - q).norm() / q.norm()).item() for a, b in zip(after, ref, strict=True)
               for p, q in zip(a, b, strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo, for checking the script")
    parser.add_argument("--json", default=None, help="output path (default $OUT/gpu_accumulation_check.json)")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit("run with --nproc-per-node 2 (the cases are 2-rank layouts)")
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    results = []
    for name, (_, sizes, steps, n, wrapper, weighting) in CASES.items():
        if wrapper == "syncbn" and not cuda:
            continue  # SyncBatchNorm refuses CPU tensors
        err = run_case(name, rank, dev)
        worst = torch.tensor([err], dtype=torch.float64, device=dev)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        exact = weighting != "plain"
        ok = worst.item() <= 1e-9 if exact else worst.item() > 1e-3
        results.append({"case": name, "wrapper": wrapper, "weighting": weighting, "batch_sizes": sizes,
                        "accumulation_steps": steps, "dataset_len": n, "max_rel_param_error": worst.item(),
                        "expected": "<= 1e-9" if exact else "> 1e-3 (negative control)", "ok": ok})
    if rank == 0:
        device_name = torch.cuda.get_device_name(0) if cuda else "cpu"
        for r in results:
            print(f"{r['case']:18s} {r['wrapper']:6s} k={r['accumulation_steps']} batches {r['batch_sizes']}: max "
                  f"relative parameter error {r['max_rel_param_error']:.3e} (expected {r['expected']}) "
                  f"{'ok' if r['ok'] else 'FAILED'}")
        out = {"kind": "gpu_accumulation_check", "torch": torch.__version__, "device": device_name,
               "backend": dist.get_backend(), "world_size": world, "cases": results,
               "ok": all(r["ok"] for r in results)}
        path = args.json or os.path.join(os.environ.get("OUT", "."), "gpu_accumulation_check.json")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(out, indent=1) + "\n")
        print(f"{'all ok' if out['ok'] else 'SOME FAILED'}; wrote {path}")
    dist.barrier()  # no rank tears its process group down while a peer still talks to it
    dist.destroy_process_group()
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
