"""Command-line values checked before any work starts: ranges, rank maps, and what a resumed run may change.

Numbers go through argparse ``type=`` functions (``count``, ``real``), so a value out of range is refused while
the command line is parsed -- one line naming the option, before torch is even imported.  Unchecked, ``0`` and
negatives would read as "the default" (``args.steps or 15``) or crash deep inside (``--image-size 0`` divides by
zero), ``2**63`` would overflow numpy's int64, and ``nan`` and ``inf`` pass every ``>`` test.

``check_resume`` compares what a command line asks with what the checkpoint it resumes from was trained with:
unchecked, the checkpoint would win silently (its plan and learning rate replacing the ones given), or crash
(another model's weights).  Pure: the standard library only.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from planner.errors import ValidationError
from planner.shown import shown_apart

MAX_COUNT = 2**31 - 1
"""Largest batch size, sample count or step count accepted: numpy and torch index with int64, and the MILP's
integer bounds are doubles (exact to 2**53); 2**31 - 1 leaves room for every sum and product the planner forms."""

MAX_IMAGE_SIZE = 8192
"""Largest ``--image-size`` of `planner train` (and of the run record a checkpoint carries): a side of 2**20 asked
for a petabyte-sized first layer and died in a traceback."""

ALLOW_RESUME_FLAG = "--allow-resume-changes"
GPU_NORMALIZE_CHOICES = ("auto", "on", "off")
"""``--gpu-normalize`` (profiler.workloads.specs.gpu_normalize_for): auto (on when every rank trains on CUDA and the
transforms are ours), on, off."""


def count(lo: int = 1, hi: int = MAX_COUNT) -> Callable[[str], int]:
    """An argparse ``type``: an integer in [lo, hi] (argparse prefixes the option's name to the message)."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not lo <= value <= hi:
            bound = f">= {lo}" if value < lo else f"<= {hi}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    parse.__name__ = "count"
    return parse


def real(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
         hi_open: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite number in the range (``lo_open``: strictly above ``lo``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if lo is not None and (value <= lo if lo_open else value < lo):
            raise argparse.ArgumentTypeError(f"must be {'>' if lo_open else '>='} {lo:g}, got {text}")
        if hi is not None and (value >= hi if hi_open else value > hi):
            raise argparse.ArgumentTypeError(f"must be {'<' if hi_open else '<='} {hi:g}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


def check_ranks(ranks: Iterable[int], world_size: int, flag: str) -> None:
    """Refuse a per-rank setting (``--emulate-slowdown 5=3``) for a rank the job does not have."""
    missing = sorted(r for r in set(ranks) if r >= world_size)
    if missing:
        have = "rank 0" if world_size == 1 else f"ranks 0..{world_size - 1}"
        raise ValidationError(f"{flag}: rank {missing[0]} does not exist in a job of {world_size} rank(s) ({have})")


def check_global_batch(global_batch: int, world_size: int, min_batch: int, *, why: str = "") -> None:
    """Refuse a global batch too small to give every rank ``min_batch`` -- before anything is profiled."""
    if global_batch < world_size * min_batch:
        raise ValidationError(
            f"--global-batch {global_batch} cannot give each of {world_size} rank(s) the min batch {min_batch}{why}: "
            f"use --global-batch >= {world_size * min_batch}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ResumeValue:
    """One setting a resumed run compares with its checkpoint."""

    flag: str
    """The option (``--lr``), for the message."""
    saved: object
    """What the checkpoint's run used (None: not recorded, nothing to compare)."""
    given: object
    """What this command line gives (None: not given, the checkpoint's is used)."""
    changeable: bool = True
    """False: refused even with --allow-resume-changes (a value the checkpoint cannot continue under)."""
    why: str = ""
    """For an unchangeable value: the reason, said in the message."""
    fix: str = ""
    """How to resume without the change (default: "resume with FLAG SAVED")."""

    @property
    def differs(self) -> bool:
        return self.saved is not None and self.given is not None and self.saved != self.given


def _show(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def check_resume(values: Iterable[ResumeValue], *, allow: bool) -> list[str]:
    """Refuse the first value that differs from the checkpoint's, naming both; with ``allow`` accept the
    changeable ones and return one note per accepted change (the caller prints them).

    Raises:
        ValidationError: a differing value that is not allowed.
    """
    notes = []
    for v in values:
        if not v.differs:
            continue
        given, saved = shown_apart([v.given, v.saved], 80, text=_show)  # cut, never alike
        if not v.changeable:
            raise ValidationError(f"--resume: {v.flag} {given} differs from the checkpoint's {saved}; {v.why}")
        if not allow:
            raise ValidationError(
                f"--resume: {v.flag} {given} differs from the checkpoint's {saved}; {v.fix or f'resume with {v.flag} {saved}'}"
                f", or pass {ALLOW_RESUME_FLAG} to continue with {given}")
        notes.append(f"resuming with {v.flag} {given} instead of the checkpoint's {saved} ({ALLOW_RESUME_FLAG})")
    return notes


__all__ = ["ALLOW_RESUME_FLAG", "MAX_COUNT", "MAX_IMAGE_SIZE", "ResumeValue", "check_global_batch", "check_ranks", "check_resume",
           "count", "real"]
