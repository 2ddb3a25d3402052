"""One rank of benchmarks/fault_suite.py: docs/ADOPTING.md's own DDP loop on ``runtime.PlannedRun`` (re-planning at
every epoch end, the device state sampled at each), with one fault injected on one rank from a chosen epoch.

Faults (``--fault``, on ``--fault-rank`` from ``--fault-epoch`` on):

  cpu-hog       a busy process on this rank's cores: the driver starts it waiting on ``--start-file`` (so it is no
                process of this rank's), this rank touches the file when the fault epoch starts;
  gpu-cotenant  the same with benchmarks/cotenant.py on this rank's GPU;
  loader        the rank's DataLoader worker sleeps per sample, ``--loader-factor`` x the previous epoch's step per
                batch (its loader cannot keep up);
  memory        EMULATED: the rank's epoch-end device state reports the host's available memory at 2% of its total,
                and each step passes over a 256 MiB buffer about as long as the previous epoch's step (a real
                cost, of memory bandwidth); it scores the rule and the plumbing, not a real memory-pressure reading;
  step          a sleep of ``--step-factor`` x the previous epoch's step inside each step (between forward and
                backward: inside the compute span; no process, counter or clock shows it);
  none          nothing.

The batches come from a DataLoader with one worker (not persistent: each epoch's worker is forked with the epoch's
loader delay) over inputs made once in memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere: the repo's packages

from planner.devstate import DeviceState
from profiler.devstate import DeviceStateSampler
from profiler.workloads.specs import build_workload, synthetic_batch
from runtime import PlannedRun, register_weighted_hook

FAULTS = ("none", "cpu-hog", "gpu-cotenant", "loader", "memory", "step")


class Held(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Inputs held in memory; ``delay_s`` per sample in the worker that fetches it (0: none)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y, self.delay_s = x, y, 0.0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.x[i], self.y[i]


class LowMemoryState:
    """EMULATED memory pressure: the sampler's state with the available memory set to 2% of the total once on."""

    def __init__(self, inner: DeviceStateSampler) -> None:
        self.inner, self.on = inner, False

    def collect(self) -> DeviceState:
        s = self.inner.collect()
        if self.on and s.mem_total_bytes:
            return dataclasses.replace(s, mem_available_bytes=int(0.02 * s.mem_total_bytes))
        return s


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", required=True)
    p.add_argument("--profile", required=True)
    p.add_argument("--log-file", required=True)
    p.add_argument("--model", default="cifar_cnn")
    p.add_argument("--num-samples", type=int, default=768)
    p.add_argument("--image-size", type=int, default=None, help="input side (default: the model's)")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--devices", default="cpu,cpu")
    p.add_argument("--fault", choices=FAULTS, default="none")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-epoch", type=int, default=3)
    p.add_argument("--start-file", default=None, help="cpu-hog / gpu-cotenant: touched when the fault starts")
    p.add_argument("--loader-factor", type=float, default=3.0,
                   help="loader fault: the worker sleeps this many times the previous epoch's step per batch")
    p.add_argument("--step-factor", type=float, default=1.5,
                   help="step fault: a sleep of this many times the previous epoch's step, every step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pg-timeout-s", type=float, default=120.0)
    return p


def train(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    device = torch.device([s.strip() for s in args.devices.split(",")][rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    workload = build_workload(args.model, "fake", image_size=args.image_size, num_samples=args.num_samples)
    torch.manual_seed(1234)  # the same inputs on every rank, as a shared dataset
    x, y = synthetic_batch(workload, args.num_samples, "cpu")
    data = Held(x, y)
    torch.manual_seed(args.seed)
    model = DDP(workload.model_fn().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    mine = args.fault_rank == rank
    state: Any = DeviceStateSampler(device)
    if mine and args.fault == "memory":
        state = LowMemoryState(state)
    run = PlannedRun(args.plan, profile=args.profile, replan=True, log_file=args.log_file, seed=args.seed,
                     device_state=state)
    sampler = run.sampler_for(len(data), device)
    loader = DataLoader(data, batch_sampler=sampler, num_workers=1, pin_memory=device.type == "cuda")
    register_weighted_hook(model, sampler)
    run.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sleep_s, passes = 0.0, 1
    buf = torch.zeros(1) if not (mine and args.fault == "memory") else torch.zeros(64 << 20)  # 256 MiB of fp32
    losses = [0.0]
    step_s = 0.0  # the previous epoch's wall seconds per step (the box's load moves it; the faults scale with it)
    for epoch in range(args.epochs):
        on = mine and epoch >= args.fault_epoch
        if on and epoch == args.fault_epoch:
            sleep_s = args.step_factor * step_s
            if args.fault == "memory":  # passes over the buffer a step: about the previous epoch's step
                t = time.perf_counter()
                buf.add_(1.0)
                passes = max(1, round(step_s / max(time.perf_counter() - t, 1e-4)))
            data.delay_s = args.loader_factor * step_s / max(1, sampler.batch_sizes[rank])
        if on and epoch == args.fault_epoch:
            if args.start_file and args.fault in ("cpu-hog", "gpu-cotenant"):
                Path(args.start_file).touch()
            if isinstance(state, LowMemoryState):
                state.on = True
        if not (on and args.fault == "loader"):
            data.delay_s = 0.0
        t0, steps = time.perf_counter(), 0
        for xb, yb in run.epoch(epoch, loader, last=epoch == args.epochs - 1, loss=lambda: losses[-1]):
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            loss = workload.loss_fn(model(xb), yb)
            if on and args.fault == "step":
                time.sleep(sleep_s)  # inside the compute span: after the forward, before the backward
            elif on and args.fault == "memory":
                for _ in range(passes):  # every page of the buffer
                    buf.add_(1.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[-1] = float(loss.detach())
            steps += 1
        if not on:
            step_s = (time.perf_counter() - t0) / max(1, steps)


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout_s))
    try:
        train(args)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
