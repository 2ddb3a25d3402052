"""NVML behind a small interface: what the profiler asks of one GPU, so a fake can stand in for the driver.

``NvmlDevice`` is the interface (a Protocol): one method per question, each allowed to raise when the driver or
card does not support it (the caller treats that as "absent").  ``open_device(index, uuid=...)`` gives the real
one, backed by nvidia-ml-py (``import pynvml``), or None when there is no package, no driver or no such GPU --
silently: a CPU-only machine must profile without a warning.  Tests pass their own object with the same methods
(tests/profiler/fakes.py); nothing here is monkeypatched.

NVML's device index ignores CUDA_VISIBLE_DEVICES while CUDA's follows it, so the device is found by UUID where
torch gives one, by index otherwise.
"""

from __future__ import annotations

from typing import Any, Protocol

# NVML clock-event ("throttle") reason bits, stable across driver versions (nvml.h nvmlClocksEventReason*).
THROTTLE_BITS: tuple[tuple[int, str], ...] = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal"),
    (0x40, "hw_thermal"),
    (0x80, "hw_power_brake"),
    (0x100, "display_clock_setting"),
)
COMPUTE_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}


def throttle_names(mask: int) -> tuple[str, ...]:
    """Reason names of an NVML clock-event bitmask, in bit order (unknown bits as hex)."""
    names = [name for bit, name in THROTTLE_BITS if mask & bit]
    known = sum(bit for bit, _ in THROTTLE_BITS)
    if mask & ~known:
        names.append(f"0x{mask & ~known:x}")
    return tuple(names)


class NvmlDevice(Protocol):
    """One GPU as NVML sees it.  Every method may raise (unsupported field, lost GPU): callers guard each."""

    def compute_processes(self) -> list[tuple[int, int | None]]:
        """(pid, used GPU bytes or None) of every compute process on the device, this one included."""
        ...

    def clock_mhz(self, kind: str) -> int:
        """Current clock; kind 'sm' or 'mem'."""
        ...

    def max_clock_mhz(self, kind: str) -> int:
        ...

    def throttle_mask(self) -> int:
        ...

    def power_w(self) -> float:
        ...

    def power_limit_w(self) -> float:
        """The enforced limit (what the card is held to now, not the default)."""
        ...

    def temperature_c(self) -> float:
        ...

    def pcie_link(self) -> tuple[int, int]:
        """(generation, width) of the link now."""
        ...

    def pcie_link_max(self) -> tuple[int, int]:
        ...

    def mig_enabled(self) -> bool:
        ...

    def compute_mode(self) -> int:
        ...

    def pci_bus_id(self) -> str:
        """As NVML writes it: '00000000:17:00.0'."""
        ...

    def close(self) -> None:
        ...


class PynvmlDevice:
    """NvmlDevice over nvidia-ml-py.  Holds one nvmlInit (NVML counts them) until ``close``."""

    def __init__(self, pynvml: Any, handle: Any) -> None:
        self._nv, self._h = pynvml, handle
        self._open = True

    def compute_processes(self) -> list[tuple[int, int | None]]:
        out = []
        for p in self._nv.nvmlDeviceGetComputeRunningProcesses(self._h):
            used = getattr(p, "usedGpuMemory", None)
            # NVML reports "not available" (containers without the permission) as None or as a sentinel ~2^64.
            out.append((int(p.pid), int(used) if isinstance(used, int) and 0 <= used < 1 << 62 else None))
        return out

    def _clock_type(self, kind: str) -> Any:
        return self._nv.NVML_CLOCK_SM if kind == "sm" else self._nv.NVML_CLOCK_MEM

    def clock_mhz(self, kind: str) -> int:
        return int(self._nv.nvmlDeviceGetClockInfo(self._h, self._clock_type(kind)))

    def max_clock_mhz(self, kind: str) -> int:
        return int(self._nv.nvmlDeviceGetMaxClockInfo(self._h, self._clock_type(kind)))

    def throttle_mask(self) -> int:
        # Renamed "clocks event reasons" in newer drivers; the older name still exists in most bindings.
        fn = getattr(self._nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            self._nv.nvmlDeviceGetCurrentClocksThrottleReasons
        return int(fn(self._h))

    def power_w(self) -> float:
        return float(self._nv.nvmlDeviceGetPowerUsage(self._h)) / 1000.0

    def power_limit_w(self) -> float:
        return float(self._nv.nvmlDeviceGetEnforcedPowerLimit(self._h)) / 1000.0

    def temperature_c(self) -> float:
        return float(self._nv.nvmlDeviceGetTemperature(self._h, self._nv.NVML_TEMPERATURE_GPU))

    def pcie_link(self) -> tuple[int, int]:
        return (int(self._nv.nvmlDeviceGetCurrPcieLinkGeneration(self._h)),
                int(self._nv.nvmlDeviceGetCurrPcieLinkWidth(self._h)))

    def pcie_link_max(self) -> tuple[int, int]:
        return (int(self._nv.nvmlDeviceGetMaxPcieLinkGeneration(self._h)),
                int(self._nv.nvmlDeviceGetMaxPcieLinkWidth(self._h)))

    def mig_enabled(self) -> bool:
        current, _pending = self._nv.nvmlDeviceGetMigMode(self._h)
        return bool(current)

    def compute_mode(self) -> int:
        return int(self._nv.nvmlDeviceGetComputeMode(self._h))

    def pci_bus_id(self) -> str:
        bus = self._nv.nvmlDeviceGetPciInfo(self._h).busId
        return bus.decode() if isinstance(bus, bytes) else str(bus)

    # -- used by profiler.inventory's static facts ---------------------------------------------------------------
    def raw(self) -> tuple[Any, Any]:
        """(the pynvml module, the device handle) for one-off queries."""
        return self._nv, self._h

    def close(self) -> None:
        if self._open:
            self._open = False
            try:
                self._nv.nvmlShutdown()
            except Exception:  # already shut down / driver gone: nothing left to release
                pass


def open_device(index: int, *, uuid: str | None = None) -> PynvmlDevice | None:
    """The GPU with this UUID (or CUDA index) through NVML; None when NVML cannot be used here (no warning)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver / no GPU
        return None
    try:
        handle = None
        if uuid:
            text = str(uuid)
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}")
            except Exception:
                handle = None
        if handle is None:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
        return None
    return PynvmlDevice(pynvml, handle)


def open_torch_device(device: Any) -> PynvmlDevice | None:
    """open_device for a torch CUDA device (matched by its UUID); None for CPU devices or without NVML."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    try:
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    except Exception:
        uuid = None
    return open_device(index, uuid=None if uuid is None else str(uuid))
