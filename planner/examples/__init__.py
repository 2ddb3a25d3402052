"""Example files installed with the package, for the README's tour and for trying the planner without a GPU.

    minimal_profile.json   two ranks, rank 1 three times slower per sample (the tour's and the example report's)

``python -m planner.examples`` copies them into the current folder (``--out DIR`` elsewhere): after a pip install
the package's own folder is somewhere in site-packages, not beside the user.  ``path(name)`` is where one is
installed.
"""

from __future__ import annotations

from pathlib import Path

FOLDER = Path(__file__).resolve().parent
NAMES = ("minimal_profile.json",)


def path(name: str) -> Path:
    """The installed example ``name`` (one of ``NAMES``)."""
    if name not in NAMES:
        raise ValueError(f"no example named {name!r}; the examples are {', '.join(NAMES)}")
    return FOLDER / name


__all__ = ["FOLDER", "NAMES", "path"]
