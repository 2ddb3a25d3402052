"""What hardware and software a rank runs on: device, host, versions, model size.

NVML (nvidia-ml-py, through profiler.nvml) adds the SM clock, memory clock, PCIe link and NVLink count where the
driver gives them; every NVML call is guarded, so a machine without a GPU, a driver or the package still
profiles (the facts are simply absent).  What changes while a rank runs -- other processes, clocks, throttling,
load -- is sampled by profiler.devstate.
"""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

from planner.profile import HostProfile, ModelInfo
from profiler import nvml
from profiler.loader import usable_cores
from profiler.memory import host_memory_bytes

# Host and device names have one definition, shared with the run's side of the plan's workload check
# (runtime.workload): a run on the profiled machine matches its profile by construction.
from runtime.workload import HOST_ID_ENV, device_name, host_name, machine_name, model_fingerprint  # noqa: F401

_NODE_ENV = (("group_rank", "GROUP_RANK"), ("group_world_size", "GROUP_WORLD_SIZE"), ("local_rank", "LOCAL_RANK"),
             ("local_world_size", "LOCAL_WORLD_SIZE"), ("restart_count", "TORCHELASTIC_RESTART_COUNT"))


def node_facts() -> dict[str, int] | None:
    """Where torchrun put this rank: its node (``GROUP_RANK`` of ``GROUP_WORLD_SIZE``), its local rank of
    ``LOCAL_WORLD_SIZE`` and the elastic restart count; None outside torchrun.  Nodes of different sizes each
    have their own ``LOCAL_WORLD_SIZE`` (their ``--nproc-per-node``); global ranks are numbered node by node."""
    if "GROUP_RANK" not in os.environ or "LOCAL_WORLD_SIZE" not in os.environ:
        return None
    out = {}
    for key, var in _NODE_ENV:
        try:
            out[key] = int(os.environ[var])
        except (KeyError, ValueError):
            continue
    return out


def host_profile() -> HostProfile:
    return HostProfile(name=host_name(), cpu_cores=usable_cores(), memory_bytes=host_memory_bytes())


def software_facts() -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def model_info(name: str, model: torch.nn.Module) -> ModelInfo:
    params = [p for p in model.parameters()]
    return ModelInfo(
        name=name,
        num_params=sum(p.numel() for p in params),
        grad_bytes=sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        structure=model_fingerprint(model),
    )


def device_facts(device: torch.device) -> tuple[str, dict[str, Any]]:
    """(device name, facts for RankProfile.meta)."""
    if device.type != "cuda":
        return device_name(device), {"torch_threads": torch.get_num_threads()}
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    facts: dict[str, Any] = {
        "sm_count": props.multi_processor_count,
        "compute_capability": f"{props.major}.{props.minor}",
        "total_memory_bytes": int(props.total_memory),
    }
    facts.update(_nvml_facts(index))
    return device_name(torch.device("cuda", index)), facts


def _nvml_facts(index: int) -> dict[str, Any]:
    dev = nvml.open_torch_device(torch.device("cuda", index))
    if dev is None:
        return {}
    pynvml, handle = dev.raw()
    out: dict[str, Any] = {}
    try:
        queries = {
            "sm_clock_max_mhz": lambda: dev.max_clock_mhz("sm"),
            "mem_clock_max_mhz": lambda: dev.max_clock_mhz("mem"),
            "sm_clock_mhz": lambda: dev.clock_mhz("sm"),
            "power_limit_w": dev.power_limit_w,
            "pcie_gen": lambda: dev.pcie_link()[0],
            "pcie_width": lambda: dev.pcie_link()[1],
            "gpu_utilization_pct": lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu,
            "nvlink_active_links": lambda: _nvlinks(pynvml, handle),
            "driver": lambda: _text(pynvml.nvmlSystemGetDriverVersion()),
            # A co-tenant changes the measured speed; who it is lives in RankProfile.device_state.
            "gpu_processes": lambda: len(dev.compute_processes()),
        }
        for key, query in queries.items():
            try:
                out[key] = query()
            except Exception:  # a field the driver or card does not support
                continue
    finally:
        dev.close()
    return out


def _nvlinks(pynvml: Any, handle: Any) -> int:
    n = 0
    for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                n += 1
        except Exception:
            break
    return n


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
