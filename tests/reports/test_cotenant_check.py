"""The GPU co-tenant check's verdict logic (benchmarks/gpu_causes_check.py), on reports built from known states."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import planner
from planner.devstate import GpuProcess
from reports.analysis import analyze, options_for
from reports.html import render_html
from reports.summary import format_summary
from tests._scripts import load_script
from tests.reports.test_causes import CLEAN, COTENANT, GIB, profile, rank

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_causes_check.py"


def _script() -> ModuleType:
    return load_script(SCRIPT, "gpu_causes_check")


def _verdict(state0: object, state1: object, *, pid: int = 4242, hold_gib: float = 12.0) -> dict:
    prof = profile(rank(0, 0.0005, state0), rank(1, 0.001, state1))  # type: ignore[arg-type]
    plan = planner.solve(prof, global_batch=512)
    rep = analyze(prof, plan, options_for(plan))
    report = json.loads(json.dumps(rep.to_dict()))  # what --json writes
    return _script().check_report(report, format_summary(rep), render_html(rep, {}), rank=1, pid=pid,
                                  hold_bytes=int(hold_gib * GIB), gpu=True)


def test_a_named_co_tenant_passes_every_check() -> None:
    checks = _verdict(CLEAN, COTENANT)
    assert all(checks[k] for k in _script().REQUIRED_GPU), checks
    assert checks["other_process_gib"] == 12.1 and "pid 4242" in checks["finding"]


def test_the_check_fails_when_the_report_does_not_name_it() -> None:
    assert not _verdict(CLEAN, CLEAN)["cause_is_the_cotenant"]  # slow, but no other process seen
    assert not _verdict(CLEAN, COTENANT, pid=999)["its_pid"]  # another process than the one started
    assert not _verdict(CLEAN, COTENANT, hold_gib=20.0)["its_memory"]  # less memory than it held
    assert not _verdict(COTENANT, COTENANT)["other_ranks_alone"]


def test_across_a_pid_namespace_the_memory_identifies_it() -> None:
    foreign = replace(COTENANT, other_processes=(GpuProcess(pid=881234, used_bytes=int(12.1 * GIB)),),
                      own_pid_by_memory=True)
    checks = _verdict(CLEAN, foreign)
    assert checks["pids_from_another_namespace"] and checks["its_pid"] and checks["finding_names_pid"]
    assert all(checks[k] for k in _script().REQUIRED_GPU), checks
