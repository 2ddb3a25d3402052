"""Re-solve every recorded plan's profile with this checkout: which plans would change, and by how much.

For each ``docs/results/*_plan.json`` with its ``*_profile.json``, the global batch of the plan as recorded is solved
twice -- with the solver as it is, and with one of its steps switched off (``--without``) -- and every plan that
differs is printed with both predicted steps.  Session 16 (docs/BENCHMARKS.md section 24) checked the solver's worker
move (planner._search.improve_workers) this way: 6 of 89 recorded plans change, each 2.6-3.1% faster, none slower.

    python benchmarks/resolve_recorded.py [--without move] [--results docs/results] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import planner
from planner.profile import Profile

STEPS = {"move": ("planner._search", "MOVE_MIN_GAIN", 1.0)}
"""--without NAME: (module, constant, value that switches the step off)."""


def _solve(profile: Profile, B: int) -> planner.Plan:
    return planner.solve(profile, global_batch=B)


def compare(results: Path, without: str) -> list[dict[str, Any]]:
    """One row per recorded plan whose profile loads: both solves' splits, workers and predicted steps."""
    module, name, off = STEPS[without]
    mod = importlib.import_module(module)
    rows = []
    for plan_path in sorted(results.glob("*_plan.json")):
        profile_path = plan_path.with_name(plan_path.name.replace("_plan.json", "_profile.json"))
        if not profile_path.exists():
            continue
        try:
            profile = Profile.load(profile_path)
            B = sum(int(r["batch_size"]) for r in json.loads(plan_path.read_text())["ranks"])
        except Exception:  # a file of an older format: not a plan this solver reads
            continue
        on = getattr(mod, name)
        try:
            setattr(mod, name, off)
            before = _solve(profile, B)
        finally:
            setattr(mod, name, on)
        after = _solve(profile, B)
        rows.append({"plan": plan_path.name, "before": list(before.batch_sizes),
                     "before_workers": [r.num_workers for r in before.ranks],
                     "before_step_ms": round(1e3 * before.predicted.step_time_s, 2),
                     "after": list(after.batch_sizes), "after_workers": [r.num_workers for r in after.ranks],
                     "after_step_ms": round(1e3 * after.predicted.step_time_s, 2)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--without", choices=sorted(STEPS), default="move")
    ap.add_argument("--results", default=str(Path(__file__).resolve().parent.parent / "docs" / "results"))
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = compare(Path(args.results), args.without)
    changed = [r for r in rows if (r["before"], r["before_workers"]) != (r["after"], r["after_workers"])]
    for r in changed:
        print(f"{r['plan']}: {r['before']} on {r['before_workers']} {r['before_step_ms']} ms -> {r['after']} on "
              f"{r['after_workers']} {r['after_step_ms']} ms ({r['after_step_ms'] / r['before_step_ms'] - 1:+.1%})")
    slower = sum(1 for r in changed if r["after_step_ms"] > r["before_step_ms"])
    print(f"{len(rows)} recorded plans re-solved; {len(changed)} change with the {args.without} step, {slower} slower")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
