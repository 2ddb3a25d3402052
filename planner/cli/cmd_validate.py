"""`planner validate FILE...`: check profile, plan and run-log files against their contracts."""

from __future__ import annotations

import argparse
import os
import stat
import sys

from planner.errors import ValidationError
from planner.jsonio import MAX_FILE_BYTES, loads_strict, read_json
from planner.plan import Plan
from planner.profile import Profile
from planner.quality import check_profile
from planner.runlog import INTERRUPTED, RunLog, read_run_log
from planner.shown import shown

HELP = "check profile, plan and run-log files against their contracts"
EPILOG = """\
examples:
  planner validate profile.json
  planner validate profile.json plan.json run.jsonl

A file whose first line is a JSON object with an "event" key (what `planner train --log-file` writes) is checked
as a run log: every line typed (planner/schemas/runlog.schema.json), every embedded plan valid.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILE", help="profile or plan JSON files (their 'kind' decides) or run logs (JSON lines)")
    p.add_argument("--quiet", action="store_true", help="print nothing on success")


def _is_run_log(path: str) -> bool:
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False  # a FIFO would be waited on here; read_json below refuses it in one line
        with open(path, encoding="utf-8") as f:
            first = f.readline(MAX_FILE_BYTES)  # one line, bounded: a file without newlines is not read whole
    except (OSError, UnicodeDecodeError):
        return False  # read_json below says what is wrong with the file
    try:
        obj = loads_strict(first, "record")
    except (ValueError, RecursionError):  # ValidationError and JSONDecodeError are ValueErrors
        return False
    return isinstance(obj, dict) and "event" in obj and "kind" not in obj


def run_state(log: RunLog) -> str:
    """How the logged run ended, as validate says it: finished only when its end record gives no reason; an end
    record with one is a run that stopped early (`planner train` writes "interrupted" for Ctrl-C and SIGTERM)."""
    if not log.ended:
        return "no end record (still running or killed)"
    if log.end_reason is None:
        return "finished"
    if log.end_reason == INTERRUPTED:
        return "interrupted (Ctrl-C or SIGTERM), not finished; `planner train --resume` continues it from its checkpoint"
    return f"stopped early: {shown(log.end_reason, 80)}"


def validate_file(path: str) -> str:
    """Load and check one file; returns a one-line description or raises ValidationError."""
    if _is_run_log(path):
        log = read_run_log(path, strict_plans=True)
        tail = f"; {log.num_skipped_lines} truncated trailing line skipped" if log.num_skipped_lines else ""
        return (f"{path}: valid run log, {len(log.epochs)} epoch(s), {len(log.replans)} re-plan decision(s), "
                f"{run_state(log)}{tail}")
    data = read_json(path, "input")
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == "profile":
        prof = Profile.from_dict(data, path=path)
        # Valid is not trustworthy: the quality gate's warnings go to stderr, one line each, with the numbers.
        quality = check_profile(prof)
        for issue in quality.issues:
            print(f"warning: {path}: {issue.message}", file=sys.stderr)
        noisy = f"; {len(quality.issues)} quality warning(s), see stderr" if quality.issues else ""
        return f"{path}: valid profile, {prof.world_size} rank(s) on {len(prof.hosts)} host(s){noisy}"
    if kind == "plan":
        plan = Plan.from_dict(data, path=path)
        # A split forced over a cap (plan --from-batches --force) is a valid file and an OOM waiting: say so.
        over = [f"rank {r.rank} ({r.batch_size} > {r.max_batch_size})" for r in plan.ranks
                if r.max_batch_size is not None and r.micro_batch_size > r.max_batch_size]
        steps = f", up to {max(plan.accumulation_steps)} micro-steps per rank" if plan.accumulates else ""
        mode = f", mode {plan.mode}" if plan.mode != "ddp" else ""
        return (f"{path}: valid plan, {plan.world_size} rank(s), global batch {plan.global_batch}{mode}{steps}, "
                f"fingerprint {plan.fingerprint}"
                + (f"; over its cap, expect out-of-memory: {', '.join(over)}" if over else ""))
    raise ValidationError(f"{path}: 'kind' must be \"profile\" or \"plan\" (or a run log of JSON lines), got {kind!r}")


def run(args: argparse.Namespace) -> int:
    for path in args.files:
        msg = validate_file(path)
        if not args.quiet:
            print(msg)
    return 0
