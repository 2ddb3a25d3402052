"""The ``runtime`` package imported must be ddp-planner's, not a user's package of the same name.

ddp-planner installs four top-level packages: ``planner``, ``profiler``, ``runtime`` and ``reports``.  ``runtime``
is a common name: a project with its own ``runtime/`` folder (with an ``__init__.py``), run as ``python -m ...``
or under ``torchrun`` from that folder, has the folder first on ``sys.path``, and ``import runtime`` gives the
user's package.  Left alone that fails far from the cause (``cannot import name 'PlannedRun' from 'runtime'``,
``No module named 'runtime.collectives'``).  So the code of ours that imports ``runtime`` first imports it here
and checks its marker (``runtime.DDP_PLANNER_PACKAGE``); another package is one line naming its path and the fix.

It sits in the core (the standard library only) because its callers are in two layers, the programs
(``planner.cli``) and ``profiler.api``; it imports ``runtime`` by name to check it, which gives the core no use of
runtime's code.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

from planner.errors import ValidationError

MARKER = "DDP_PLANNER_PACKAGE"
"""The attribute ddp-planner's ``runtime/__init__.py`` sets (to ``"runtime"``)."""

_OURS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runtime")
"""Where ddp-planner's runtime sits when installed beside this package (setuptools installs them side by side)."""


def _location(module: ModuleType | None, name: str) -> str:
    """Where ``name`` was (or would be) imported from, for the message."""
    path = getattr(module, "__file__", None) if module is not None else None
    if path is None:
        spec = importlib.util.find_spec(name) if module is None else getattr(module, "__spec__", None)
        if spec is not None:
            path = spec.origin if spec.origin not in (None, "namespace") else next(
                iter(spec.submodule_search_locations or []), None)
    if path is None:
        return "an unknown location"
    p = os.path.abspath(path)
    return os.path.dirname(p) if os.path.basename(p) == "__init__.py" else p


def shadow_message(name: str, location: str) -> str:
    return (f"the '{name}' package imported from {location} is not ddp-planner's (a package of your own with the "
            f"same name comes first on sys.path): rename your {name}/ package, or run from a folder without one "
            "(python -m and torchrun put the current folder first)")


def require_runtime() -> ModuleType:
    """ddp-planner's ``runtime`` package, imported (ValidationError naming the other package when it is not ours).

    Importing it here also keeps it: ``sys.modules`` then holds ours for every later ``import runtime...``, even
    when the current folder is put on ``sys.path`` afterwards (``--model mymodel:build``)."""
    module = sys.modules.get("runtime")
    if module is None:
        try:
            module = importlib.import_module("runtime")
        except ImportError as e:
            if importlib.util.find_spec("runtime") is None:
                raise ValidationError("ddp-planner's 'runtime' package is not installed beside 'planner' "
                                      "(reinstall: pip install ddp-planner)") from None
            where = _location(None, "runtime")
            if where == _OURS:  # ours, failing on an import of its own (torch missing): that error as it is
                raise
            raise ValidationError(f"{shadow_message('runtime', where)} ({e})") from None
    if getattr(module, MARKER, None) != "runtime":
        raise ValidationError(shadow_message("runtime", _location(module, "runtime")))
    return module


__all__ = ["MARKER", "require_runtime", "shadow_message"]
