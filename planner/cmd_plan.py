"""`planner plan`: solve per-rank batch sizes, shares and loader workers for a global batch."""

from __future__ import annotations

import argparse
import json
import sys

from planner.errors import ValidationError
from planner.jsonio import write_json_atomic
from planner.plan import Plan
from planner.profile import Profile
from planner.solve import DEFAULT_MIN_GAIN, evaluate, kept_equal_split, solve
from planner.table import table

HELP = "solve per-rank batch sizes, shares and workers for a global batch"
EPILOG = """\
examples:
  planner plan --profile profile.json --global-batch 512 --out plan.json
  planner plan --profile profile.json --global-batch 512 --min-batch 2      # BatchNorm models
  planner plan --profile profile.json --global-batch 512 --from-batches 256,256   # evaluate a given split

The global batch is your convergence choice: the planner never changes it.  It prints a table for people and
writes the plan JSON (`--json` prints it to stdout instead) that `planner train --plan` and
`HeteroBatchSampler.from_plan` read.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, metavar="PATH", help="profile JSON from `planner profile`")
    p.add_argument("--global-batch", "--global_batch", type=int, required=True, metavar="B",
                   help="samples per optimizer step summed over all ranks (kept exactly)")
    add_solve_arguments(p)
    p.add_argument("--from-batches", default=None, metavar="B0,B1,..",
                   help="skip the solver: evaluate this split (comma-separated, one per rank)")
    p.add_argument("--out", default=None, metavar="PATH", help="write the plan JSON here (atomically)")
    p.add_argument("--json", action="store_true", help="print the plan JSON to stdout instead of the table")


def add_solve_arguments(p: argparse.ArgumentParser, *, min_batch_default: int | None = 1,
                        min_batch_help: str = "smallest local batch per rank (default 1; use >= 2 for BatchNorm)") -> None:
    """The solver's options, shared by `planner plan` and `planner report` (same names, units and defaults)."""
    p.add_argument("--min-batch", "--min_batch", type=int, default=min_batch_default, metavar="M", help=min_batch_help)
    p.add_argument("--max-batch-per-rank", "--max_batch_per_rank", type=int, default=None, metavar="N",
                   help="cap every rank's local batch at N samples, on top of its memory cap")
    p.add_argument("--memory-headroom", type=float, default=0.10, metavar="FRAC",
                   help="fraction of device memory kept free when capping the batch (default 0.10)")
    p.add_argument("--cpu-reserve-per-rank", type=int, default=1, metavar="CORES",
                   help="cores per rank kept for the training process, not for loader workers (default 1)")
    p.add_argument("--max-workers-per-rank", type=int, default=8, metavar="W",
                   help="most loader workers given to one rank (default 8)")
    p.add_argument("--min-gain", type=float, default=DEFAULT_MIN_GAIN, metavar="FRAC",
                   help="keep the equal split unless the plan is predicted this much faster "
                        f"(default {DEFAULT_MIN_GAIN}; 0 = always the optimum)")


def _parse_batches(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValidationError(f"--from-batches: expected comma-separated integers, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    profile = Profile.load(args.profile)
    common = dict(
        min_batch=args.min_batch,
        max_batch_per_rank=args.max_batch_per_rank,
        memory_headroom=args.memory_headroom,
        cpu_reserve_per_rank=args.cpu_reserve_per_rank,
        max_workers_per_rank=args.max_workers_per_rank,
    )
    solve_only = dict(min_gain=args.min_gain)
    if args.from_batches:
        batches = _parse_batches(args.from_batches)
        if sum(batches) != args.global_batch:
            raise ValidationError(
                f"--from-batches sums to {sum(batches)} but --global-batch is {args.global_batch}"
            )
        plan = evaluate(profile, batches, **common)  # type: ignore[arg-type]
    else:
        plan = solve(profile, global_batch=args.global_batch, **common, **solve_only)  # type: ignore[arg-type]
    if args.out:
        plan.save(args.out)
    if args.json:
        json.dump(plan.to_dict(), sys.stdout, indent=1)
        print()
    else:
        print(format_plan(plan, profile))
        if args.out:
            print(f"\nwrote {args.out}")
    return 0


def format_plan(plan: Plan, profile: Profile | None = None) -> str:
    """The plan as an aligned table plus the predicted throughput against equal split and ideal."""
    names = {r.rank: (r.device_name or r.device) for r in profile.by_rank} if profile else {}
    rows = [
        (r.rank, names.get(r.rank, r.device), r.batch_size, f"{100 * r.share:.1f}%", r.num_workers,
         f"{1000 * r.predicted_step_time_s:.2f}", r.bottleneck)
        for r in plan.ranks
    ]
    out = [table(["rank", "device", "batch", "share", "workers", "step ms", "bottleneck"], rows)]
    p = plan.predicted
    eq = p.equal_split_samples_per_s
    lines = [
        f"global batch {plan.global_batch} on {plan.world_size} rank(s); predicted step "
        f"{1000 * p.step_time_s:.2f} ms (comm {1000 * p.comm_s:.2f} ms)",
        f"  plan         {p.samples_per_s:12.1f} samples/s"
        + (f"   {p.samples_per_s / eq:.2f}x equal split" if eq > 0 else ""),
        "  equal split  " + (f"{eq:12.1f} samples/s" if eq > 0 else "  does not fit (a rank's memory cap is below B/W)"),
        f"  ideal        {p.ideal_samples_per_s:12.1f} samples/s   plan = {p.samples_per_s / p.ideal_samples_per_s:.3f} of ideal",
    ]
    kept = kept_equal_split(plan)
    if kept is not None:
        optimum, gain, min_gain = kept
        lines.append(f"  kept the equal split: the optimum {optimum} is predicted only {gain:.1%} faster "
                     f"(< min gain {min_gain:.0%}); --min-gain 0 plans it anyway")
    out.append("\n".join(lines))
    return "\n\n".join(out)


def write_plan(plan: Plan, path: str) -> None:
    write_json_atomic(path, plan.to_dict())
