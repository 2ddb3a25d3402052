"""Planned twins vs the framework's default on 2 GPUs, rank 1 emulated 3x slower: Lightning and Accelerate.

    torchrun --standalone --nproc-per-node 2 benchmarks/frameworks_gpu.py --framework lightning
    torchrun --standalone --nproc-per-node 2 benchmarks/frameworks_gpu.py --framework accelerate

Per framework, in one launch (same processes, same warm-up for both variants):
  1. profile: profiler.api.profile_job of the very training step both variants run (ResNet-50, bf16 autocast,
     channels_last, SGD; rank 1 repeats forward+backward to take 3x its compute, profiler.workloads.emulate.Slowdown), then
     planner.solve at the global batch -> the plan (gathered profile and plan land in the JSON);
  2. rounds (default 3), interleaved: ``default`` -- the framework's own DDP with equal batches (Lightning:
     strategy="ddp" and its DistributedSampler; Accelerate: a DataLoader(batch_size=B/2) through
     accelerator.prepare) -- then ``planned`` -- runtime.adapters (LightningPlan / planned_dataloader);
  3. each run is one epoch of ``--steps`` global steps through the framework's own loop; the timed window runs
     from the end of step ``--warmup`` to the end of the last step, synchronized (cuda.synchronize + barrier) at
     both ends; samples/s = global batch x timed steps / window.
Reports the median speed-up over rounds with min-max (goal >= 1.7x; a hand-picked split ran 1.85x for plain DDP
at this setting) and writes the raw per-round numbers to $OUT/frameworks_gpu_<framework>.json (or --json).

Data: a map-style dataset of uint8 images from a bank of 64 random ones (cheap to collate; converted to float on
the GPU), so the loader is not what is measured.  A CPU dry run of the logic:
    torchrun --standalone --nproc-per-node 2 benchmarks/frameworks_gpu.py --device cpu --model resnet18 \\
        --image-size 32 --global-batch 16 --steps 6 --warmup 2 --rounds 1 --workers 0 --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import planner
from profiler.api import batches_from, profile_job
from profiler.sweep import SweepOptions
from profiler.workloads.emulate import Slowdown

SLOW_RANK, FACTOR = 1, 3.0


class Images(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """``n`` samples {"image": uint8 3xSxS, "label": int} cycling over a bank of 64 random images."""

    def __init__(self, n: int, size: int, classes: int = 1000) -> None:
        g = torch.Generator().manual_seed(0)
        self.n = n
        self.bank = torch.randint(0, 256, (64, 3, size, size), generator=g, dtype=torch.uint8)
        self.labels = torch.randint(0, classes, (64,), generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"image": self.bank[i % 64], "label": self.labels[i % 64]}


def make_model(name: str, channels_last: bool) -> torch.nn.Module:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None, num_classes=1000)
    return model.to(memory_format=torch.channels_last) if channels_last else model  # type: ignore[call-overload]


class Step:
    """The training step both variants run: uint8 -> float on the device, bf16 autocast, emulated slowdown."""

    def __init__(self, device: torch.device, rank: int, amp: bool) -> None:
        self.device, self.amp = device, amp
        self.slow = Slowdown(FACTOR if rank == SLOW_RANK else 1.0)
        self.cl = device.type == "cuda"

    def inputs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x = batch["image"].to(self.device, non_blocking=True).float().div_(255.0)
        if self.cl:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, batch["label"].to(self.device, non_blocking=True)

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x, y = self.inputs(batch)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            self.slow.apply(model, F.cross_entropy, x, y)  # rank 1: 2 extra fwd+bwd on the unwrapped module
            return F.cross_entropy(model(x), y)


def sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    return time.perf_counter()


class Window:
    """Timed window: from the end of step ``warmup`` to the end of the last step (synchronized at both ends)."""

    def __init__(self, device: torch.device, warmup: int, steps: int) -> None:
        self.device, self.warmup, self.steps = device, warmup, steps
        self.t0 = self.t1 = 0.0

    def after_step(self, i: int) -> None:
        if i + 1 == self.warmup:
            self.t0 = sync(self.device)
        elif i + 1 == self.steps:
            self.t1 = sync(self.device)


def run_lightning(variant: str, args: argparse.Namespace, step: Step, plan: planner.Plan, dev: torch.device) -> float:
    import lightning as L

    from runtime.adapters.lightning import LightningPlan

    window = Window(dev, args.warmup, args.steps)
    half = args.global_batch // 2

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model(args.model, dev.type == "cuda")
            self.data = Images(args.steps * args.global_batch, args.image_size)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return step.loss(self.net, batch)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            window.after_step(batch_idx)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

        def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
            return torch.utils.data.DataLoader(self.data, batch_size=half, shuffle=True, num_workers=args.workers,
                                               pin_memory=dev.type == "cuda", persistent_workers=False)

    kw: dict[str, Any] = {"strategy": "ddp"}
    if variant == "planned":
        planned = LightningPlan(plan, num_workers=args.workers)
        kw = {"strategy": planned.strategy, "callbacks": [planned.callback]}
    trainer = L.Trainer(accelerator="gpu" if dev.type == "cuda" else "cpu", devices=2, max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, **kw)
    trainer.fit(Module())
    return args.global_batch * (args.steps - args.warmup) / (window.t1 - window.t0)


def run_accelerate(variant: str, args: argparse.Namespace, step: Step, plan: planner.Plan, accelerator: Any,
                   dev: torch.device) -> float:
    from runtime.adapters.accelerate import planned_dataloader

    window = Window(dev, args.warmup, args.steps)
    model = make_model(args.model, dev.type == "cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = Images(args.steps * args.global_batch, args.image_size)
    if variant == "planned":
        loader = planned_dataloader(accelerator, plan, data, model=model, shuffle=True, num_workers=args.workers,
                                    pin_memory=dev.type == "cuda")
    else:
        loader = torch.utils.data.DataLoader(data, batch_size=args.global_batch // 2, shuffle=True,
                                             num_workers=args.workers, pin_memory=dev.type == "cuda")
    ddp, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for i, batch in enumerate(loader):
        loss = step.loss(ddp, batch)
        accelerator.backward(loss * loader.loss_scale() if variant == "planned" else loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        window.after_step(i)
    return args.global_batch * (args.steps - args.warmup) / (window.t1 - window.t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--framework", choices=("lightning", "accelerate"), default="lightning")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--model", default="resnet50", help="torchvision classification model (default resnet50)")
    p.add_argument("--image-size", type=int, default=224, metavar="PX")
    p.add_argument("--global-batch", type=int, default=512, metavar="B")
    p.add_argument("--steps", type=int, default=40, help="global steps per run (one epoch)")
    p.add_argument("--warmup", type=int, default=8, help="steps before the timed window")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=4, help="loader workers per rank (both variants)")
    p.add_argument("--quick", action="store_true", help="a short profile (CI-sized)")
    p.add_argument("--no-amp", action="store_true", help="float32 instead of bf16 autocast")
    p.add_argument("--json", default=None, help="output JSON (default $OUT/frameworks_gpu_<framework>.json)")
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.backends.cudnn.benchmark = True
    accelerator = None
    if args.framework == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=dev.type == "cpu")  # initializes the process group from torchrun's env
    else:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")  # Lightning uses this group
    rank = dist.get_rank()
    step = Step(dev, rank, amp=not args.no_amp)

    # 1. profile the very step the runs train (dict batches from the same dataset), solve on every rank alike
    data = Images(4096, args.image_size)
    t0 = time.perf_counter()
    profile = profile_job(lambda: make_model(args.model, dev.type == "cuda"), batches_from(data), step.loss, dev,
                          optimizer_fn=lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                          data=data, model_name=args.model, min_batch=2,
                          sweep=(SweepOptions.quick if args.quick else SweepOptions)(max_batch=args.global_batch))
    plan = planner.solve(profile, global_batch=args.global_batch, min_batch=2, min_gain=0.0)  # BatchNorm: >= 2
    profile_s = time.perf_counter() - t0
    if rank == 0:
        print(f"profiled in {profile_s:.0f} s (sweeps: {[r.meta.get('sweep_stop') for r in profile.ranks]}); "
              f"plan {list(plan.batch_sizes)}, predicted "
              f"{plan.predicted.samples_per_s / plan.predicted.equal_split_samples_per_s:.2f}x equal", flush=True)

    # 2. interleaved rounds
    rounds: list[dict[str, float]] = []
    for r in range(args.rounds):
        res = {}
        for variant in ("default", "planned"):
            if args.framework == "lightning":
                res[variant] = run_lightning(variant, args, step, plan, dev)
            else:
                res[variant] = run_accelerate(variant, args, step, plan, accelerator, dev)
        res["speedup"] = res["planned"] / res["default"]
        rounds.append(res)
        if rank == 0:
            print(f"round {r}: default {res['default']:.1f}  planned {res['planned']:.1f} samples/s  "
                  f"{res['speedup']:.3f}x", flush=True)

    if rank == 0:
        ups = [x["speedup"] for x in rounds]
        summary = {"median_speedup": statistics.median(ups), "min_speedup": min(ups), "max_speedup": max(ups),
                   "median_default_samples_per_s": statistics.median(x["default"] for x in rounds),
                   "median_planned_samples_per_s": statistics.median(x["planned"] for x in rounds)}
        print(f"{args.framework}: planned / default = {summary['median_speedup']:.3f}x "
              f"(min {summary['min_speedup']:.3f}, max {summary['max_speedup']:.3f}) over {len(rounds)} rounds",
              flush=True)
        out = Path(args.json or Path(os.environ.get("OUT", ".")) / f"frameworks_gpu_{args.framework}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "benchmark": "frameworks_gpu", "framework": args.framework, "args": vars(args),
            "heterogeneity": f"emulated compute skew: rank {SLOW_RANK} x{FACTOR} (profiler.workloads.emulate.Slowdown)",
            "emulate_mode": Slowdown(FACTOR).mode,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "torch": torch.__version__, "profile_s": profile_s, "plan": plan.to_dict(), "profile": profile.to_dict(),
            "rounds": rounds, "summary": summary}, indent=1))
        print(f"wrote {out}", flush=True)
    if accelerator is not None:
        accelerator.wait_for_everyone()
        accelerator.end_training()
    else:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
