"""`planner validate FILE...`: check profile and plan files against their contracts (kind decides which)."""

from __future__ import annotations

import argparse

from planner.errors import ValidationError
from planner.jsonio import read_json
from planner.plan import Plan
from planner.profile import Profile

HELP = "check a profile or plan file against its contract"
EPILOG = """\
examples:
  planner validate profile.json
  planner validate profile.json plan.json
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILE", help="profile or plan JSON files (their 'kind' decides)")
    p.add_argument("--quiet", action="store_true", help="print nothing on success")


def validate_file(path: str) -> str:
    """Load and check one file; returns a one-line description or raises ValidationError."""
    data = read_json(path, "input")
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == "profile":
        prof = Profile.from_dict(data, path=path)
        return f"{path}: valid profile, {prof.world_size} rank(s) on {len(prof.hosts)} host(s)"
    if kind == "plan":
        plan = Plan.from_dict(data, path=path)
        return (f"{path}: valid plan, {plan.world_size} rank(s), global batch {plan.global_batch}, "
                f"fingerprint {plan.fingerprint}")
    raise ValidationError(f"{path}: 'kind' must be \"profile\" or \"plan\", got {kind!r}")


def run(args: argparse.Namespace) -> int:
    for path in args.files:
        msg = validate_file(path)
        if not args.quiet:
            print(msg)
    return 0
