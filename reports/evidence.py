"""The evidence rules (what a rank's DeviceState shows against a reference state) live in ``planner.evidence``, so
the runtime's live diagnosis (runtime.diagnose) and the report name causes by the same rules; this name stays for
the report's modules and older imports."""

from planner.evidence import (
                              CLOCK_LOW_FRAC,
                              CPU_OTHER_MIN_CORES,
                              CPU_OTHER_MIN_FRAC,
                              HOT_C,
                              HOTTER_C,
                              LOW_MEMORY_FRAC,
                              POWER_AT_CAP_FRAC,
                              STEAL_MIN_CORES,
                              Evidence,
                              checked,
                              compare,
                              cores_text,
                              gib,
)

__all__ = ["CLOCK_LOW_FRAC", "CPU_OTHER_MIN_CORES", "CPU_OTHER_MIN_FRAC", "HOTTER_C", "HOT_C", "LOW_MEMORY_FRAC",
           "POWER_AT_CAP_FRAC", "STEAL_MIN_CORES", "Evidence", "checked", "compare", "cores_text", "gib"]
