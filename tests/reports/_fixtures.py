"""Profiles and a run log small enough to check by hand."""

from __future__ import annotations

import json
from pathlib import Path

from planner.plan import Plan
from planner.profile import ComputePoint, HostProfile, LoaderProfile, Profile, RankProfile


def linear_rank(rank: int, sec_per_sample: float, *, host: str = "node0", loader_s: float | None = None) -> RankProfile:
    """t(b) = sec_per_sample * b exactly: two points on a line through the origin."""
    return RankProfile(
        rank=rank,
        host=host,
        device=f"cuda:{rank}",
        compute=(ComputePoint(batch_size=10, step_time_s=10 * sec_per_sample),
                 ComputePoint(batch_size=100, step_time_s=100 * sec_per_sample)),
        loader=None if loader_s is None else LoaderProfile(sec_per_sample=loader_s),
    )


def three_rank_profile() -> Profile:
    """1, 2 and 4 ms per sample, no loader, no memory, no comm: at B = 700 the optimum is 400/200/100, T = 0.4 s."""
    return Profile(
        hosts=(HostProfile(name="node0", cpu_cores=16),),
        ranks=(linear_rank(0, 0.001), linear_rank(1, 0.002), linear_rank(2, 0.004)),
    )


def write_run_log(path: Path, plan: Plan, *, truncated_tail: bool = True) -> Path:
    """Two epochs, a rejected and an adopted re-plan, extra keys everywhere, and a half-written last line."""
    W = plan.world_size
    pred = [r.predicted_step_time_s for r in plan.ranks]

    def ranks(epoch: int, slow: float) -> list[dict[str, object]]:
        return [
            {"rank": i, "epoch": epoch, "num_steps": 50, "batch_size": r.batch_size, "num_workers": r.num_workers,
             "data_wait_s": 0.001, "compute_s": pred[i] * (slow if i == W - 1 else 1.0) - 0.001,
             "step_time_s": max(pred) * slow + 0.002, "compute_s_std": 0.0005, "gpu_util": 0.9}
            for i, r in enumerate(plan.ranks)
        ]

    events = [
        {"event": "start", "time": 1700000000.0, "world_size": W, "global_batch": plan.global_batch,
         "plan": plan.to_dict(), "host": "node0"},
        {"event": "epoch", "epoch": 0, "plan_fingerprint": plan.fingerprint, "samples_per_s": 1000.0,
         "step_time_s": 0.5, "loss": 2.3, "ranks": ranks(0, 1.25), "predicted_step_time_s": pred, "lr": 0.1},
        {"event": "replan", "epoch": 0, "adopted": False, "reason": "gain 0.8% below threshold 2%",
         "predicted_gain": 0.008, "old_batch_sizes": list(plan.batch_sizes), "new_batch_sizes": list(plan.batch_sizes),
         "measured_compute_s": pred, "predicted_compute_s": pred, "plan": None},
        {"event": "epoch", "epoch": 1, "plan_fingerprint": plan.fingerprint, "samples_per_s": 1100.0,
         "step_time_s": 0.45, "loss": 1.9, "ranks": ranks(1, 1.0), "predicted_step_time_s": pred},
        {"event": "replan", "epoch": 1, "adopted": True, "reason": "rank 2 slowed down",
         "predicted_gain": 0.12, "old_batch_sizes": list(plan.batch_sizes),
         "new_batch_sizes": list(plan.batch_sizes), "measured_compute_s": pred, "predicted_compute_s": pred,
         "plan": plan.to_dict()},
        {"event": "something_new", "epoch": 1},
        {"event": "end", "time": 1700000100.0, "epochs": 2},
    ]
    text = "\n".join(json.dumps(e) for e in events) + "\n"
    if truncated_tail:
        text += '{"event": "epoch", "epoch": 2, "ranks": [{"rank'
    path.write_text(text, encoding="utf-8")
    return path
