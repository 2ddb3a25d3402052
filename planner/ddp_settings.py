"""The DDP constructor settings a plan records (``plan.meta["ddp"]``), checked: ``ddp_settings_from(meta)``.

benchmarks/comm_breakdown.py --choose measures ``bucket_cap_mb``, ``gradient_as_bucket_view`` and ``static_graph``
and writes the winners to a plan's ``meta["ddp"]``.  ``meta`` is not part of the plan's fingerprint, but these
settings are applied, so the plan loader checks them (``Plan.from_dict``) as `planner train`, the own loop and the
adapters do where they apply them (``runtime.ddp_settings``): `validate` refuses the plan that `train` would.  Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from planner.errors import ValidationError
from planner.shown import shown

DDP_SETTINGS = ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph")
"""The DDP constructor keywords a plan may set (``plan.meta["ddp"]``)."""


def ddp_settings_from(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The DDP keyword arguments recorded in a plan's ``meta["ddp"]`` ({} when none), checked: only
    ``DDP_SETTINGS``, bucket_cap_mb a number in [1, 1024], the others true/false (a ValidationError otherwise)."""
    raw = meta.get("ddp") or {}
    if not isinstance(raw, Mapping):
        raise ValidationError(f"plan.meta.ddp must be an object of DDP settings, got {type(raw).__name__}")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in DDP_SETTINGS:
            raise ValidationError(f"plan.meta.ddp.{shown(key)[1:-1] if isinstance(key, str) else key}: not a DDP "
                                  f"setting a plan may set (one of {', '.join(DDP_SETTINGS)})")
        if key == "bucket_cap_mb":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value <= 1024:
                raise ValidationError(f"plan.meta.ddp.bucket_cap_mb must be a number of MiB in [1, 1024], got "
                                      f"{shown(value)}")
            out[key] = float(value)
        elif not isinstance(value, bool):
            raise ValidationError(f"plan.meta.ddp.{key} must be true or false, got {shown(value)}")
        else:
            out[key] = value
    return out


__all__ = ["DDP_SETTINGS", "ddp_settings_from"]
