"""`planner report`: a self-contained HTML capacity report, a terminal summary and (--json) all its numbers.

No module-level matplotlib or torch import: `planner --help` and `planner plan` stay fast; figures are drawn
only when this command runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from planner.argcheck import count
from planner.cli.cmd_plan import add_solve_arguments

HELP = "write a capacity report (HTML + terminal summary)"
DESCRIPTION = (
    "Write one self-contained HTML report (figures embedded, no network) about a plan on a profile: per-rank "
    "curves, equal split vs plan vs ideal, throughput and epoch time vs global batch, memory headroom, what-if "
    "(drop / add / upgrade a rank), scaling over 1..W ranks and, with --log, predicted vs measured step times."
)
EPILOG = """\
examples:
  planner report --profile minimal_profile.json --global-batch 512 --out report.html   # python -m planner.examples
  planner report --profile profile.json --plan plan.json --log run.jsonl --out report.html --json report.json

Without --plan the report solves one at --global-batch (or uses the plan a --log run started with).
What-ifs and sweeps re-run the same solver with the same options, so their numbers match `planner plan`.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, metavar="PATH", help="profile JSON from `planner profile`")
    p.add_argument("--plan", default=None, metavar="PATH", help="plan JSON from `planner plan` (else one is solved)")
    p.add_argument("--log", default=None, metavar="PATH", help="run log from `planner train --log` (JSON lines)")
    p.add_argument("--global-batch", "--global_batch", type=count(), default=None, metavar="B",
                   help="samples per optimizer step over all ranks; required without --plan or --log")
    p.add_argument("--dataset-size", type=count(), default=None, metavar="N",
                   help="samples per epoch, for epoch times (default: the --log run's, else 50000)")
    p.add_argument("--out", default="report.html", metavar="PATH",
                   help="HTML report path, written atomically (default report.html)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every number of the report as JSON")
    p.add_argument("--title", default="ddp-planner capacity report", help="page title")
    add_solve_arguments(p, from_plan=True)
    p.add_argument("--quiet", action="store_true", help="do not print the terminal summary")


def run(args: argparse.Namespace) -> int:
    from planner.cli.cmd_plan import solve_options_from_args
    from planner.errors import ValidationError
    from planner.jsonio import write_json_atomic, write_text_atomic
    from planner.paths import Output, check_outputs
    from planner.plan import Plan
    from planner.profile import Profile
    from planner.quality import check_profile, keep_equal_within_noise
    from planner.runlog import read_run_log
    from planner.solve import solve
    from reports.analysis import DEFAULT_DATASET_SIZE, analyze
    from reports.figures import render_all
    from reports.html import render_html
    from reports.measured import epoch_size
    from reports.summary import format_summary

    # Outputs first (planner/paths.py): never the profile, plan or log given, never a device or a folder.
    check_outputs([Output(flag="--out", path=args.out), Output(flag="--json", path=args.json)],
                  {"--profile": args.profile, "--plan": args.plan, "--log": args.log})
    profile = Profile.load(args.profile)
    # strict_plans: a plan in the log that does not load is refused, as `planner validate` refuses it -- never
    # dropped silently for a plan the run did not use.
    log = read_run_log(args.log, strict_plans=True) if args.log else None
    # Printed after the report is written: a warning followed by an error would be two lines on stderr.
    quality = check_profile(profile)
    warnings: list[str] = list(quality.warning_lines())
    if args.plan:
        plan = Plan.load(args.plan)
    elif log is not None and log.start_plan is not None and args.global_batch is None:
        plan = log.start_plan
    elif args.global_batch is not None:
        plan = solve(profile, global_batch=args.global_batch, options=solve_options_from_args(args, profile=profile))
        if plan.options.min_gain > 0:  # as `planner plan`: no lopsided split from a profile too noisy to tell
            plan = keep_equal_within_noise(profile, plan, quality)
    else:
        raise ValidationError("planner report needs --plan PATH or --global-batch B (or a --log whose start event "
                              "holds the plan)")
    if args.global_batch is not None and args.global_batch != plan.global_batch:
        raise ValidationError(f"--global-batch {args.global_batch} differs from the plan's global batch "
                              f"{plan.global_batch}; drop --global-batch or re-run `planner plan`")
    made_from = plan.solver.get("profile_fingerprint")
    if made_from and made_from != profile.fingerprint():
        warnings.append(f"warning: the plan was solved from another profile ({made_from}, this one is "
                        f"{profile.fingerprint()}); predictions below use this profile")
    if log is not None:
        warnings += check_log(log, profile, plan if args.plan else None, args.log)
    # The report's re-solves (what-ifs, scaling, sweep) use the plan's own options unless a flag says otherwise.
    opts = solve_options_from_args(args, plan.options)
    # Epoch size: what the user says, else what the logged run had, else a labelled default.
    from_log = epoch_size(log) if log is not None else None
    if args.dataset_size is not None:
        size, source = args.dataset_size, "--dataset-size"
    elif from_log is not None:
        size, source = from_log
    else:
        size, source = DEFAULT_DATASET_SIZE, "default"
    rep = analyze(profile, plan, opts, dataset_size=size, log=log, quality=quality, dataset_size_source=source)
    page = render_html(rep, render_all(rep), title=args.title)
    write_text_atomic(args.out, page)
    if args.json:
        write_json_atomic(args.json, rep.to_dict())
    if not args.quiet:
        print(format_summary(rep))
        print(f"\nwrote {args.out}" + (f" and {args.json}" if args.json else ""))
    for w in warnings:
        print(w, file=sys.stderr)
    return 0


def check_log(log: Any, profile: Any, plan: Any, path: str) -> list[str]:
    """Refuse a run log from a job of another size than the profile; warnings for softer mismatches.

    Unchecked, a 3-rank log read against a 2-rank profile would be reported as if it fitted: predicted and
    measured columns of different clusters side by side.
    """
    from planner.errors import ValidationError

    sizes = [n for n in [log.world_size, *(r.new_world_size for r in log.resizes)] if n is not None]
    sizes += [len(e.batch_sizes) for e in log.epochs[-1:] if e.batch_sizes and not log.resizes]
    last = sizes[-1] if sizes else None
    if last is not None and last != profile.world_size:
        raise ValidationError(f"--log {path} is from a run of {last} rank(s) but the profile has "
                              f"{profile.world_size}; pass the profile (and plan) that run used")
    out = []
    if log.runs > 1:
        out.append(f"warning: --log {path} holds {log.runs} runs (a fresh run appended to an old log); the report "
                   "reads the last one")
    if plan is not None and log.start_plan is not None and log.start_plan.fingerprint != plan.fingerprint \
            and not log.resizes:
        out.append(f"warning: the run in --log started with plan {log.start_plan.fingerprint}, not --plan's "
                   f"{plan.fingerprint}; the measured-vs-predicted table uses the log's own predictions")
    return out


def main(argv: list[str] | None = None) -> int:
    """Run `planner report` directly (python -m planner.cli.cmd_report ...)."""
    from planner.cli import main as planner_main

    return planner_main(["report", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
