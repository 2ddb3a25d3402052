"""Run ``planner`` with per-rank arguments under torchrun: every ``{rank}`` in argv becomes this rank's RANK.

torchrun starts every rank with the same command line; a real mistake (rank 1 given another --plan or --seed)
needs different ones.  ``torchrun ... tests/reliability/_launch.py train --seed {rank} ...``
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    # torchrun runs this file as a script: make the repository importable like `python -m planner` would.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from planner.cli import main_and_exit

    rank = os.environ.get("RANK", "0")
    main_and_exit([a.replace("{rank}", rank) for a in sys.argv[1:]])  # exits like `python -m planner`


if __name__ == "__main__":
    main()
