"""The DDP constructor settings a plan records, checked: ``ddp_kwargs(plan)``.

benchmarks/comm_breakdown.py --choose measures ``bucket_cap_mb``, ``gradient_as_bucket_view`` and
``static_graph`` on the real backend and writes the winners to ``plan.meta["ddp"]``. `planner train`, the own
loop (``DDP(model, device_ids=..., **run.ddp_kwargs())`` with ``runtime.PlannedRun``) and the adapters apply them
through this one check. None of them changes the update: buckets only group gradients for the all-reduce; a
bucket view and a static graph change where gradients live and when DDP checks the graph. ``meta`` is not part of
the plan's fingerprint, so the check runs where the settings are read, not where the plan is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from planner.errors import ValidationError
from planner.plan import Plan

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
            raise ValidationError(f"plan.meta.ddp.{key}: not a DDP setting a plan may set (one of "
                                  f"{', '.join(DDP_SETTINGS)})")
        if key == "bucket_cap_mb":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value <= 1024:
                raise ValidationError(f"plan.meta.ddp.bucket_cap_mb must be a number of MiB in [1, 1024], got {value!r}")
            out[key] = float(value)
        elif not isinstance(value, bool):
            raise ValidationError(f"plan.meta.ddp.{key} must be true or false, got {value!r}")
        else:
            out[key] = value
    return out


def ddp_kwargs(plan: Plan) -> dict[str, Any]:
    """The checked DDP constructor keywords ``plan`` records ({} when it records none): pass them as
    ``DistributedDataParallel(model, device_ids=..., **ddp_kwargs(plan))``."""
    return ddp_settings_from(plan.meta)


def settings_missing(ddp_model: Any, settings: Mapping[str, Any]) -> list[str]:
    """The ``settings`` (checked ``ddp_kwargs``) that the built ``DistributedDataParallel`` does not have, as
    ``key=value`` ([] when it has them all): for an adapter that gets the model already wrapped."""
    have = {"bucket_cap_mb": getattr(ddp_model, "bucket_bytes_cap", None),
            "gradient_as_bucket_view": getattr(ddp_model, "gradient_as_bucket_view", None),
            "static_graph": getattr(ddp_model, "static_graph", None)}
    want = {k: int(v * 1024 * 1024) if k == "bucket_cap_mb" else v for k, v in settings.items()}
    return [f"{k}={settings[k]}" for k in sorted(want) if have.get(k) != want[k]]
