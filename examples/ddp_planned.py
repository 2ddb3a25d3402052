# ruff: noqa: F401, F841, I001 -- the documented diff applied verbatim: unused stock names stay as they were
"""The stock ImageNet-style DDP script (examples/ddp_stock.py) moved onto a plan that re-plans between epochs
in its own loop: docs/ADOPTING.md's "Re-planning in your own loop" change applied to it, nothing else
(tests/frameworks/test_ddp_examples.py checks that and runs both on 2 gloo ranks). Each epoch end times the
ranks, asks the Replanner for a better split and writes the run log `planner report --log` reads.

    torchrun --standalone --nproc-per-node 4 examples/ddp_planned.py --plan plan.json --profile profile.json \
        --log-file run.jsonl --amp --channels-last
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler
from runtime import PlannedRun, register_weighted_hook


class SyntheticImageNet(Dataset[tuple[torch.Tensor, int]]):
    """``n`` ImageNet-shaped samples, each made from its index alone (the same sample on every rank, in every
    worker, in every epoch): labels in [0, classes) and images of 3 x size x size whose 8 x 8 pixel blocks share
    one random uint8 value.  The loader ships the blocks (3 x size/8 x size/8, 1/64 of the image) and
    ``to_images`` expands them on the device, so one loader worker feeds a GPU: the step is the model's, not a
    decoder's."""

    def __init__(self, n: int, size: int, classes: int) -> None:
        self.n, self.size, self.classes = n, size, classes

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        side = -(-self.size // 8)
        blocks = torch.randint(0, 256, (3, side, side), generator=g, dtype=torch.uint8)
        return blocks, int(torch.randint(0, self.classes, (1,), generator=g))


def to_images(blocks: torch.Tensor, size: int, memory_format: torch.memory_format) -> torch.Tensor:
    """A batch of blocks (N x 3 x s x s uint8) as N x 3 x size x size float images in [0, 1]."""
    n, c, s, _ = blocks.shape
    images = blocks[:, :, :, None, :, None].expand(n, c, s, 8, s, 8).reshape(n, c, 8 * s, 8 * s)
    return images[:, :, :size, :size].float().div_(255).contiguous(memory_format=memory_format)


def build_model(arch: str, size: int, classes: int) -> torch.nn.Module:
    if arch == "mlp":  # a tiny stand-in for CPU tests
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * size * size, 64), torch.nn.ReLU(),
                                   torch.nn.Linear(64, classes))
    import torchvision

    return torchvision.models.get_model(arch, num_classes=classes)


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", required=True, help="plan.json from planner plan")
    parser.add_argument("--profile", required=True, help="the profile the plan was solved from")
    parser.add_argument("--log-file", default="run.jsonl", help="run log for planner report --log")
    parser.add_argument("--arch", default="resnet50", help="torchvision model name, or mlp (default resnet50)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--num-samples", type=int, default=12800, help="size of the synthetic dataset (one epoch)")
    parser.add_argument("--workers", type=int, default=6, help="DataLoader workers per rank")
    parser.add_argument("--lr", type=float, default=0.00625, help="learning rate at a global batch of 16")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--amp", action="store_true", help="bf16 autocast")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK if a GPU is visible) or cpu")
    parser.add_argument("--epoch-log", default=None, help="rank 0 appends one JSON line per epoch here")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def pick_device(name: str) -> torch.device:
    if name == "auto" and torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def train(args: argparse.Namespace) -> dict[str, Any]:
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = pick_device(args.device)
    cuda = device.type == "cuda"
    data = SyntheticImageNet(args.num_samples, args.image_size, args.num_classes)
    torch.manual_seed(0)
    net = build_model(args.arch, args.image_size, args.num_classes).to(device)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    net = net.to(memory_format=memory_format)  # type: ignore[call-overload]
    model = DDP(net, device_ids=[device.index] if cuda else None)
    run = PlannedRun(args.plan, profile=args.profile, replan=True, log_file=args.log_file, seed=args.seed)
    sampler = run.sampler_for(len(data), device)
    loader = DataLoader(data, batch_sampler=sampler, num_workers=run.num_workers(args.workers))
    register_weighted_hook(model, sampler)
    run.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * sampler.global_batch / 16)  # linear scaling rule
    batch_sizes: list[int] = []
    epochs: list[dict[str, Any]] = []
    loss = torch.zeros(())
    for epoch in range(args.epochs):
        steps, samples, t0, t_warm = 0, 0, time.perf_counter(), 0.0
        for x, y in run.epoch(epoch, loader, last=epoch == args.epochs - 1):
            x = to_images(x.to(device, non_blocking=True), args.image_size, memory_format)
            y = y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            batch_sizes.append(len(x))
            steps, samples = steps + 1, samples + len(x)
            if steps == 2:  # the steady pace starts after two warm-up steps
                if cuda:
                    torch.cuda.synchronize(device)
                t_warm = time.perf_counter()
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
        total = torch.tensor([float(samples)], device=device)
        dist.all_reduce(total)
        steady = (time.perf_counter() - t_warm) / (steps - 2) if steps > 2 else wall / max(steps, 1)
        record = {"epoch": epoch, "steps": steps, "samples": int(total.item()), "wall_s": round(wall, 4),
                  "samples_per_s": round(total.item() / wall, 2), "step_s": round(wall / max(steps, 1), 5),
                  "steady_step_s": round(steady, 5), "rank0_batch": batch_sizes[-steps] if steps else 0,
                  "time": time.time()}
        epochs.append(record)
        if rank == 0:
            print(f"epoch {epoch}: {steps} steps, {record['samples_per_s']:.1f} samples/s, "
                  f"step {1000 * record['step_s']:.1f} ms (steady {1000 * steady:.1f} ms)", flush=True)
            if args.epoch_log:
                with open(args.epoch_log, "a") as f:
                    f.write(json.dumps(record) + "\n")
    return {"rank": rank, "batch_sizes": batch_sizes, "loss": loss.item(), "epochs": epochs,
            "params": [p.detach().clone() for p in model.parameters()]}


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    dist.init_process_group("nccl" if args.device == "auto" and torch.cuda.is_available() else "gloo")
    try:
        out = train(args)
        print(f"rank {out['rank']}: {len(out['batch_sizes'])} steps, batch sizes {sorted(set(out['batch_sizes']))}, "
              f"final loss {out['loss']:.4f}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
