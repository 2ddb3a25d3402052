"""Compare two profiles of the same job: wall time per part and the fitted step-time curves (issue 16 item 6).

    python3 benchmarks/compare_profiles.py --fast fast.json --thorough thorough.json \
        [--fast-wall-s 41.2 --thorough-wall-s 103.0] [--json out.json]

For every rank: the fitted curve of each profile (planner.curves.fit_envelope, what the solver uses) at every batch
the thorough profile measured, and the relative difference fast / thorough - 1, split into the batches the fast
profile also covered and those it extrapolates.  Beside it the thorough profile's own noise (largest spread of a
point's repeats, largest residual of its fit): a difference below that noise is the same curve.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.curves import fit_envelope
from planner.profile import Profile


def compare(fast: Profile, thorough: Profile) -> dict[str, Any]:
    ranks = []
    for rf, rt in zip(fast.by_rank, thorough.by_rank, strict=True):
        ff, ft = fit_envelope(rf.compute), fit_envelope(rt.compute)
        fast_max = max(p.batch_size for p in rf.compute)
        inside, beyond = [], []
        for p in rt.compute:
            d = ff(p.batch_size) / ft(p.batch_size) - 1
            (inside if p.batch_size <= fast_max else beyond).append((p.batch_size, round(d, 4)))
        noise = max(float(rt.meta.get("sweep_spread_max") or 0.0), float(rt.meta.get("fit_max_rel_residual") or 0.0))
        worst_in = max((abs(d) for _, d in inside), default=0.0)
        worst_all = max((abs(d) for _, d in inside + beyond), default=0.0)
        ranks.append({
            "rank": rf.rank,
            "fast_batches": [p.batch_size for p in rf.compute], "thorough_batches": [p.batch_size for p in rt.compute],
            "fast_stop": rf.meta.get("sweep_stop"), "thorough_stop": rt.meta.get("sweep_stop"),
            "rel_diff_inside": inside, "rel_diff_extrapolated": beyond,
            "max_abs_rel_diff_inside": round(worst_in, 4), "max_abs_rel_diff_all": round(worst_all, 4),
            "thorough_noise": round(noise, 4),
            "fast_parts_s": rf.meta.get("profile_parts_s"), "thorough_parts_s": rt.meta.get("profile_parts_s"),
            "fast_loader_sec_per_sample": rf.loader.sec_per_sample if rf.loader else None,
            "thorough_loader_sec_per_sample": rt.loader.sec_per_sample if rt.loader else None,
        })

    def comm(p: Profile) -> dict[str, Any]:
        c = p.comm
        return {} if c is None else {"exposed_s": c.exposed_s, "wait_factors": c.wait_factors,
                                     "launch_env": dict(c.launch_env) if c.launch_env else None,
                                     "comm_profile_s": p.meta.get("comm_profile_s")}

    return {"ranks": ranks, "fast_comm": comm(fast), "thorough_comm": comm(thorough),
            "max_abs_rel_diff_inside": max(r["max_abs_rel_diff_inside"] for r in ranks),
            "max_thorough_noise": max(r["thorough_noise"] for r in ranks)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fast", required=True, help="profile JSON of the default (fast) profile")
    p.add_argument("--thorough", required=True, help="profile JSON of `planner profile --thorough`")
    p.add_argument("--fast-wall-s", type=float, default=None, help="wall seconds of the fast command")
    p.add_argument("--thorough-wall-s", type=float, default=None, help="wall seconds of the thorough command")
    p.add_argument("--goal-s", type=float, default=45.0, help="wall-time goal of the fast profile (default 45)")
    p.add_argument("--json", default=None, help="write the comparison here")
    args = p.parse_args(argv)
    out = compare(Profile.load(args.fast), Profile.load(args.thorough))
    out.update(fast_wall_s=args.fast_wall_s, thorough_wall_s=args.thorough_wall_s, goal_s=args.goal_s,
               goal_met=None if args.fast_wall_s is None else args.fast_wall_s <= args.goal_s)
    for r in out["ranks"]:
        print(f"rank {r['rank']}: fast {r['fast_batches'][0]}-{r['fast_batches'][-1]} ({r['fast_stop']}), thorough "
              f"{r['thorough_batches'][0]}-{r['thorough_batches'][-1]} ({r['thorough_stop']}); fitted curves differ "
              f"by <= {100 * r['max_abs_rel_diff_inside']:.1f}% where both measured, "
              f"<= {100 * r['max_abs_rel_diff_all']:.1f}% over the thorough range (its noise "
              f"{100 * r['thorough_noise']:.1f}%)")
        print(f"  parts fast {r['fast_parts_s']}\n  parts thorough {r['thorough_parts_s']}")
    if args.fast_wall_s is not None:
        print(f"wall: fast {args.fast_wall_s:.1f} s, thorough {args.thorough_wall_s or 0:.1f} s; goal <= "
              f"{args.goal_s:g} s: {'met' if out['goal_met'] else 'NOT met'}")
    print(f"comm fast {out['fast_comm']}\ncomm thorough {out['thorough_comm']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
