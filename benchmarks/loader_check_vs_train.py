"""The loader check before training against what training paid: does the check's load (every worker flat out)
overstate the contention of training, where a compute-bound rank's workers idle part of each step?

    python benchmarks/loader_check_vs_train.py docs/results/*_train_auto_replan_s1[789]*_profile.json

For each launch whose profile holds a loader check (``meta.loader_check``, planner.cli.loader_check) and each clean epoch
at the checked split (not the first, not a refill after a re-plan, not the last), each rank's cost per sample per
worker in training (the run log's ``loader_s`` over the batch) is set against the check's, beside the loader model's
own ratio of the two loads (``planner.loader``: the plan's training load over every worker busy).  Session 19: over
the 104 rank-epochs of sessions 17-19, training over the check is a median 0.994 while the model's ratio would say
0.955, and applying it would have made the median miss 9.3% instead of 6.4%, so the check's load is kept as it is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planner.loader import contended_costs_s, loader_costs_s
from planner.options import SolveOptions
from planner.profile import Profile
from planner.runlog import read_run_log


def rows(profile_path: str) -> list[tuple[str, int, int, float, float, float]]:
    """(launch, epoch, rank, check s/sample/worker, training's, model's training / check ratio) of one launch."""
    base = profile_path[: -len("_profile.json")]
    prof = Profile.load(profile_path)
    rec = prof.meta.get("loader_check")
    if not rec or not Path(base + "_run.jsonl").exists():
        return []
    opts = SolveOptions(**json.loads(Path(base + "_plan.json").read_text())["solver"]["options"])
    workers, batches = rec["workers"], rec["batch_sizes"]
    train = loader_costs_s(prof, opts, workers=workers)
    busy = contended_costs_s(prof, workers, [0.0] * len(workers), opts.cpu_reserve_per_rank)  # no GPU idles them
    log = read_run_log(base + "_run.jsonl")
    starts, last = log.plan_starts(), log.epochs[-1].epoch if log.epochs else -1
    out = []
    for e in log.epochs:
        if e.epoch in starts or e.epoch == last or list(e.batch_sizes) != batches:
            continue
        for r in e.ranks:
            m = rec["measured_s_per_sample"][r.rank]
            if m is None or not r.loader_s or not busy[r.rank]:
                continue
            out.append((Path(base).name, e.epoch, r.rank, m, r.loader_s / r.batch_size, train[r.rank] / busy[r.rank]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profiles", nargs="+", help="launch profiles (<prefix>_profile.json) with a loader check")
    args = p.parse_args(argv)
    found = [row for f in args.profiles for row in rows(f)]
    if not found:
        print("no rank-epoch at a checked split in these launches")
        return 1
    print("| launch | epoch | rank | check ms | training ms | training / check | model's ratio |\n|---|---|---|---|---|---|---|")
    for name, epoch, rank, m, t, model in found:
        print(f"| {name} | {epoch} | {rank} | {1e3 * m:.2f} | {1e3 * t:.2f} | {t / m:.3f} | {model:.3f} |")
    meas = [t / m for _, _, _, m, t, _ in found]
    model = [x for *_, x in found]
    print(f"\n{len(found)} rank-epochs: training / check median {statistics.median(meas):.3f}, the model's ratio "
          f"median {statistics.median(model):.3f}; median |miss| {statistics.median(abs(x - 1) for x in meas):.1%} "
          f"as checked, {statistics.median(abs(x / y - 1) for x, y in zip(meas, model, strict=True)):.1%} with the model's ratio")
    return 0


if __name__ == "__main__":
    sys.exit(main())
