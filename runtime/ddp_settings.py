"""The DDP constructor settings a plan records, checked: ``ddp_kwargs(plan)``.

benchmarks/comm_breakdown.py --choose measures ``bucket_cap_mb``, ``gradient_as_bucket_view`` and
``static_graph`` on the real backend and writes the winners to ``plan.meta["ddp"]``. `planner train`, the own
loop (``DDP(model, device_ids=..., **run.ddp_kwargs())`` with ``runtime.PlannedRun``) and the adapters apply them
through this one check (``planner.ddp_settings``, which the plan loader runs too, so `planner validate` refuses
what they would). None of them changes the update: buckets only group gradients for the all-reduce; a bucket view
and a static graph change where gradients live and when DDP checks the graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from planner.ddp_settings import DDP_SETTINGS, ddp_settings_from  # noqa: F401  (re-exported)
from planner.plan import Plan


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
