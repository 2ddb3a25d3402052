"""`planner`: profile ranks, plan per-rank batch sizes, train with the plan, report capacity.

Each subcommand lives in its own module exposing ``HELP`` (one line), ``EPILOG`` (a real example),
``add_arguments(parser)`` and ``run(args) -> int``.  Only the chosen subcommand's module is imported, so
``planner plan`` never imports torch.

Exit codes: 0 ok, 2 bad input (one line on stderr, no traceback), 1 internal error.

The programs live in this subpackage, the one part of ``planner`` allowed to import the other packages (torch
included); each command module is imported only when its command runs:

    planner.cli.cmd_plan     `planner plan`      (planner core only: no torch)
    planner.cli.cmd_validate `planner validate`  (planner core only)
    planner.cli.train        the reference trainer (train; TrainConfig in train_config, the step in steps)
    planner.cli.autoplan     profile -> quality gate -> solve -> loader check, for `train --auto` and `bench`
    planner.cli.cmd_train    `planner train` (arguments -> TrainConfig, torchrun set-up)
    planner.cli.bench        `planner bench`: equal vs proportional vs plan vs re-plan vs ideal in one launch
    planner.cli.demo         `planner demo`: profile -> plan -> train -> report as subprocesses with deadlines
    planner.cli.cmd_profile  `planner profile`
    planner.cli.cmd_report   `planner report`
    planner.cli.checkpoint   atomic, data-only checkpoints of a training run
    planner.cli.distenv      process-group set-up from torchrun's environment (or a FileStore), device per rank
    planner.cli.launch       spawn N local ranks with a deadline, children killed on exit (the bench's launcher)

Layers (tests/test_layers.py): planner core -> runtime -> profiler; reports on the core; planner.cli on top.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from planner.errors import PlanError, ValidationError
from planner.lifetime import Terminated, terminate_as_interrupt
from planner.paths import release_all
from planner.stdio import GuardedStdout, TerminalSafe

# name -> (module, one-line help).  A command's module is imported only when the command runs.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "profile": ("planner.cli.cmd_profile", "measure step time, memory, loader cost and all-reduce on each rank"),
    "plan": ("planner.cli.cmd_plan", "solve per-rank batch sizes, shares and workers for a global batch"),
    "validate": ("planner.cli.cmd_validate", "check a profile or plan file against its contract"),
    "report": ("planner.cli.cmd_report", "write a capacity report (HTML + terminal summary)"),
    "train": ("planner.cli.cmd_train", "train with a plan under torchrun (reference trainer)"),
    "bench": ("planner.cli.bench", "compare equal split, proportional, plan and re-plan side by side"),
    "demo": ("planner.cli.demo", "profile -> plan -> train -> report on this machine"),
}

RUNTIME_COMMANDS = frozenset({"profile", "train", "bench"})
"""The commands that import the ``runtime`` package (planner.shadow checks it is ddp-planner's first)."""

EPILOG = """\
examples:
  planner profile --model resnet18 --dataset fake --out profile.json
  planner plan --profile profile.json --global-batch 512 --out plan.json
  torchrun --nproc-per-node 2 -m planner train --plan plan.json --epochs 2
  planner report --profile profile.json --plan plan.json --out report.html
"""


class UserError(Exception):
    """Raised by argparse on a usage mistake; carries the one-line message."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{self.prog}: {message}")


def _top_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="planner",
        description="Make PyTorch DDP fast on heterogeneous clusters: measure each rank, solve per-rank batch "
        "sizes, apply them with exact gradient weighting, and report capacity.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from planner import __version__

    p.add_argument("--version", action="version", version=f"ddp-planner {__version__}")
    p.add_argument("command", nargs="?", choices=sorted(SUBCOMMANDS), metavar="COMMAND",
                   help="one of: " + ", ".join(SUBCOMMANDS))
    lines = "\n".join(f"  {name:<10}{hlp}" for name, (_, hlp) in SUBCOMMANDS.items())
    p.epilog = f"commands:\n{lines}\n\n{EPILOG}"
    return p


def build_parser(command: str) -> tuple[argparse.ArgumentParser, object]:
    module_name, hlp = SUBCOMMANDS[command]
    module = importlib.import_module(module_name)
    parser = _Parser(
        prog=f"planner {command}",
        description=getattr(module, "DESCRIPTION", hlp),
        epilog=getattr(module, "EPILOG", None),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_arguments(parser)
    return parser, module


def main(argv: Sequence[str] | None = None) -> int:
    # A closed or full stdout loses the printed text, never the work (planner/stdio.py).
    # Names from files reach the terminal as text, never as escape sequences (planner/stdio.py: terminal_safe).
    guard, err = GuardedStdout(sys.stdout), TerminalSafe(sys.stderr)
    sys.stdout, sys.stderr = guard, err  # type: ignore[assignment]
    try:
        with terminate_as_interrupt():  # SIGTERM cleans up as Ctrl-C does (planner/lifetime.py)
            rc = _main(argv)
        guard.flush()
    finally:
        sys.stdout, sys.stderr = guard.inner, err.inner
        release_all()  # the outputs this command held; one it created and left empty (a refused run) is removed
    problem = guard.problem()
    if problem is not None:
        print(problem, file=sys.stderr)
        return rc or 2
    return rc


def _main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        if not args_list or args_list[0].startswith("-"):
            top = _top_parser()
            ns = top.parse_args(args_list)
            if ns.command is None:
                top.print_help()
                return 0
        command = args_list[0]
        if command not in SUBCOMMANDS:
            raise UserError(f"planner: unknown command {command!r} (choose from {', '.join(SUBCOMMANDS)})")
        parser, module = build_parser(command)
        ns = parser.parse_args(args_list[1:])
        if command in RUNTIME_COMMANDS:  # before any import of it: a package of the user's named runtime is one line
            from planner.shadow import require_runtime

            require_runtime()
        return int(module.run(ns) or 0)  # type: ignore[attr-defined]
    except (UserError, ValidationError, PlanError) as e:
        # One write of the whole line: under torchrun every rank reports the same error to one stderr at once, and
        # print's separate write of the newline lets two ranks' lines run together.
        line = str(e) if str(e).startswith("planner") else f"error: {e}"
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        return 2
    except Terminated:
        print("terminated (SIGTERM)", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def main_and_exit(argv: Sequence[str] | None = None) -> NoReturn:
    """Run the CLI and leave without interpreter teardown (what `python -m planner` and torchrun use).

    Under torchrun, a rank whose peers already exited after a shared error can be aborted by gloo's worker
    threads during teardown, turning its clean exit code 2 into a SIGABRT; everything of ours is closed by then.
    """
    try:
        rc = main(argv)
    except SystemExit as e:  # --help, --version
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # an internal error: the traceback, exit 1 -- at once, so peers are not left waiting
        traceback.print_exc()
        rc = 1
    try:
        sys.stdout.flush()  # a closed pipe here was already reported (or not worth reporting) by main
    except OSError:
        pass
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    main_and_exit()
