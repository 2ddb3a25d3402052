"""``PlannedRun`` moved to ``runtime.run`` (it is the runtime protocol every loop runs on, not an adapter); this name
stays importable for scripts written against it."""

from __future__ import annotations

from runtime.run import PlannedRun

__all__ = ["PlannedRun"]
