"""docs/FRAMEWORKS.md says what is true of its diffs: each heading's line count is its diff's, and each adapter's
section says which sample order the plan keeps (tests/frameworks/test_shuffle_order.py checks the behaviour)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "FRAMEWORKS.md"


def sections() -> dict[str, str]:
    """Each '## ' section's body, keyed by its heading."""
    parts = re.split(r"^## (.+)$", DOC.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def diff_lines(body: str) -> int:
    """The section's first diff: its removed and added lines, blank ones not counted (the page's rule)."""
    block = re.search(r"```diff\n(.*?)```", body, re.S)
    assert block, "the section has no diff"
    lines = [line for line in block.group(1).splitlines() if not line.startswith(("--- ", "+++ "))]
    return sum(1 for line in lines if line[:1] in "+-" and line[1:].strip())


def test_every_heading_counts_its_diffs_lines() -> None:
    counted = {heading: body for heading, body in sections().items() if re.search(r"\(\d+ lines\)$", heading)}
    assert len(counted) >= 3, sorted(sections())  # Lightning, Accelerate, the HF Trainer at least
    for heading, body in counted.items():
        said = int(re.search(r"\((\d+) lines\)$", heading).group(1))  # type: ignore[union-attr]
        assert diff_lines(body) == said, (heading, diff_lines(body))
    assert "six to eight lines" in DOC.read_text().split("\n## ", 1)[0]  # what ADOPTING.md says of plain DDP
    assert "six to eight lines" in (ROOT / "docs" / "ADOPTING.md").read_text()


def test_every_adapter_says_which_order_it_keeps() -> None:
    found = sections()
    by_name = {name: next(body for heading, body in found.items() if heading.startswith(name))
               for name in ("Lightning", "Accelerate", "Hugging Face Trainer")}
    assert "`shuffle=False`" in by_name["Lightning"] and "keeps the dataset's order" in by_name["Lightning"]
    assert "`shuffle=` is required" in by_name["Accelerate"]
    assert '`"sequential"` keeps the dataset\'s order' in by_name["Hugging Face Trainer"]
