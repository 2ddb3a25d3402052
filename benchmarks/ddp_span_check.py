"""Per-rank prediction errors of recorded `planner train` launches: against the plan's standalone times, and against
the compute span under DDP that the plan now predicts (``RankPlan.predicted_busy_s``; docs/BENCHMARKS.md section 26).

The run log's per-rank table compares what a rank was busy in a step (its compute span under DDP, forward start to
its last gradient bucket, plus its data wait) with the plan's per-rank time.  Launches recorded before session 18's
change compared it with the standalone step from the profile's compute sweep.  Under DDP the backward shares the
device with the all-reduce of the buckets before the last one, so the span runs longer, and the plan counts that
time in its exposed communication instead.  This script gives each recorded profile the span factors of the DDP
rounds its meta keeps (``planner.comm_model.recorded_span_factors``, the same numbers the profiler now records),
evaluates the launch's split and workers with them (``planner.evaluate``), and compares both predictions with the
ranks' median busy time over the clean epochs 2-3.  Nothing is fitted to the launch.

    usage: python benchmarks/ddp_span_check.py docs/results/h200x2_train_auto_replan_s18a_skewS_r1 [...]
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planner import Plan, Profile, evaluate
from planner.comm_model import recorded_span_factors
from planner.runlog import read_run_log


def check(prefix: str) -> list[tuple[int, str, float, float, float | None]]:
    """(rank, bottleneck, measured busy, plan's standalone time, predicted under DDP or None) by rank."""
    profile, plan = Profile.load(f"{prefix}_profile.json"), Plan.load(f"{prefix}_plan.json")
    spans = recorded_span_factors(profile)
    if profile.comm is None or spans is None:
        raise SystemExit(f"{prefix}_profile.json: no DDP rounds in its meta")
    profile = dataclasses.replace(profile, comm=dataclasses.replace(profile.comm, span_factors=spans))
    again = evaluate(profile, plan.batch_sizes, num_workers=[r.num_workers for r in plan.ranks], min_batch=plan.min_batch)
    epochs = [e for e in read_run_log(f"{prefix}_run.jsonl").epochs if e.epoch in (2, 3) and not e.drain_steps]
    if not epochs:
        raise ValueError("no clean epoch 2 or 3")
    rows = []
    for r, new in zip(plan.ranks, again.ranks, strict=True):
        busy = statistics.median(e.measured_busy_s[r.rank] for e in epochs)
        rows.append((r.rank, r.bottleneck, busy, r.predicted_step_time_s, new.predicted_busy_s))
    return rows


def main(argv: list[str]) -> int:
    print("| launch | rank | bottleneck | measured busy ms | plan ms | error | under DDP ms | error |")
    print("|---|---|---|---|---|---|---|---|")
    errors: dict[str, list[float]] = {"standalone": [], "under DDP": []}
    skipped = []
    for arg in argv:
        prefix = arg.removesuffix("_run.jsonl")  # a launch's prefix, or its run log (a shell glob)
        try:
            rows = check(prefix)
        except (SystemExit, FileNotFoundError, ValueError) as e:  # no DDP rounds recorded, or files missing
            skipped.append(f"{Path(prefix).name} ({str(e).split(':')[-1].strip() or type(e).__name__})")
            continue
        for rank, bottleneck, busy, pred, under in rows:
            tail = "- | -" if under is None else f"{1e3 * under:.2f} | {busy / under - 1:+.1%}"
            print(f"| {Path(prefix).name} | {rank} | {bottleneck} | {1e3 * busy:.2f} | {1e3 * pred:.2f} "
                  f"| {busy / pred - 1:+.1%} | {tail} |")
            if under is not None:  # the ranks the change concerns: compute-bound ones
                errors["standalone"].append(busy / pred - 1)
                errors["under DDP"].append(busy / under - 1)
    if len(errors["standalone"]) > 1:
        print(f"\n{len(errors['standalone'])} compute-bound ranks of {len(argv) - len(skipped)} launches:")
        for name, xs in errors.items():
            size = sorted(abs(x) for x in xs)
            print(f"  {name}: median error {statistics.median(xs):+.1%}, median |error| {statistics.median(size):.1%}, "
                  f"largest {size[-1]:.1%}, {sum(x <= 0.05 for x in size)} within 5%")
    if skipped:
        print(f"skipped {len(skipped)}: " + ", ".join(skipped))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
