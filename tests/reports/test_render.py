"""The report opens in headless Chromium: every figure is an <img> in the DOM and the page is not blank.

Installs nothing: CI runs scripts/ensure_chromium.sh first; without Chromium this test is skipped.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from planner import solve
from planner.cli import main
from reports.browser import dump_dom, find_chromium, screenshot
from tests.reports._fixtures import three_rank_profile, write_run_log

pytestmark = pytest.mark.skipif(find_chromium() is None, reason="chromium not installed (scripts/ensure_chromium.sh)")


@pytest.mark.subprocess
def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    prof = three_rank_profile()
    prof.save(tmp_path / "p.json")
    plan = solve(prof, global_batch=700)
    plan.save(tmp_path / "plan.json")
    log = write_run_log(tmp_path / "run.jsonl", plan)
    html = tmp_path / "report.html"
    assert main(["report", "--profile", str(tmp_path / "p.json"), "--plan", str(tmp_path / "plan.json"),
                 "--log", str(log), "--out", str(html), "--quiet"]) == 0

    dom = dump_dom(html)
    # Every figure with data (all but memory: no rank has a cap), each an inline PNG.
    ids = ["curves", "split", "sweep", "whatif", "scaling", "log"]
    assert dom.count("<img ") == len(ids) and dom.count("<figure") == len(ids)
    assert all(f'id="fig-{k}"' in dom for k in ids)
    assert "Findings" in dom

    png = tmp_path / "shot.png"
    screenshot(html, png, width_px=1280, height_px=2000)
    from matplotlib.image import imread

    img = np.asarray(imread(png))
    assert img.shape[:2] == (2000, 1280)
    gray = img[..., :3].mean(axis=2)
    assert gray.std() > 0.05  # text, tables and plots, not a blank page
    # Figures are drawn: a good share of the screenshot is neither white nor the page's near-white tints.
    assert (gray < 0.8).mean() > 0.01
