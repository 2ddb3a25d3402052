"""Regenerate the committed example report and its screenshot.

    .venv/bin/python scripts/render_report_png.py            # writes docs/example-report.html, docs/img/report-top.png

Needs Chromium (scripts/ensure_chromium.sh).  The report is deterministic, so the HTML only changes when the
numbers or the page do.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.cli import main as planner_main  # noqa: E402
from reports.browser import screenshot  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default=str(ROOT / "planner/examples/minimal_profile.json"))
    p.add_argument("--global-batch", type=int, default=512)
    p.add_argument("--html", default=str(ROOT / "docs/example-report.html"))
    p.add_argument("--png", default=str(ROOT / "docs/img/report-top.png"))
    p.add_argument("--height-px", type=int, default=1230,
                   help="screenshot height in px: the top of the page (findings, plan table, curves)")
    args = p.parse_args()
    rc = planner_main(["report", "--profile", args.profile, "--global-batch", str(args.global_batch),
                       "--out", args.html, "--title", "ddp-planner capacity report: example profile", "--quiet"])
    if rc:
        return rc
    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    screenshot(args.html, args.png, width_px=1280, height_px=args.height_px)
    print(f"wrote {args.html} and {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
