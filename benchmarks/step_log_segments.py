"""Where an epoch's time goes, from `planner train --step-log` files: the step time over segments of each epoch.

Session 10 (2x H100, docs/BENCHMARKS.md section 18) read 100-step epochs this way: the steps after the loaders'
pipeline fill ran at the predicted pace, and the fill -- the first batch's build, cycle-boundary data waits, steps
slowed while every worker built at once -- made up the rest.  For each epoch of each ``<tag>_steps<rank>.jsonl``
pair: per segment (``--segments 2-30,30-60,60-100``, step indices, end exclusive) the job's mean and median step
(each rank's over the segment, the slowest rank's, as `planner train` reads an epoch) and each rank's summed data
wait; the epoch's plan prediction
beside them when ``<tag>_plan.json`` is there; and the steps longer than ``--stall-ms`` on any rank, with each rank's data wait in them.

    python benchmarks/step_log_segments.py docs/results/h100x2_train_auto_replan_s10c_loader_r1 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def read_step_logs(prefix: str) -> dict[int, list[dict[str, Any]]]:
    """Rank -> its epochs' lines of ``<prefix>_steps<rank>.jsonl`` (ranks 0, 1, .. while the files exist)."""
    out: dict[int, list[dict[str, Any]]] = {}
    rank = 0
    while Path(f"{prefix}_steps{rank}.jsonl").exists():
        out[rank] = [json.loads(x) for x in Path(f"{prefix}_steps{rank}.jsonl").read_text().splitlines() if x]
        rank += 1
    return out


def _read(prefix: str) -> dict[int, list[dict[str, Any]]]:
    out = read_step_logs(prefix)
    if not out:
        raise SystemExit(f"step_log_segments: no {prefix}_steps0.jsonl")
    return out


def segments(prefix: str, spans: list[tuple[int, int]], stall_ms: float = 150.0) -> dict[str, Any]:
    """The summary of one launch's step logs (module docstring)."""
    logs = _read(prefix)
    plan = Path(f"{prefix}_plan.json")
    predicted = json.loads(plan.read_text())["predicted"]["step_time_s"] * 1e3 if plan.exists() else None
    epochs = []
    for e in range(min(len(v) for v in logs.values())):
        rows = [logs[r][e] for r in sorted(logs)]
        steps = [max(v) for v in zip(*(x["step_time_ms"] for x in rows), strict=False)]
        segs = []
        for lo, hi in spans:
            if not steps[lo:hi]:
                continue
            # as `planner train` reads an epoch: each rank's mean, and the slowest rank's is the job's
            segs.append({"steps": [lo, min(hi, len(steps))],
                         "mean_ms": max(statistics.fmean(x["step_time_ms"][lo:hi]) for x in rows),
                         "median_ms": max(statistics.median(x["step_time_ms"][lo:hi]) for x in rows),
                         "data_wait_ms_sum": [sum(x["data_wait_ms"][lo:hi]) for x in rows]})
        stalls = [[i, round(t, 1), *[round(x["data_wait_ms"][i], 1) for x in rows]]
                  for i, t in enumerate(steps) if t > stall_ms]
        epochs.append({"epoch": rows[0]["epoch"], "steps": len(steps), "segments": segs, "stalls": stalls})
    return {"prefix": prefix, "predicted_step_ms": predicted, "epochs": epochs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prefixes", nargs="+", help="<dir>/<tag>: <tag>_steps<rank>.jsonl and <tag>_plan.json")
    ap.add_argument("--segments", default="2-30,30-60,60-100")
    ap.add_argument("--stall-ms", type=float, default=150.0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    spans = [(int(a), int(b)) for a, b in (s.split("-") for s in args.segments.split(","))]
    out = [segments(p, spans, args.stall_ms) for p in args.prefixes]
    for launch in out:
        print(f"{launch['prefix']}: predicted step {launch['predicted_step_ms']:.1f} ms"
              if launch["predicted_step_ms"] else launch["prefix"])
        for ep in launch["epochs"]:
            cells = "  ".join(f"{s['steps'][0]}-{s['steps'][1]}: {s['mean_ms']:.1f} (median {s['median_ms']:.1f})"
                              for s in ep["segments"])
            print(f"  epoch {ep['epoch']}: {cells}  stalls>{args.stall_ms:.0f} ms: {len(ep['stalls'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
