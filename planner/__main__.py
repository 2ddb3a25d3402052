"""`python -m planner ...` (and `torchrun -m planner ...`) runs the CLI."""

import sys

from planner.cli import main

sys.exit(main())
