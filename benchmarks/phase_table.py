"""Did the ranks start their steps out of step when one rank's compute ran long?  (#16 item 4, #18; section 24)

Session 16 (2x H100, docs/BENCHMARKS.md section 24): rank 0's compute span (forward start to its last gradient
bucket, CUDA events) ran 20-50 ms long in 15-40% of the skew case's steps in `planner train`, but stayed flat (p90
within 0.3 ms of its median) on one GPU beside 30 CPU burners or a 23-worker DataLoader, and on two GPUs under DDP
with batches already on the device.  The suspect: with DataLoaders each rank starts a step when its own batch is
on the device, and a rank that starts early reaches each all-reduce before its peer, so its NCCL kernels wait on
the GPU beside its own backward (the effect docs/BENCHMARKS.md section 12 measured at +7-9% on the fast rank).

Each step's ``lead_ms`` (runtime.timing: the device's idle time from the previous step's end to the forward) says
when a rank started: with both ranks' steps ending together (the all-reduce), the rank with the shorter lead
started earlier by the difference.  Per epoch of each ``<prefix>_steps<rank>.jsonl`` pair, for ``--rank`` (default
0) against the other ranks' latest start:

  long        its steps with compute over its median + ``--long-ms`` (default 15)
  early_long  of those, the steps it started at least ``--early-ms`` (default 5) before the last of its peers
  early_all   all steps it started that early
  corr        correlation of its compute with how early it started (peers' max lead - its lead)
  host_long   of the long steps, those whose host span (``host_compute_ms``: compute_start to the last bucket's
              hook on the host clock) reached 95% of the device span: closed late by the host -- its autograd
              thread waiting for the CPU or the GIL to run the Python comm hook -- rather than by the kernels

    python benchmarks/phase_table.py docs/results/h100x2_train_auto_replan_s17a_skewS_r1 [PREFIX ..] [--json out.json]

The first suspect confirmed reads as long steps that are mostly early ones with a positive correlation; the
second (the host) as long steps that are mostly host_long.  Epochs whose logs have no ``lead_ms`` (before session
16) are skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_log_segments import read_step_logs


def _corr(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3 or statistics.pstdev(xs) == 0 or statistics.pstdev(ys) == 0:
        return None
    return statistics.correlation(xs, ys)


def epoch_rows(prefix: str, rank: int = 0, long_ms: float = 15.0, early_ms: float = 5.0) -> list[dict[str, Any]]:
    """One row per epoch that every rank logged with leads (module docstring)."""
    logs = read_step_logs(prefix)
    if rank not in logs or len(logs) < 2:
        return []
    rows = []
    for i, mine in enumerate(logs[rank]):
        peers = [logs[r][i] for r in logs if r != rank and i < len(logs[r])]
        if len(peers) != len(logs) - 1 or "lead_ms" not in mine or any("lead_ms" not in p for p in peers):
            continue
        comp, lead = mine["compute_ms"], mine["lead_ms"]
        steps = [k for k in range(len(comp))
                 if comp[k] is not None and lead[k] is not None
                 and all(k < len(p["lead_ms"]) and p["lead_ms"][k] is not None for p in peers)]
        if len(steps) < 3:
            continue
        early = {k: max(p["lead_ms"][k] for p in peers) - lead[k] for k in steps}
        median = statistics.median(comp[k] for k in steps)
        long = [k for k in steps if comp[k] > median + long_ms]
        corr = _corr([comp[k] for k in steps], [early[k] for k in steps])
        host = mine.get("host_compute_ms") or [None] * len(comp)
        host_long = sum(1 for k in long if k < len(host) and host[k] is not None and host[k] >= 0.95 * comp[k])
        rows.append({"epoch": mine["epoch"], "steps": len(steps), "compute_median_ms": round(median, 1),
                     "long": len(long), "early_long": sum(1 for k in long if early[k] >= early_ms),
                     "early_all": sum(1 for k in steps if early[k] >= early_ms),
                     "corr": None if corr is None else round(corr, 2), "host_long": host_long})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prefixes", nargs="+", help="launch prefixes: <prefix>_steps<rank>.jsonl")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--long-ms", type=float, default=15.0)
    ap.add_argument("--early-ms", type=float, default=5.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    out = {}
    print("| launch | epoch | steps | compute median, ms | long | of them early | early, all steps | corr | "
          "of them host-closed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for prefix in args.prefixes:
        rows = epoch_rows(prefix, args.rank, args.long_ms, args.early_ms)
        out[prefix] = rows
        for r in rows:
            print(f"| {Path(prefix).name} | {r['epoch']} | {r['steps']} | {r['compute_median_ms']} | {r['long']} | "
                  f"{r['early_long']} | {r['early_all']} | {r['corr']} | {r['host_long']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
