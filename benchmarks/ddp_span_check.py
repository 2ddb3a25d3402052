"""Per-rank prediction errors of recorded `planner train` launches, against the plan's standalone compute and
against the compute span the profile's own DDP rounds measured (offline; docs/BENCHMARKS.md section 26).

The run log's per-rank table compares what a rank was busy in a step (its compute span under DDP, forward start to
its last gradient bucket, plus its data wait) with the plan's per-rank time, which is the standalone step from the
profile's compute sweep.  Under DDP the rank's backward shares the GPU with the all-reduce of the buckets before its
last one, so the span runs longer than the standalone step, and the plan counts that time in its exposed
communication instead.  The profile's DDP rounds (``meta["ddp_cost[default]"]``) timed each rank's span at a
balanced split; their ratio to the standalone curve there (the optimizer step taken out: the span ends before it)
is the factor this script applies to a compute-bound rank's predicted time:

    predicted under DDP = (t_i(b_i) - opt_i) * span_i / (t_i(b'_i) - opt_i),  b' = the balanced batch

(the span ends before the optimizer step, which the standalone step t_i includes).

Nothing is fitted to the launch: the factor comes from the profile taken before training.  Loader-bound ranks
keep the plan's time (the loader's time is not the span).

    usage: python benchmarks/ddp_span_check.py docs/results/h200x2_train_auto_replan_s18a_skewS_r1 [...]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planner.curves import fit_envelope
from planner.profile import Profile
from planner.runlog import read_run_log


def check(prefix: str) -> list[tuple[int, float, float, float, float]]:
    """(rank, measured busy, plan's prediction, span factor, prediction under DDP) over the clean epochs 2-3."""
    profile = Profile.load(f"{prefix}_profile.json")
    ddp = json.loads(Path(f"{prefix}_profile.json").read_text())["meta"]["ddp_cost[default]"]
    plan = json.loads(Path(f"{prefix}_plan.json").read_text())
    log = read_run_log(f"{prefix}_run.jsonl")
    epochs = [e for e in log.epochs if e.epoch in (2, 3) and not e.drain_steps]
    rows = []
    for r in profile.by_rank:
        curve, opt = fit_envelope(r.compute), r.optimizer_step_s or 0.0
        factor = ddp["balanced_compute_s"][r.rank] / (curve(ddp["balanced_batches"][r.rank]) - opt)
        pr = plan["ranks"][r.rank]
        pred = statistics.median(e.predicted_step_time_s[r.rank] for e in epochs)
        busy = statistics.median(e.measured_busy_s[r.rank] for e in epochs)
        under = pred
        if pr["bottleneck"] == "compute":
            # the span ends before the optimizer step: a compute-bound rank's busy time is its span (its data
            # wait predicted nil)
            under = max((curve(pr["batch_size"]) - opt) * factor, pr.get("predicted_loader_s") or 0.0)
        rows.append((r.rank, busy, pred, factor, under))
    return rows


def main(argv: list[str]) -> int:
    print("| launch | rank | measured busy ms | plan ms | error | DDP span factor | under DDP ms | error |")
    print("|---|---|---|---|---|---|---|---|")
    for prefix in argv:
        for rank, busy, pred, factor, under in check(prefix):
            print(f"| {Path(prefix).name} | {rank} | {1e3 * busy:.2f} | {1e3 * pred:.2f} | {busy / pred - 1:+.1%} "
                  f"| {factor:.3f} | {1e3 * under:.2f} | {busy / under - 1:+.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
