"""Process-group set-up for every program: from torchrun's environment (or a FileStore), one device per rank.

What ranks exchange afterwards goes through ``runtime.collectives`` (JSON over tensors, never pickle).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from planner.errors import ValidationError


@dataclass(frozen=True, kw_only=True, slots=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None
    """None when running as a single process without a process group."""
    shared_gpu: bool = False
    """Two ranks of this host run on one GPU, so the job all-reduces over gloo (NCCL refuses a shared GPU)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def resolve_device(spec: str, local_rank: int, *, flag: str | None = None) -> torch.device:
    """`auto` -> cuda:LOCAL_RANK when CUDA is present, else cpu; `cuda` -> cuda:LOCAL_RANK; `cuda:N`; `cpu`.

    ``flag`` is what the user typed, for the error message (default ``--device SPEC``): an error that names
    ``--device`` when the user typed ``--devices cuda:0,cpu`` sends them to the wrong flag.
    """
    said = flag or f"--device {spec}"
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValidationError(f"{said}: {spec} asked for, but CUDA is not available on this machine; use cpu")
        index = local_rank if spec == "cuda" else int(spec.split(":", 1)[1])
        if index >= torch.cuda.device_count():
            raise ValidationError(
                f"{said}: local rank {local_rank} needs cuda:{index} but this host has "
                f"{torch.cuda.device_count()} GPU(s); launch fewer processes per node"
            )
        return torch.device("cuda", index)
    raise ValidationError(f"{said}: expected auto, cpu, cuda or cuda:N, got {spec!r}")


def rank_device_spec(device: str, rank_devices: str | None, rank: int, world_size: int) -> tuple[str, bool]:
    """(this rank's device spec, whether every rank is on CUDA).  `rank_devices` lists one spec per rank."""
    if rank_devices:
        specs = _device_specs(rank_devices)
        if len(specs) != world_size:
            raise ValidationError(
                f"--rank-devices lists {len(specs)} devices for world size {world_size}; give one per rank"
            )
        return specs[rank], all(s.startswith("cuda") for s in specs)
    all_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return device, all_cuda


def _device_specs(rank_devices: str) -> list[str]:
    """``--rank-devices`` as its list of device specs, one per rank."""
    return [s.strip() for s in rank_devices.split(",") if s.strip()]


def shares_gpu(device: str, rank_devices: str | None) -> bool:
    """Whether two ranks of this host are placed on one GPU (`--device cuda:N` with several local ranks, or a
    `cuda:N` listed twice in `--rank-devices`).  NCCL refuses two ranks on one device ("Duplicate GPU detected"),
    so such a job all-reduces over gloo, through host memory: slower, the same numbers."""
    if rank_devices:
        indexed = [s for s in _device_specs(rank_devices) if s.startswith("cuda:")]
        return len(indexed) != len(set(indexed))
    return device.startswith("cuda:") and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1


def init_from_env(device: str = "auto", rank_devices: str | None = None, *, backend: str | None = None,
                  timeout_s: float = 120.0, store: dist.Store | None = None) -> DistEnv:
    """Read RANK/WORLD_SIZE/LOCAL_RANK (torchrun); init NCCL when every rank is on its own GPU, gloo otherwise.

    Without WORLD_SIZE > 1 or MASTER_ADDR (one plain process) no group is made.  ``store`` rendezvous through it
    instead of MASTER_ADDR (``planner.cli.launch.spawn`` ranks); ``backend`` forces one (the profiler's control traffic
    is gloo for every device mix).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    spec, all_cuda = rank_device_spec(device, rank_devices, rank, world_size)
    dev = resolve_device(spec, local_rank, flag=f"--rank-devices {rank_devices}" if rank_devices else None)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world_size == 1 and "MASTER_ADDR" not in os.environ and store is None:
        return DistEnv(rank=0, world_size=1, local_rank=0, device=dev, backend=None)
    shared = all_cuda and shares_gpu(device, rank_devices)
    chosen = backend or ("nccl" if all_cuda and not shared else "gloo")
    if not dist.is_initialized():
        kw: dict[str, Any] = {"backend": chosen, "timeout": timedelta(seconds=timeout_s)}
        if chosen == "nccl":
            kw["device_id"] = dev
        if store is not None:
            kw.update(store=store, rank=rank, world_size=world_size)
        dist.init_process_group(**kw)
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=dev, backend=chosen,
                   shared_gpu=shared)


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def shutdown(env: DistEnv) -> None:
    if env.distributed and dist.is_initialized():
        dist.destroy_process_group()
