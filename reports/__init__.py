"""Capacity reports: what a plan gives on a profile, what-ifs, and predicted vs measured from a run log.

Numbers (reports.analysis, reports.whatif) are pure functions of planner types and planner.solve; figures
(reports.figures, matplotlib) and the HTML page (reports.html) are layers on top.  No torch, and no matplotlib at
import time::

    from reports import analyze, options_for
    rep = analyze(profile, plan, options_for(plan), dataset_size=50_000)
    print("\\n".join(rep.findings.lines))
"""

from __future__ import annotations

from planner.runlog import EpochRecord, ReplanRecord, RunLog, read_run_log
from reports.analysis import (
    DEFAULT_DATASET_SIZE,
    Findings,
    LoaderNeed,
    RankRow,
    Report,
    Throughput,
    analyze,
    options_for,
)
from reports.whatif import ScalePoint, SweepPoint, WhatIf

__all__ = [
    "DEFAULT_DATASET_SIZE",
    "EpochRecord",
    "Findings",
    "LoaderNeed",
    "RankRow",
    "ReplanRecord",
    "Report",
    "RunLog",
    "ScalePoint",
    "SweepPoint",
    "Throughput",
    "WhatIf",
    "analyze",
    "options_for",
    "read_run_log",
]
