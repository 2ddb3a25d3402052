"""Markdown rows from `planner bench --json` files (docs/BENCHMARKS.md is written from these).

    python benchmarks/summarize_bench.py docs/results/h200x2_resnet50_F1_F3.json ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

STRATEGIES = ("equal", "proportional", "plan", "plan+replan")


def rows(result: dict[str, Any]) -> list[str]:
    m = result["meta"]
    ideal = result["ideal"]["samples_per_s"]
    out = []
    for name in STRATEGIES:
        s = result.get(name)
        if not s:
            continue
        err = s.get("predicted_error")
        out.append(
            f"| {m['heterogeneity']} | {name} | {' / '.join(map(str, s['batch_sizes']))} | {s['samples_per_s']:.0f} | "
            f"{1000 * s['step_time_s']:.1f} | {1000 * s['predicted_step_time_s']:.1f} | "
            f"{'' if err is None else f'{100 * err:+.1f}%'} | {s.get('vs_equal', float('nan')):.2f}x | "
            f"{s['samples_per_s'] / ideal:.3f} |"
        )
    out.append(f"| {m['heterogeneity']} | ideal (measured standalone) | {' / '.join(map(str, result['ideal']['batch_sizes']))} "
               f"| {ideal:.0f} | | | | | 1.000 |")
    return out


def main(paths: list[str]) -> int:
    print("| heterogeneity | strategy | batches | samples/s | step ms | predicted ms | error | vs equal | vs ideal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p in paths:
        d = json.loads(Path(p).read_text())
        for r in d.get("runs", [d]):
            print("\n".join(rows(r)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
