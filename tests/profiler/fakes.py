"""A fake GPU behind profiler.nvml's NvmlDevice interface: canned readings, no driver, nothing monkeypatched."""

from __future__ import annotations

from dataclasses import dataclass, field


class Unsupported(Exception):
    """What a real NVML raises for a field the card or driver does not have (NVMLError_NotSupported)."""


@dataclass
class FakeNvml:
    """Each reading comes from the next entry of its list (the last one repeats); None entries raise Unsupported."""

    processes: list[list[tuple[int, int | None]] | None] = field(default_factory=lambda: [[]])
    sm_clocks: list[int | None] = field(default_factory=lambda: [1980])
    mem_clocks: list[int | None] = field(default_factory=lambda: [2619])
    throttle_masks: list[int | None] = field(default_factory=lambda: [0])
    powers_w: list[float | None] = field(default_factory=lambda: [650.0])
    temperatures_c: list[float | None] = field(default_factory=lambda: [60.0])
    sm_clock_max: int | None = 1980
    mem_clock_max: int | None = 2619
    power_limit: float | None = 700.0
    link: tuple[int, int] | None = (5, 16)
    link_max: tuple[int, int] | None = (5, 16)
    mig: bool | None = False
    mode: int | None = 0
    bus_id: str | None = "00000000:17:00.0"
    closed: bool = False
    calls: int = 0
    _cursor: dict[str, int] = field(default_factory=dict)

    def _next(self, name: str, values: list) -> object:
        i = self._cursor.get(name, 0)
        self._cursor[name] = i + 1
        value = values[min(i, len(values) - 1)]
        self.calls += 1
        if value is None:
            raise Unsupported(name)
        return value

    @staticmethod
    def _fixed(value: object, name: str) -> object:
        if value is None:
            raise Unsupported(name)
        return value

    def compute_processes(self) -> list[tuple[int, int | None]]:
        return list(self._next("processes", self.processes))  # type: ignore[call-overload]

    def clock_mhz(self, kind: str) -> int:
        return self._next(kind, self.sm_clocks if kind == "sm" else self.mem_clocks)  # type: ignore[return-value]

    def max_clock_mhz(self, kind: str) -> int:
        return self._fixed(self.sm_clock_max if kind == "sm" else self.mem_clock_max, kind)  # type: ignore[return-value]

    def throttle_mask(self) -> int:
        return self._next("throttle", self.throttle_masks)  # type: ignore[return-value]

    def power_w(self) -> float:
        return self._next("power", self.powers_w)  # type: ignore[return-value]

    def power_limit_w(self) -> float:
        return self._fixed(self.power_limit, "power_limit")  # type: ignore[return-value]

    def temperature_c(self) -> float:
        return self._next("temperature", self.temperatures_c)  # type: ignore[return-value]

    def pcie_link(self) -> tuple[int, int]:
        return self._fixed(self.link, "link")  # type: ignore[return-value]

    def pcie_link_max(self) -> tuple[int, int]:
        return self._fixed(self.link_max, "link_max")  # type: ignore[return-value]

    def mig_enabled(self) -> bool:
        return self._fixed(self.mig, "mig")  # type: ignore[return-value]

    def compute_mode(self) -> int:
        return self._fixed(self.mode, "mode")  # type: ignore[return-value]

    def pci_bus_id(self) -> str:
        return self._fixed(self.bus_id, "bus")  # type: ignore[return-value]

    def close(self) -> None:
        self.closed = True


def unsupported_everywhere() -> FakeNvml:
    """A card (or a MIG slice, or a container) that answers nothing."""
    return FakeNvml(processes=[None], sm_clocks=[None], mem_clocks=[None], throttle_masks=[None], powers_w=[None],
                    temperatures_c=[None], sm_clock_max=None, mem_clock_max=None, power_limit=None, link=None,
                    link_max=None, mig=None, mode=None, bus_id=None)

