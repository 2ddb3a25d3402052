"""The folder layout is the architecture: core -> workloads -> measure / apply / report -> programs.

Reads every import (also the lazy ones inside functions) of the project's packages with ``ast`` and fails on an
import that goes against the layers:

    planner     (core)     numpy / scipy only; none of our other packages (planner/cli.py dispatches by name)
    workloads              planner                      -- model/dataset specs, emulation
    collectives            planner                      -- JSON exchange between ranks (torch.distributed)
    profiler    (measure)  planner, workloads, collectives
    runtime     (apply)    planner, collectives         -- the library users import: no profiler, no programs
    reports     (report)   planner
    apps        (programs) anything
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("planner", "workloads", "collectives", "profiler", "runtime", "reports", "apps")
ALLOWED: dict[str, frozenset[str]] = {
    "planner": frozenset({"planner"}),
    "workloads": frozenset({"planner", "workloads"}),
    "collectives": frozenset({"planner", "collectives"}),
    "profiler": frozenset({"planner", "workloads", "collectives", "profiler"}),
    "runtime": frozenset({"planner", "collectives", "runtime"}),
    "reports": frozenset({"planner", "reports"}),
    "apps": frozenset(OURS),
}
# The pure core never touches torch (DESIGN.md section 2).
FORBIDDEN_THIRD_PARTY: dict[str, frozenset[str]] = {"planner": frozenset({"torch", "matplotlib"})}


def imported_packages(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in the file, lazy imports included."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name.split(".")[0]) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


def violations(root: Path) -> list[str]:
    """One line per import that breaks the layering, e.g. ``runtime/train.py:3 imports profiler``."""
    found = []
    for package, allowed in ALLOWED.items():
        for path in sorted((root / package).rglob("*.py")):
            banned = FORBIDDEN_THIRD_PARTY.get(package, frozenset())
            for line, name in imported_packages(path):
                if (name in OURS and name not in allowed) or name in banned:
                    found.append(f"{path.relative_to(root)}:{line} imports {name}")
    return found


def test_the_tree_follows_the_layers() -> None:
    assert violations(ROOT) == []


def test_every_package_is_covered() -> None:
    # A new top-level package must be placed in the layers above, not slip past this test.
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "benchmarks", "docs", "scripts"}
    assert packages == set(OURS)


@pytest.mark.parametrize(("module", "line", "expected"), [
    ("runtime/sampler.py", "from profiler.compute import StepRunner", "runtime/sampler.py:2 imports profiler"),
    ("runtime/sampler.py", "import reports.analysis", "runtime/sampler.py:2 imports reports"),
    ("profiler/run.py", "    from apps.train import train", "profiler/run.py:2 imports apps"),
    ("reports/html.py", "from apps import cmd_report", "reports/html.py:2 imports apps"),
    ("planner/solve.py", "import torch", "planner/solve.py:2 imports torch"),
    ("workloads/specs.py", "from runtime import HeteroBatchSampler", "workloads/specs.py:2 imports runtime"),
])
def test_a_forbidden_import_is_caught(tmp_path: Path, module: str, line: str, expected: str) -> None:
    # The same check on a copy of the layout with one bad import added (lazy ones too: `line` may be indented).
    for package in OURS:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    body = "def f():\n" + line + "\n" if line.startswith(" ") else "import os\n" + line + "\n"
    (tmp_path / module).write_text(body)
    assert violations(tmp_path) == [expected]
    assert violations(ROOT) == []  # the real tree stays clean
