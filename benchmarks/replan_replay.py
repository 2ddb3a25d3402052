"""Replay a `planner train --replan` run log through this checkout's Replanner: what would it decide now?

    python benchmarks/replan_replay.py tests/data/h100x2_resnet50_compute_skew_495_17 [PREFIX ..]

Each PREFIX names a launch's ``<prefix>_profile.json`` and ``<prefix>_run.jsonl`` (what `benchmarks/gpu_suite.sh
train` writes).  The
Replanner starts from the log's start plan and takes each epoch's logged per-rank stats in turn, printing its
decision, for as long as the log ran the plan the replay holds: once the replay adopts a split the run did not (or
the run adopted one the replay did not), later epochs measured another split and the replay stops, saying so.  The
run's last epoch is not replayed (no decision follows it), nor, as `planner train` does with its streamed loader
(``runtime.epoch.unsteady_start``), an epoch that began a new stream with no steady window after its fill: the refill
after an adopted re-plan, or the run's first epoch when the fill took all of it (``--restarted``: the run
restarted its DataLoader every epoch, ``--restart-loader-each-epoch``, and judged every epoch).  A change to the
correction model is checked this way against every recorded launch before it is measured on a GPU (the launches in
tests/data, and any a GPU run brings back).

    python benchmarks/replan_replay.py --exact run.jsonl [run2.jsonl ..]

A log whose start record carries the re-planner's configuration (``StartRecord.replanner``) and whose decisions
carry their inputs (``ReplanRecord.inputs``: the state before each and every rank's stats) replays each decision
exactly: a Replanner built from the configuration loads the state, decides on the stats, and the replay reports
every decision whose adoption, reason or batch sizes differ from the log's (exit status 1 when any does).  That
is how a decision seen in a run is reproduced offline, and how a change is checked against what the run decided.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planner.cli.steps import loader_fill_drain
from planner.profile import Profile
from planner.runlog import read_run_log
from planner.stats import StepStats
from runtime.epoch import unsteady_start
from runtime.replan import Replanner

_STATS_KEYS = {f.name for f in fields(StepStats)}
_TIMES = ("data_wait_s", "compute_s", "step_time_s", "compute_s_std")


def logged_stats(d: Mapping[str, Any]) -> StepStats:
    """A rank's stats as a decision's inputs logged them: a time logged as null (not finite) is NaN again, which
    the Replanner refuses as it did in the run."""
    known: dict[str, Any] = {k: (math.nan if v is None and k in _TIMES else v) for k, v in d.items()
                             if k in _STATS_KEYS}
    return StepStats(**known)


def replay_exact(path: str) -> tuple[list[str], int]:
    """One line per logged decision made again from its inputs, and how many differ from the log (adopted,
    revert, reason, batch sizes)."""
    log = read_run_log(path)
    if log.replanner is None or log.start_plan is None:
        return ["the log has no re-planner configuration (start record) to replay from"], 0
    out, mismatches = [], 0
    for r in log.replans:
        if r.inputs is None:
            out.append(f"epoch {r.epoch}: no inputs logged: not replayed")
            continue
        rp = Replanner.from_description(log.replanner, log.start_plan)
        rp.load_state_dict(r.inputs["state"])
        d = rp.decide([logged_stats(x) for x in r.inputs["stats"]], r.epoch)
        got = (d.adopted, d.reverted, d.reason, tuple(d.plan.batch_sizes))
        want = (r.adopted, r.reverted, r.reason, tuple(r.new_batch_sizes))
        if got == want:
            out.append(f"epoch {r.epoch}: same: {d.line()}")
            continue
        mismatches += 1
        names = ("adopted", "reverted", "reason", "batch sizes")
        diff = "; ".join(f"{n}: logged {w!r}, now {g!r}" for n, g, w in zip(names, got, want, strict=True) if g != w)
        out.append(f"epoch {r.epoch}: MISMATCH {diff}")
    return out, mismatches


def replay(prefix: str, *, streamed: bool = True) -> list[str]:
    """One line per replayed epoch (the last says why the replay stopped, when it did)."""
    log = read_run_log(f"{prefix}_run.jsonl")
    if log.start_plan is None:
        return ["no start plan in the log: nothing to replay"]
    rp = Replanner(Profile.load(f"{prefix}_profile.json"), log.start_plan)
    out, fresh = [], True
    for e in log.epochs[:-1]:
        if tuple(e.batch_sizes) != tuple(rp.plan.batch_sizes):
            out.append(f"epoch {e.epoch}: the run measured {list(e.batch_sizes)}, the replay holds "
                       f"{list(rp.plan.batch_sizes)}: stopped")
            break
        # the trainer's rule (runtime.epoch.unsteady_start); a run with loader workers had a fill to take
        workers = max(r.num_workers for r in e.ranks)
        why = unsteady_start(streamed=streamed, fresh=fresh, first=e is log.epochs[0],
                             fill=loader_fill_drain(workers)[0] if workers else 0,
                             fill_steps=[r.fill_steps for r in e.ranks])
        if why is not None:
            out.append(f"epoch {e.epoch}: not judged ({why})")
            fresh = False
            continue
        d = rp.decide(list(e.ranks), epoch=e.epoch)
        out.append(f"epoch {e.epoch}: {'ADOPTED ' if d.adopted else ''}{d.reason}")
        fresh = d.adopted  # an adopted plan starts a new stream
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prefixes", nargs="+", help="a launch's raw-file prefix, e.g. tests/data/h100x2_..._skew_r1 "
                                               "(with --exact: run log files)")
    p.add_argument("--restarted", action="store_true",
                   help="the runs restarted their DataLoader each epoch (--restart-loader-each-epoch)")
    p.add_argument("--exact", action="store_true",
                   help="replay each logged decision from its logged inputs and report any that differ")
    args = p.parse_args(argv)
    bad = 0
    for prefix in args.prefixes:
        print(prefix)
        if args.exact:
            lines, n = replay_exact(prefix)
            bad += n
        else:
            lines = replay(prefix, streamed=not args.restarted)
        for line in lines:
            print("  " + line)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
