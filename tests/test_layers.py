"""The folder layout is the architecture: core -> apply -> measure, report on the core, programs on top.

The distribution installs four import packages.  Reads every import (also the lazy ones inside functions) of
them with ``ast`` and fails on an import that goes against the layers:

    planner      (core)     numpy / scipy only; none of our other packages, and not planner.cli
    runtime      (apply)    planner core             -- the library users import; runtime.collectives is the
                                                         JSON exchange between ranks
    profiler     (measure)  planner core, runtime    -- profiler.workloads: model/dataset specs, emulation
    reports      (report)   planner core
    planner.cli  (programs) anything                 -- `planner profile | plan | train | bench | report | demo`
                                                         (planner/__main__.py belongs to it)
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("planner", "profiler", "runtime", "reports")
"""The import names the distribution installs (pyproject.toml's packages.find)."""
CLI = "planner.cli"
LAYERS = (*PACKAGES, CLI)
ALLOWED: dict[str, frozenset[str]] = {
    "planner": frozenset({"planner"}),
    "runtime": frozenset({"planner", "runtime"}),
    "profiler": frozenset({"planner", "runtime", "profiler"}),
    "reports": frozenset({"planner", "reports"}),
    CLI: frozenset(LAYERS),
}
# The pure core never touches torch (docs/DESIGN.md, "Layers").
FORBIDDEN_THIRD_PARTY: dict[str, frozenset[str]] = {"planner": frozenset({"torch", "matplotlib"})}


def layer_of_module(name: str) -> str:
    """The layer a dotted module name belongs to: ``planner.cli.train`` -> planner.cli, ``planner.plan`` ->
    planner, ``torch.nn`` -> torch."""
    return CLI if name == CLI or name.startswith(CLI + ".") else name.split(".")[0]


def layer_of_file(path: Path, root: Path) -> str:
    rel = path.relative_to(root).as_posix()
    return CLI if rel.startswith("planner/cli/") or rel == "planner/__main__.py" else rel.split("/")[0]


def imported_layers(path: Path) -> list[tuple[int, str]]:
    """(line, layer or top-level package) of every absolute import in the file, lazy imports included."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, layer_of_module(a.name)) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "planner" and any(a.name == "cli" for a in node.names):
                out.append((node.lineno, CLI))
            else:
                out.append((node.lineno, layer_of_module(node.module)))
    return out


def violations(root: Path) -> list[str]:
    """One line per import that breaks the layering, e.g. ``runtime/train.py:3 imports profiler``."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            layer = layer_of_file(path, root)
            allowed, banned = ALLOWED[layer], FORBIDDEN_THIRD_PARTY.get(layer, frozenset())
            for line, name in imported_layers(path):
                if (name in LAYERS and name not in allowed) or name in banned:
                    found.append(f"{path.relative_to(root)}:{line} imports {name}")
    return found


@functools.cache
def real_tree_violations() -> tuple[str, ...]:
    """The real tree's, read once per test process (the tree does not change during a run)."""
    return tuple(violations(ROOT))


def test_the_tree_follows_the_layers() -> None:
    assert real_tree_violations() == ()


def test_only_the_four_packages_exist_and_are_installed() -> None:
    # A new top-level package must be placed in the layers above, not slip past this test.
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "benchmarks", "docs", "scripts"}
    assert packages == set(PACKAGES)
    toml = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'include = ["planner*", "profiler*", "runtime*", "reports*"]' in toml


@pytest.mark.parametrize(("module", "line", "expected"), [
    ("runtime/sampler.py", "from profiler.compute import StepRunner", "runtime/sampler.py:2 imports profiler"),
    ("runtime/sampler.py", "import reports.analysis", "runtime/sampler.py:2 imports reports"),
    ("profiler/run.py", "    from planner.cli.train import train", "profiler/run.py:2 imports planner.cli"),
    ("reports/html.py", "from planner.cli import cmd_report", "reports/html.py:2 imports planner.cli"),
    ("reports/html.py", "from planner import cli", "reports/html.py:2 imports planner.cli"),
    ("planner/solve.py", "import torch", "planner/solve.py:2 imports torch"),
    ("planner/solve.py", "from runtime import HeteroBatchSampler", "planner/solve.py:2 imports runtime"),
    ("planner/plan.py", "    import planner.cli.train", "planner/plan.py:2 imports planner.cli"),
    ("profiler/workloads/specs.py", "from reports import render", "profiler/workloads/specs.py:2 imports reports"),
])
def test_a_forbidden_import_is_caught(tmp_path: Path, module: str, line: str, expected: str) -> None:
    # The same check on a copy of the layout with one bad import added (lazy ones too: `line` may be indented).
    for package in (*PACKAGES, "planner/cli", "profiler/workloads"):
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
        (tmp_path / package / "__init__.py").write_text("")
    body = "def f():\n" + line + "\n" if line.startswith(" ") else "import os\n" + line + "\n"
    (tmp_path / module).write_text(body)
    assert violations(tmp_path) == [expected]
    assert real_tree_violations() == ()  # the real tree stays clean


def test_the_programs_may_import_anything(tmp_path: Path) -> None:
    for package in (*PACKAGES, "planner/cli"):
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "planner/cli/x.py").write_text("import torch\nimport profiler\nimport reports\nimport runtime\n")
    (tmp_path / "planner/__main__.py").write_text("from planner.cli import main\n")
    assert violations(tmp_path) == []
