"""Load a script that is not a package module (benchmarks/*.py, an example or adopted training script) as a module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(path: str | Path, name: str) -> ModuleType:
    """The file at ``path`` executed as module ``name``, registered in sys.modules first (dataclasses look their
    module up while the class is built)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py as module ``name``."""
    return load_script(BENCHMARKS / f"{name}.py", name)
