"""Strings from the files the report reads (profile, plan, run log) and from --title reach the page escaped.

The report is opened in a browser; a device name such as ``<script>alert(1)</script>`` in a profile someone sent
must show as text, never run (docs/SECURITY.md).
"""

from __future__ import annotations

import dataclasses
import html
import json
from pathlib import Path

from planner import solve
from planner.cli import main
from planner.profile import ModelInfo, Profile
from planner.solve import SolveOptions
from reports import read_run_log  # re-exported wherever the run-log reader lives
from reports.analysis import analyze
from reports.figures import render_all
from reports.html import render_html
from tests.reports._fixtures import three_rank_profile, write_run_log

DEVICE = "<script>alert(1)</script>"
HOST = '"><img src=x onerror=alert(2)>'
MODEL = "<script>alert(3)</script>"
REASON = "<script>alert(4)</script>"
TITLE = "<script>alert('title')</script> & co"


def _hostile_profile() -> Profile:
    """three_rank_profile with markup in rank 0's device name, rank 2's host name and the model name."""
    prof = three_rank_profile()
    r0, r1, r2 = prof.ranks
    return dataclasses.replace(
        prof,
        hosts=(*prof.hosts, dataclasses.replace(prof.hosts[0], name=HOST)),
        ranks=(dataclasses.replace(r0, device_name=DEVICE), r1, dataclasses.replace(r2, host=HOST)),
        model=ModelInfo(name=MODEL),
    )


def _hostile_log(path: Path, prof: Profile) -> Path:
    plan = solve(prof, global_batch=700)
    write_run_log(path, plan)
    text = path.read_text(encoding="utf-8").replace('"rank 2 slowed down"', json.dumps(REASON))
    path.write_text(text, encoding="utf-8")
    return path


def _assert_escaped(page: str) -> None:
    assert "<script" not in page.lower(), "the page has no scripts of its own, so any <script is injected"
    assert "onerror=" not in page.replace("onerror=alert(2)&gt;", "")  # only inside the escaped host name
    for raw in (DEVICE, HOST, MODEL, REASON, TITLE):
        assert raw not in page
        assert html.escape(raw, quote=True) in page, f"{raw!r} not shown (escaped) on the page"


def test_profile_log_and_title_strings_are_escaped(tmp_path: Path) -> None:
    prof = _hostile_profile()
    plan = solve(prof, global_batch=700)
    log = read_run_log(_hostile_log(tmp_path / "run.jsonl", prof))
    rep = analyze(prof, plan, SolveOptions(), log=log)
    page = render_html(rep, render_all(rep), title=TITLE)
    _assert_escaped(page)
    assert page.count(f"<title>{html.escape(TITLE, quote=True)}</title>") == 1


def test_cli_report_from_hostile_files_is_escaped(tmp_path: Path) -> None:
    # The real path: the strings arrive in a profile JSON and a run log read from disk.
    prof = _hostile_profile()
    prof.save(tmp_path / "p.json")
    log = _hostile_log(tmp_path / "run.jsonl", prof)
    out = tmp_path / "report.html"
    assert main(["report", "--profile", str(tmp_path / "p.json"), "--log", str(log), "--global-batch", "700",
                 "--title", TITLE, "--out", str(out), "--quiet"]) == 0
    _assert_escaped(out.read_text(encoding="utf-8"))


def test_a_dollar_in_a_device_name_is_text_not_mathtext() -> None:
    # "$\frac{$" is a malformed mathtext formula: drawn as math it raised inside matplotlib (a traceback, exit 1).
    prof = three_rank_profile()
    r0, r1, r2 = prof.ranks
    prof = dataclasses.replace(prof, ranks=(dataclasses.replace(r0, device_name="$\\frac{$ GPU"), r1, r2))
    plan = solve(prof, global_batch=700)
    rep = analyze(prof, plan, SolveOptions(), dataset_size=10_000)
    figures = render_all(rep)
    assert figures and all(png.startswith(b"\x89PNG") for png in figures.values())
